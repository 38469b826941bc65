"""The `gpu` fixture of the GPU checks: the test environment (tests/conftest.py
`venv`), once torch there can use CUDA. The device check comes first so a
machine without an NVIDIA GPU skips without building anything.

OUTOFCUDA_REQUIRE_GPU=1 (set by benchmarks/gpu_check.sh) turns every skip that
happens before a test body runs (this fixture, skipif marks, a module that
skips at import) into a failure: on the GPU machine a missing GPU must not pass
as "nothing failed". A skip from inside a test body (a check this machine
cannot make, with its reason) stays a skip and is listed."""
import os

import pytest

REQUIRED = os.environ.get("OUTOFCUDA_REQUIRE_GPU", "").strip() == "1"


def _unavailable(reason):
    if REQUIRED:
        pytest.fail(f"OUTOFCUDA_REQUIRE_GPU=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _skip_reason(longrepr):
    # A skip's longrepr is (file, line, "Skipped: reason").
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(tryfirst=True)
def pytest_collectreport(report):
    if REQUIRED and report.skipped:
        report.outcome = "failed"
        report.longrepr = (f"OUTOFCUDA_REQUIRE_GPU=1 but the module skipped: "
                           f"{_skip_reason(report.longrepr)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped and report.when == "setup":
        report.outcome = "failed"
        report.longrepr = (f"OUTOFCUDA_REQUIRE_GPU=1 but skipped before running: "
                           f"{_skip_reason(report.longrepr)}")


@pytest.fixture(scope="module")
def gpu(request):
    if not (os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia/gpus")):
        _unavailable("no NVIDIA GPU on this machine")
    venv = request.getfixturevalue("venv")
    r = venv.run("import torch; print(torch.cuda.is_available())")
    if r.returncode != 0 or r.stdout.strip() != "True":
        _unavailable("torch.cuda.is_available() is False in the test environment "
                     f"(exit {r.returncode}: {(r.stdout + r.stderr).strip()[-300:]})")
    return venv
