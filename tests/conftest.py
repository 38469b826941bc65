"""Shared fixtures: the built wheel installed into a fresh virtual environment
with real torch, and a runner that starts a fresh interpreter per scenario
(the hook changes process-wide state, so no scenario shares a process)."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kit import last_json

ROOT = Path(__file__).resolve().parent.parent
TORCH_SPEC = os.environ.get("OUTOFCUDA_TEST_TORCH", "torch==2.13.0")


# OUTOFCUDA_BUILD_SANITIZE=1: the wheel is built with AddressSanitizer and
# UndefinedBehaviorSanitizer and every scenario interpreter runs with the ASan
# runtime preloaded (Python itself is not instrumented) and PYTHONMALLOC=malloc
# so ASan sees Python's allocations. Leak detection stays off: torch and
# CPython keep allocations until exit by design.
SANITIZE = os.environ.get("OUTOFCUDA_BUILD_SANITIZE") == "1"


def _sanitizer_env():
    runtime = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                             text=True).stdout.strip()
    return {
        "LD_PRELOAD": runtime,
        "PYTHONMALLOC": "malloc",
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:exitcode=86:detect_stack_use_after_return=0",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=87",
    }


# The tests build as CI and development do: a compiler warning fails the
# build (setup.py adds -Werror only then; a user's pip install never has it).
WERROR = {"OUTOFCUDA_BUILD_WERROR": "1"}


def _clean_env(extra=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OUTOFCUDA_", "PYTORCH_", "PYTHON", "NVIDIA_TF32", "LOCAL_RANK",
                                "ASAN_", "UBSAN_", "LD_PRELOAD"))}
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update({k: v for k, v in extra.items() if v is not None})
    return env


def _pip(python, *args):
    # Once a sanitizer build is installed, its hook loads in every interpreter
    # of that environment, pip's included: the runtime must be preloaded.
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True, env=_clean_env(_sanitizer_env() if SANITIZE else None))


# The fast tier for the edit-test loop (`pytest -m fast`, tests/README.md): the
# files whose tests need no virtual environment of their own beyond the one
# OUTOFCUDA_TEST_VENV keeps (the pure-C drivers, the parsers, the stand-in
# releases of torch). A test that asks for the CUDA build stays out of it.
FAST_TIER = ("test_advice.py", "test_known_bugs.py", "test_gating.py", "test_config.py",
             "test_debug.py", "test_apply.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the fast tier (tests/conftest.py FAST_TIER)")


def pytest_collection_modifyitems(items):
    for item in items:
        if (item.path.parent.name == "tests" and item.path.name in FAST_TIER
                and "cuda_venv" not in item.fixturenames):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """The project's wheel, built once per test session."""
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    # Build from a copy so the checkout's build/ and in-place .so stay out of it.
    src = build / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "*.so", ".venv*", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)],
                   check=True, env=_clean_env(dict(WERROR, OUTOFCUDA_BUILD_SANITIZE="1" if SANITIZE else None)))
    (whl,) = out.glob("outofcuda-*.whl")
    return whl


@pytest.fixture(scope="session")
def base_venv(tmp_path_factory):
    """A virtual environment holding torch (and numpy, which torch warns about
    when missing) but not outofcuda. OUTOFCUDA_TEST_VENV reuses one across runs."""
    reuse = os.environ.get("OUTOFCUDA_TEST_VENV")
    path = Path(reuse) if reuse else tmp_path_factory.mktemp("venv") / "base"
    python = path / "bin" / "python"
    if not (python.exists() and (path / ".ready").exists()):
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        _pip(python, "install", "numpy", TORCH_SPEC)
        (path / ".ready").write_text("ok")
    return path


