"""Shared fixtures: the built wheel installed into a fresh virtual environment
with real torch, and a runner that starts a fresh interpreter per scenario
(the hook changes process-wide state, so no scenario shares a process)."""
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import textwrap
import time
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
                                "ASAN_", "UBSAN_", "LD_PRELOAD", "PYTEST_"))}
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update({k: v for k, v in extra.items() if v is not None})
    return env


def _pip(python, *args):
    # Once a sanitizer build is installed, its hook loads in every interpreter
    # of that environment, pip's included: the runtime must be preloaded.
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "--no-cache-dir", "-q", *args],
                   check=True, env=_clean_env(_sanitizer_env() if SANITIZE else None))


# The fast tier for the edit-test loop (`pytest -m fast`, tests/README.md): the
# files whose tests need no virtual environment of their own beyond the one
# OUTOFCUDA_TEST_VENV keeps (the pure-C drivers, the parsers, the stand-in
# releases of torch). A test that asks for the CUDA build stays out of it.
FAST_TIER = ("test_advice.py", "test_known_bugs.py", "test_gating.py", "test_config.py",
             "test_debug.py", "test_apply.py")


def pytest_configure(config):
    global WORKER
    # xdist gives its workers `workerinput`; an environment variable would
    # also reach a pytest that a test starts.
    WORKER = getattr(config, "workerinput", {}).get("workerid")
    config.addinivalue_line("markers", "fast: the fast tier (tests/conftest.py FAST_TIER)")
    config.pluginmanager.register(SanitizedRunCovers(), "outofcuda-sanitized-run-covers")


def wait_for_setup(step):
    """.ci/run installs the system tools (step "tools") and builds the sid
    chroot ("chroot") while the tests run; each step writes its exit status
    last, to a file of its name in OUTOFCUDA_TEST_SETUP. A test that uses
    one waits for it here (elsewhere there is nothing to wait for)."""
    folder = os.environ.get("OUTOFCUDA_TEST_SETUP")
    if not folder or (step == "chroot" and not os.environ.get("OUTOFCUDA_TEST_CHROOT")):
        return
    status = Path(folder, step)
    deadline = time.monotonic() + 1800
    while not status.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"CI's setup step {step} has not written {status} in 30 minutes")
        time.sleep(1)
    rc = status.read_text().strip()
    if rc != "0":
        log = Path(folder, step + ".log")
        tail = log.read_text()[-2000:] if log.is_file() else ""
        pytest.fail(f"CI's setup step {step} (.ci/run) exited {rc}:\n{tail}")


# Two workers (pytest-xdist, in requirements-test.txt), each running whole
# files: nearly every test waits on a scenario interpreter that uses one core,
# so a second worker halves the run on CI's two cores. Set here rather than in
# pyproject.toml's addopts, so that pytest without pytest-xdist (the GPU
# machine's interpreter runs tests/gpu) still starts, serially. `-n N` on the
# command line (`-n 0`: one process) overrides it.
WORKERS = min(2, len(os.sched_getaffinity(0)))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    opt = config.option
    if (config.pluginmanager.hasplugin("xdist") and WORKERS > 1
            and getattr(opt, "numprocesses", 0) is None and opt.dist == "no"
            and not hasattr(config, "workerinput")
            and not opt.collectonly and not opt.usepdb):
        opt.numprocesses = WORKERS
        opt.dist = "loadfile"
        opt.loadscopereorder = False


# The files that take longest run first, so that the last file a worker gets
# is a short one (figures in docs/testing.md). test_interpreters.py waits
# for the chroot .ci/run builds meanwhile (wait_for_chroot): it starts
# after a few minutes of others.
LONGEST_FIRST = ("test_sanitize.py", "test_gpu_dry_run.py", "test_packaging.py", "test_api.py",
                 "test_cli.py", "test_cuda_build.py", "test_interpreters.py", "test_oom.py",
                 "test_monitor.py", "test_nvml.py", "test_leaks.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        if (item.path.parent.name == "tests" and item.path.name in FAST_TIER
                and "cuda_venv" not in item.fixturenames):
            item.add_marker(pytest.mark.fast)


# tests/test_sanitize.py's test_core_suites_under_sanitizers runs these files
# again, whole but for the tests whose names hold a word of SANITIZED_LEFT_OUT,
# against the sanitizer build: each of their assertions is checked there too.
SANITIZED_FILES = ("test_hook.py", "test_gating.py", "test_config.py")
SANITIZED_LEFT_OUT = ("collect_env", "ddtrace")


