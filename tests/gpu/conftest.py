"""The `gpu` fixture of the GPU checks: the test environment (tests/conftest.py
`venv`), once torch there can use CUDA. The device check comes first so a
machine without an NVIDIA GPU skips without building anything.

OUTOFCUDA_TEST_REQUIRE_GPU=1 (set by benchmarks/gpu_check.sh) turns every skip that
happens before a test body runs (this fixture, skipif marks, a module that
skips at import) into a failure: on the GPU machine a missing GPU must not pass
as "nothing failed". A skip from inside a test body (a check this machine
cannot make, with its reason) stays a skip and is listed.

In a dry run (OUTOFCUDA_TEST_GPU_DRY_RUN=1, tests/gpu/__init__.py) the fixture is
the same environment with "cuda" made the CPU and the stand-in NVIDIA library
of an H200: each scenario runs end to end. A scenario that dies of a mistake
in its own code (a name, an import, a path: DRY_RUN_MISTAKES) fails the dry
run; an assertion about a figure only a GPU gives is reported as xfailed. A
scenario runs once per dry run: run again, in the same folder, with only
outofcuda's decisions changed (SAME_CODE_PATH: outofcuda on or off, its cap,
its allocator or dtype), it gives back its first result, since on the CPU those
change figures, not which lines run (the CPU cost of a dry run is its
interpreters, each about 3 s of importing torch)."""
import os
import re
import textwrap
from pathlib import Path

import pytest

from gpu import DRY_RUN

REQUIRED = os.environ.get("OUTOFCUDA_TEST_REQUIRE_GPU", "").strip() == "1"
# The exceptions that, raised in a scenario or a test on the CPU, are a mistake
# in the check itself rather than a figure the CPU cannot give.
DRY_RUN_MISTAKES = ("SyntaxError", "IndentationError", "NameError", "UnboundLocalError",
                    "ImportError", "ModuleNotFoundError", "AttributeError", "FileNotFoundError",
                    "TypeError", "KeyError", "IndexError")


# The variables whose values a scenario is run under again in the GPU run,
# to compare figures (with and without outofcuda, with and without its cap):
# none names a file the scenario writes.
SAME_CODE_PATH = ("OUTOFCUDA_DISABLE", "OUTOFCUDA_MEMORY_FRACTION", "OUTOFCUDA_ALLOC_CONF",
                  "OUTOFCUDA_AMP_DTYPE", "OUTOFCUDA_KNOWN_BUGS")


class DryRunMistake(Exception):
    """A scenario died of a mistake in its own code during the dry run."""


def _unavailable(reason):
    if REQUIRED:
        pytest.fail(f"OUTOFCUDA_TEST_REQUIRE_GPU=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _skip_reason(longrepr):
    # A skip's longrepr is (file, line, "Skipped: reason").
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(tryfirst=True)
def pytest_collectreport(report):
    if REQUIRED and report.skipped:
        report.outcome = "failed"
        report.longrepr = (f"OUTOFCUDA_TEST_REQUIRE_GPU=1 but the module skipped: "
                           f"{_skip_reason(report.longrepr)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (DRY_RUN and report.when == "call" and report.failed and call.excinfo is not None
            and call.excinfo.errisinstance(AssertionError)):
        report.outcome = "skipped"
        report.wasxfail = ("dry run: a figure only the GPU gives: "
                           + str(call.excinfo.value).splitlines()[0][:200]
                           if str(call.excinfo.value) else "dry run: a figure only the GPU gives")
    if REQUIRED and report.skipped and report.when == "setup":
        report.outcome = "failed"
        report.longrepr = (f"OUTOFCUDA_TEST_REQUIRE_GPU=1 but skipped before running: "
                           f"{_skip_reason(report.longrepr)}")


class DryRunVenv:
    """The test environment with the CPU in the GPU's place (a dry run)."""

    def __init__(self, venv, env):
        self.venv, self.env, self.path, self.python = venv, env, venv.path, venv.python
        self.done = {}

    def run(self, code="", *, env=None, **kw):
        env = dict(self.env, **(env or {}))
        key = repr((code, kw.get("args"), kw.get("cwd"), kw.get("input"),
                    sorted((k, v) for k, v in env.items() if k not in SAME_CODE_PATH)))
        if key in self.done:
            return self.done[key]
        r = self.venv.run(textwrap.dedent(code) if code is not None else None, env=env, **kw)
        last = [ln for ln in r.stderr.strip().splitlines() if ln and not ln.startswith(" ")]
        m = re.match(r"(\w+)(:|$)", last[-1]) if r.returncode and last else None
        if m and m.group(1) in DRY_RUN_MISTAKES:
            raise DryRunMistake(f"the scenario died of {m.group(1)} on the CPU:\n{r.stderr[-3000:]}"
                                f"\n--- scenario ---\n{code}")
        self.done[key] = r
        return r

    def check(self, code, **kw):
        r = self.run(code, **kw)
        assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
        return r

    def json(self, code, prefix=None, *, quiet=False, **kw):
        from kit import last_json
        return last_json(self.run(code, **kw), prefix, quiet=quiet)


def _dry_run_gpu(request, tmp_path_factory):
    from conftest import stub_nvml_config, stub_nvml_device
    venv = request.getfixturevalue("venv")
    libs = request.getfixturevalue("stub_nvml")
    cfg = stub_nvml_config(tmp_path_factory.mktemp("dry-run-nvml") / "nvml.txt", [
        stub_nvml_device(name="NVIDIA H200", cc="9.0", total=143771 << 20, used=600 << 20)])
    return DryRunVenv(venv, {"PYTHONPATH": str(Path(__file__).parent / "dry_run"),
                             "LD_LIBRARY_PATH": str(libs), "STUB_NVML_CONFIG": str(cfg)})


@pytest.fixture(scope="module")
def gpu(request, tmp_path_factory):
    if DRY_RUN:
        return _dry_run_gpu(request, tmp_path_factory)
    if not (os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia/gpus")):
        _unavailable("no NVIDIA GPU on this machine")
    venv = request.getfixturevalue("venv")
    r = venv.run("import torch; print(torch.cuda.is_available())")
    if r.returncode != 0 or r.stdout.strip() != "True":
        _unavailable("torch.cuda.is_available() is False in the test environment "
                     f"(exit {r.returncode}: {(r.stdout + r.stderr).strip()[-300:]})")
    return venv