class Venv:
    def __init__(self, path, python=None):
        self.path = Path(path)
        self.python = Path(python) if python else self.path / "bin" / "python"
        out = subprocess.run([str(self.python), "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True,
                             env=_clean_env(_sanitizer_env() if SANITIZE else None))
        self.site = Path(out.stdout.strip())

    @classmethod
    def from_python(cls, python):
        prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], check=True,
                                capture_output=True, text=True).stdout.strip()
        return cls(prefix, python)

    def run(self, code="", *, env=None, args=(), cwd=None, timeout=120, input=None):
        """Runs `python [args] -c code` in a fresh interpreter, clean environment."""
        cmd = [str(self.python), *args]
        if code is not None:
            cmd += ["-c", textwrap.dedent(code)]
        full = dict(_sanitizer_env(), **(env or {})) if SANITIZE else env
        return subprocess.run(cmd, env=_clean_env(full), cwd=cwd, capture_output=True,
                              text=True, timeout=timeout, input=input)

    def check(self, code, **kw):
        r = self.run(code, **kw)
        assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
        return r

    def json(self, code, prefix=None, *, quiet=False, **kw):
        """Runs code (as run does) and returns the JSON value it printed last
        (kit.last_json: the exit must be 0; prefix, quiet as there)."""
        return last_json(self.run(code, **kw), prefix, quiet=quiet)


@pytest.fixture(scope="session")
def venv(request):
    """The base environment with the built wheel installed (re-installed once
    per session, so a reused environment always holds this checkout's build).

    OUTOFCUDA_TEST_PYTHON names an interpreter that already has outofcuda and a
    CUDA torch installed (the GPU machine, which cannot download torch): then
    that one is used as it is."""
    given = os.environ.get("OUTOFCUDA_TEST_PYTHON")
    if given:
        return Venv.from_python(given)
    base_venv = request.getfixturevalue("base_venv")
    wheel = request.getfixturevalue("wheel")
    _pip(base_venv / "bin" / "python", "install", "--force-reinstall", "--no-deps", str(wheel))
    return Venv(base_venv)


def pip_target(python, spec, reuse_var, tmp_path_factory):
    """A package from the index installed once into a folder of its own that
    a scenario puts on PYTHONPATH (the shared environment stays as it is);
    the variable reuse_var names one to reuse. Skips where pip fails, except
    in CI (CI=1), where that fails."""
    reuse = os.environ.get(reuse_var)
    path = Path(reuse) if reuse else tmp_path_factory.mktemp(spec.split("=")[0]) / "site"
    if not (path / ".ready").exists():
        try:
            _pip(python, "install", "--target", str(path), spec)
        except subprocess.CalledProcessError as e:
            (pytest.fail if os.environ.get("CI") == "1" else pytest.skip)(
                f"pip install {spec} failed (exit {e.returncode})")
        (path / ".ready").write_text("ok")
    return str(path)


@pytest.fixture
def workdir(tmp_path):
    """An empty working directory for a scenario."""
    d = tmp_path / "work"
    d.mkdir()
    return d


# ---- the real CUDA build of torch (imports without a GPU) ----

CUDA_TORCH_SPEC = os.environ.get("OUTOFCUDA_TEST_CUDA_TORCH", "torch==2.14.1")
CUDA_VENV_FREE_BYTES = 12 * 1024**3  # the CUDA wheels unpack to about 8 GB


def _unavailable(reason):
    """Skips, except in CI (CI=1), where a missing CUDA build is a failure."""
    if os.environ.get("CI") == "1":
        pytest.fail(f"CUDA build of torch unavailable in CI: {reason}")
    pytest.skip(f"CUDA build of torch unavailable: {reason}")