class SanitizedRunCovers:
    """Where that run is part of the session, the tests it runs are not run a
    second time against the normal build (those marked skipif, which may skip
    under the sanitizer, still are). After -k and -m have chosen: `-m fast`
    leaves that run out, and then the files run here."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if SANITIZE or os.environ.get("OUTOFCUDA_TEST_SKIP_SANITIZE"):
            return
        if not any(i.path.name == "test_sanitize.py" and i.name == "test_core_suites_under_sanitizers"
                   for i in items):
            return
        covered = [i for i in items
                   if i.path.parent.name == "tests" and i.path.name in SANITIZED_FILES
                   and not any(w in i.name for w in SANITIZED_LEFT_OUT)
                   and next(i.iter_markers("skipif"), None) is None]
        if covered:
            config.hook.pytest_deselected(items=covered)
            gone = set(map(id, covered))
            items[:] = [i for i in items if id(i) not in gone]


# ---- what one run builds once and every worker shares ----
#
# The suite runs under pytest-xdist (pyproject.toml: two workers, whole files
# each). Each worker is its own pytest session, so a session fixture would
# build the wheel and install torch once per worker: what is expensive is
# built once per run, in the run's temporary folder that the workers' own
# folders sit in, by whichever worker asks first, while the others wait on a
# lock. Each worker then works on its own hard-link copy of an environment
# (no bytes copied), so a test that damages its installed outofcuda, or
# reinstalls it, never disturbs a test of another worker.

WORKER = None  # this worker's name ("gw0"), set by pytest_configure; None without workers


def run_root(tmp_path_factory):
    """The folder of this run that every worker shares."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if WORKER else base


@contextlib.contextmanager
def _locked(path):
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_once(tmp_path_factory, name, build):
    """run_root/name, made by build(path) once per run, whichever worker asks
    first; the others wait, then reuse it. A build that fails (or skips) is
    tried again by the next worker that asks."""
    path = run_root(tmp_path_factory) / name
    with _locked(path):
        if not (path / ".ready").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            build(path)
            (path / ".ready").write_text("ok")
    return path


def worker_copy(tmp_path_factory, master, name):
    """This worker's copy of the environment at master: hard links (cp -al),
    or a real copy where master lies on another filesystem. Without workers,
    master itself when this run made it; a developer's reused environment is
    copied too, so that two runs at once never install into one."""
    if not WORKER and run_root(tmp_path_factory) in master.parents:
        return master
    path = run_root(tmp_path_factory) / f"{name}-{WORKER or 'main'}"
    shutil.rmtree(path, ignore_errors=True)
    return hard_link_copy(master, path)


def pytest_sessionfinish(session):
    """The environments (gigabytes: the CUDA build alone is 5.5 GB) go when
    the run ends, whatever its outcome (a run that passes leaves nothing:
    pyproject.toml's tmp_path_retention_policy); an environment named by
    OUTOFCUDA_TEST_VENV or OUTOFCUDA_TEST_CUDA_VENV is the developer's and
    stays. The workers' sessions end first; the run's own removes them."""
    if WORKER:
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None or factory._basetemp is None:
        return
    # Also the packages installed beside them (vllm alone is 880 MB); a failed
    # test's own folder stays to be looked at.
    for pattern in ("*venv-*", "notebook", "ddtrace*", "vllm*", "popen-gw*/ddtrace*",
                    "popen-gw*/vllm*", "popen-gw*/matplotlib*"):
        for path in factory.getbasetemp().glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """The project's wheel, built once per test run."""
    def build(out):
        # Build from a copy so the checkout's build/ and in-place .so stay out of it.
        src = out / "src"
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "*.so", ".venv*", "__pycache__", ".pytest_cache"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(out), str(src)],
                       check=True, env=_clean_env(dict(WERROR, OUTOFCUDA_BUILD_SANITIZE="1" if SANITIZE else None)))
        shutil.rmtree(src)
    (whl,) = build_once(tmp_path_factory, "wheel", build).glob("outofcuda-*.whl")
    return whl