@pytest.fixture(scope="session")
def cuda_base_venv(tmp_path_factory):
    """A virtual environment holding the CUDA build of torch (numpy too) but
    not outofcuda, created once per session. OUTOFCUDA_TEST_CUDA_VENV reuses
    one across runs."""
    import platform
    reuse = os.environ.get("OUTOFCUDA_TEST_CUDA_VENV")
    path = Path(reuse) if reuse else tmp_path_factory.mktemp("cuda-venv") / "base"
    python = path / "bin" / "python"
    if not (python.exists() and (path / ".ready").exists()):
        if platform.machine() != "x86_64":
            _unavailable(f"PyPI's CUDA wheels are built for x86_64, this is {platform.machine()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
        if free < CUDA_VENV_FREE_BYTES:
            _unavailable(f"{free / 1024**3:.1f} GiB free under {path.parent}, the CUDA build "
                         f"needs {CUDA_VENV_FREE_BYTES / 1024**3:.0f} GiB")
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        try:
            _pip(python, "install", "numpy", CUDA_TORCH_SPEC)
        except subprocess.CalledProcessError as e:
            _unavailable(f"pip install {CUDA_TORCH_SPEC} failed (exit {e.returncode})")
        (path / ".ready").write_text("ok")
    r = subprocess.run([str(python), "-c", "import torch; print(torch.version.cuda)"],
                       capture_output=True, text=True, env=_clean_env({"OUTOFCUDA_DISABLE": "1"}))
    if r.returncode != 0 or r.stdout.strip() in ("", "None"):
        _unavailable(f"{CUDA_TORCH_SPEC} in {path} is not a CUDA build "
                     f"(torch.version.cuda: {r.stdout.strip() or r.stderr[-300:]})")
    return path


@pytest.fixture(scope="session")
def cuda_venv(cuda_base_venv, wheel):
    """The CUDA-build environment with this checkout's wheel installed."""
    _pip(cuda_base_venv / "bin" / "python", "install", "--force-reinstall", "--no-deps", str(wheel))
    return Venv(cuda_base_venv)


# The stand-in NVIDIA driver library (tests/stub_nvml/stub_nvml.c) shared by
# every test that needs NVML without a GPU: built once per session, found only
# through LD_LIBRARY_PATH, answering from the file named by STUB_NVML_CONFIG.
STUB_NVML_SRC = ROOT / "tests" / "stub_nvml" / "stub_nvml.c"
STUB_NVML_VARIANTS = {"full": [], "legacy": ["-DSTUB_LEGACY"], "no_memory": ["-DSTUB_NO_MEMORY"],
                      "no_cc": ["-DSTUB_NO_CC"]}


@pytest.fixture(scope="session")
def stub_nvml_libs(tmp_path_factory):
    """{variant: folder holding that build of the stand-in libnvidia-ml.so.1}."""
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build the stand-in NVIDIA library")
    out = {}
    for name, flags in STUB_NVML_VARIANTS.items():
        d = tmp_path_factory.mktemp(f"stubnvml-{name}")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror",
                        "-std=gnu11", *flags, "-o", str(d / "libnvidia-ml.so.1"),
                        str(STUB_NVML_SRC)], check=True)
        out[name] = d
    return out


@pytest.fixture(scope="session")
def stub_nvml(stub_nvml_libs):
    """The folder holding the stand-in libnvidia-ml.so.1 with every entry point."""
    return stub_nvml_libs["full"]


def stub_nvml_device(name="NVIDIA A100-SXM4-80GB",
                     uuid="GPU-0a1b2c3d-0000-4000-8000-000000000000", cc="8.0", total=80 << 30,
                     used=1 << 30, util="37,12"):
    """One `device` line of the stand-in's configuration."""
    return (f"device name={name.replace(' ', '_')} uuid={uuid} cc={cc} total={total} "
            f"used={used} util={util}")


def stub_nvml_config(path, devices, procs=(), stride=24, errors=(), migs=(), driver="550.54.15",
                     utilseqs=()):
    """Writes the stand-in's answers; procs: (device, pid, bytes); errors:
    (function[@device], code); utilseqs: (device, [value, ...], end) with end
    "", "+" or "hang". Replaces the file (the stand-in re-reads it)."""
    lines = [f"driver {driver}", f"stride {stride}", *devices]
    lines += [f"proc {d} {pid} {b}" for d, pid, b in procs]
    lines += [f"error {fn} {code}" for fn, code in errors]
    lines += [f"mig {uuid} {parent}" for uuid, parent in migs]
    lines += [" ".join(["utilseq", str(d), *map(str, values), end]).rstrip()
              for d, values, end in utilseqs]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def pure_c_driver(out_dir, driver, *sources):
    """Builds tests/<driver> with the pure-C sources (src/<name>, OC_PURE_C,
    no Python) under ASan and UBSan into out_dir; returns a function that
    feeds it one case a line and returns its stdout."""
    if shutil.which("gcc") is None:
        pytest.fail(f"gcc is needed to build {driver}")
    exe = Path(out_dir) / "driver"
    subprocess.run(["gcc", "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-DOC_PURE_C",
                    "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-o", str(exe), str(ROOT / "tests" / driver),
                    *(str(ROOT / "src" / s) for s in sources)], check=True)

    def run(cases):
        text = "".join(" ".join(map(str, c)) + "\n" for c in cases)
        return subprocess.run([str(exe)], input=text, capture_output=True, text=True,
                              check=True).stdout
    return run