def _make_venv(path, spec, unavailable=None):
    """A virtual environment at path holding numpy and torch `spec`. pip
    skips compiling every module of torch to bytecode (--no-compile): an
    interpreter compiles what it imports, once, and the run imports a small
    part of torch: that part is compiled here, so that every hard-link copy
    of this environment (one per worker, one per sanitizer run) has it."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    try:
        _pip(path / "bin" / "python", "install", "--no-compile", "numpy", spec)
    except subprocess.CalledProcessError as e:
        if unavailable is None:
            raise
        unavailable(f"pip install {spec} failed (exit {e.returncode})")
    subprocess.run([str(path / "bin" / "python"), "-c", "import torch"], capture_output=True,
                   env=_clean_env())


@pytest.fixture(scope="session")
def venv_master(tmp_path_factory):
    """A virtual environment holding torch (and numpy, which torch warns about
    when missing), made once per run; OUTOFCUDA_TEST_VENV reuses one across
    runs. Tests work on copies of it (base_venv, hard_link_copy)."""
    reuse = os.environ.get("OUTOFCUDA_TEST_VENV")
    if reuse:
        master = Path(reuse)
        with _locked(run_root(tmp_path_factory) / "venv-given"):
            if not (master / "bin" / "python").exists() or not (master / ".ready").exists():
                _make_venv(master, TORCH_SPEC)
                (master / ".ready").write_text("ok")
    else:
        master = build_once(tmp_path_factory, "venv-master", lambda p: _make_venv(p, TORCH_SPEC))
    return master


@pytest.fixture(scope="session")
def base_venv(tmp_path_factory, venv_master):
    """This worker's environment with torch, into which the venv fixture
    installs the wheel."""
    return worker_copy(tmp_path_factory, venv_master, "venv-base")


def hard_link_copy(master, path):
    """A copy of the environment at master at path that shares its files
    (cp -al; a real copy across filesystems): installing into it replaces
    files, never writes into the shared ones."""
    if subprocess.run(["cp", "-al", str(master), str(path)], capture_output=True).returncode:
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run(["cp", "-a", str(master), str(path)], check=True)
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


@pytest.fixture(scope="session")
def matplotlib_dir(venv, tmp_path_factory):
    """The real matplotlib, in a folder of its own (the shared environment
    stays without it, as test_plot_without_matplotlib_says_how_to_get_it
    needs). OUTOFCUDA_TEST_MATPLOTLIB_DIR reuses one."""
    return pip_target(venv.python, "matplotlib", "OUTOFCUDA_TEST_MATPLOTLIB_DIR", tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def run_tmpdir(tmp_path_factory):
    """The temporary folder (TMPDIR) of every interpreter the tests start: one
    per worker inside the run's folder, so a passing run leaves nothing in the
    system's (/tmp). torch.compile's cache sits beside it, shared by the
    workers and warm for the whole run."""
    root = run_root(tmp_path_factory)
    path = root / f"tmp-{WORKER or 'main'}"
    path.mkdir(exist_ok=True)
    saved = {k: os.environ.get(k) for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ.update(TMPDIR=str(path), TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
    yield path
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def leaves_no_temporary_files(run_tmpdir):
    """A test whose processes leave anything in the temporary folder (torchrun's
    torchelastic_*, multiprocessing's pymp-*) fails; what it left goes."""
    yield
    left = sorted(p.name for p in run_tmpdir.iterdir())
    # The pip that Python 3.9's venv bundles leaves its certifi bundle behind
    # (tmp*cacert.pem, an importlib.resources copy it never removes): not ours.
    for name in [n for n in left if n.startswith("tmp") and n.endswith("cacert.pem")]:
        (run_tmpdir / name).unlink()
        left.remove(name)
    for name in left:
        path = run_tmpdir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    if left:
        pytest.fail(f"left in the temporary folder: {left}", pytrace=False)


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
    not outofcuda, created once per run. OUTOFCUDA_TEST_CUDA_VENV reuses
    one across runs."""
    import platform

    def build(path):
        if platform.machine() != "x86_64":
            _unavailable(f"PyPI's CUDA wheels are built for x86_64, this is {platform.machine()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
        if free < CUDA_VENV_FREE_BYTES:
            _unavailable(f"{free / 1024**3:.1f} GiB free under {path.parent}, the CUDA build "
                         f"needs {CUDA_VENV_FREE_BYTES / 1024**3:.0f} GiB")
        _make_venv(path, CUDA_TORCH_SPEC, _unavailable)

    reuse = os.environ.get("OUTOFCUDA_TEST_CUDA_VENV")
    if reuse:
        master = Path(reuse)
        with _locked(run_root(tmp_path_factory) / "cuda-venv-given"):
            if not ((master / "bin" / "python").exists() and (master / ".ready").exists()):
                build(master)
                (master / ".ready").write_text("ok")
    else:
        master = build_once(tmp_path_factory, "cuda-venv-master", build)
    path = worker_copy(tmp_path_factory, master, "cuda-venv-base")
    python = path / "bin" / "python"
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


# ---- IPython and Jupyter, from the package index ----

NOTEBOOK_SPECS = ("ipykernel==7.4.0", "ipython==9.18.0", "nbclient==0.11.0", "nbformat==5.11.1")


@pytest.fixture(scope="session")
def notebook_dir(tmp_path_factory):
    """A folder holding ipykernel, nbclient, nbformat and IPython, installed
    once per run for this interpreter's Python (the test environments'),
    that a scenario puts on PYTHONPATH: the environments stay as they are.
    OUTOFCUDA_TEST_NOTEBOOK_DIR reuses one across runs."""
    def install(path):
        try:
            _pip(sys.executable, "install", "--target", str(path), *NOTEBOOK_SPECS)
        except subprocess.CalledProcessError as e:
            if os.environ.get("CI") == "1":
                pytest.fail(f"pip install {' '.join(NOTEBOOK_SPECS)} failed in CI (exit "
                            f"{e.returncode})")
            pytest.skip(f"pip install {' '.join(NOTEBOOK_SPECS)} failed (exit {e.returncode})")

    reuse = os.environ.get("OUTOFCUDA_TEST_NOTEBOOK_DIR")
    if not reuse:
        return str(build_once(tmp_path_factory, "notebook", install))
    path = Path(reuse)
    if not (path / ".ready").exists():
        install(path)
        (path / ".ready").write_text("ok")
    return str(path)
