"""The C core under AddressSanitizer + UndefinedBehaviorSanitizer.

A wheel is built with OUTOFCUDA_BUILD_SANITIZE=1 (setup.py adds
-fsanitize=address,undefined), unpacked into a fresh virtual environment that
borrows torch and numpy from the test environment through a path-only .pth
line, and the scenarios below run there with the ASan runtime preloaded
(Python itself is not instrumented), PYTHONMALLOC=malloc (so ASan sees every
Python allocation) and halt-on-error for both sanitizers:

- the hook: import torch with the hook, status(), config(), the verbose report;
- the configuration parser and allocator merge with bad and extreme values;
- the import watcher's edge cases: a failed first torch import then a retry,
  direct find_spec calls, setattr on the finder, install() again, threads;
- the leak-test loop of tests/test_leaks.py (every public function, 300 calls);
- MemoryMonitor start/stop, KeyboardInterrupt, and exit with one running.

Leak detection (LSan) stays off with torch loaded (torch and CPython keep
allocations until exit by design, so reports are noise); it runs on the
scenario without torch, where CPython alone reports nothing (measured), so any
report fails.

Opt out with OUTOFCUDA_TEST_SKIP_SANITIZE=1 (a developer machine without the
sanitizer runtime); CI runs it."""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, SANITIZED_FILES, SANITIZED_LEFT_OUT, _clean_env, hard_link_copy

pytestmark = pytest.mark.skipif(bool(os.environ.get("OUTOFCUDA_TEST_SKIP_SANITIZE")),
                                reason="OUTOFCUDA_TEST_SKIP_SANITIZE is set")

SAN_ERRORS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer",
              "SUMMARY: UndefinedBehaviorSanitizer", "Fatal Python error")


def _asan_runtime(ext):
    """The ASan runtime the extension links (ldd), else gcc's."""
    out = subprocess.run(["ldd", str(ext)], capture_output=True, text=True).stdout
    m = re.search(r"libasan\.so\S* => (\S+)", out)
    if m:
        return m.group(1)
    path = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                          text=True).stdout.strip()
    if not os.path.isabs(path):
        pytest.fail("no AddressSanitizer runtime found (gcc's libasan)")
    return path


@pytest.fixture(scope="module")
def san(tmp_path_factory, base_venv):
    """(python, env): an environment holding the sanitizer build."""
    work = tmp_path_factory.mktemp("sanitize")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "*.so", ".venv*", "__pycache__", ".pytest_cache",
        "fuzz"))
    out = work / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)],
                   check=True, env=_clean_env({"OUTOFCUDA_BUILD_SANITIZE": "1"}))
    (whl,) = out.glob("outofcuda-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c",
                                "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    with zipfile.ZipFile(whl) as zf:
        zf.extractall(site)
    base_site = next((base_venv / "lib").glob("python3*/site-packages"))
    # A path line only: torch and numpy come from the test environment; the
    # sanitizer build in this site-packages comes first on sys.path.
    (site / "zz_borrow_torch.pth").write_text(str(base_site) + "\n")
    ext = next(site.glob("_outofcuda*.so"))
    nm = subprocess.run(["nm", "-D", str(ext)], capture_output=True, text=True).stdout
    assert "__asan_" in nm and "__ubsan_" in nm, "the extension was not built with sanitizers"
    env = {
        "LD_PRELOAD": _asan_runtime(ext),
        "PYTHONMALLOC": "malloc",
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86"
                        ":detect_stack_use_after_return=0",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=87",
    }
    return python, env, ext


def _run(san, code, env=None, cwd=None, timeout=180):
    python, base_env, _ = san
    r = subprocess.run([str(python), "-c", textwrap.dedent(code)],
                       env=_clean_env({**base_env, **(env or {})}), cwd=cwd,
                       capture_output=True, text=True, timeout=timeout)
    bad = [s for s in SAN_ERRORS if s in r.stderr]
    assert not bad and r.returncode not in (86, 87), (
        f"sanitizer report (exit {r.returncode}):\n{r.stderr[-8000:]}")
    return r


def test_build_is_instrumented(san):
    r = _run(san, "import _outofcuda, json; print(json.dumps(_outofcuda.status()['hook']))")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["installed"] is True
    assert str(san[2]).endswith(".so")


def test_hook_and_torch_import(san, tmp_path):
    r = _run(san, """
        import json, torch, _outofcuda, outofcuda
        x = torch.randn(64, 64) @ torch.randn(64, 64)
        st = _outofcuda.status()
        assert st["hook"] == {"installed": True, "fired": True, "error": None}, st["hook"]
        # A CPU-only build: torch's own default stays, and status says why.
        assert torch.backends.cudnn.benchmark is False
        assert st["optimizations"]["cudnn_benchmark"]["code"] == "no_cuda"
        json.dumps(st); json.dumps(_outofcuda.config())
        outofcuda.memory_report(); outofcuda.clear_cache(); _outofcuda.nvml_devices()
        print("ok")
    """, env={"OUTOFCUDA_VERBOSE": "1", "OUTOFCUDA_SUMMARY": "1"}, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-4000:]
    assert "outofcuda 0.3.0: torch" in r.stderr
    # The table's known-bugs row, and the exit summary's line without CUDA.
    assert re.search(r"^  known_bugs +no ", r.stderr, re.M), r.stderr[-4000:]
    assert "outofcuda summary: nothing to report" in r.stderr, r.stderr[-4000:]


def test_config_parse_with_bad_values(san, tmp_path):
    bad = {
        "OUTOFCUDA_TF32": "maybe", "OUTOFCUDA_MEMORY_FRACTION": "nan",
        "OUTOFCUDA_NUM_WORKERS": "9" * 400, "OUTOFCUDA_PREFETCH_FACTOR": "-0",
        "OUTOFCUDA_AMP_DTYPE": "\u00e9" * 100, "OUTOFCUDA_COMPILE_MODE": " " * 50,
        "OUTOFCUDA_ALLOC_CONF": "a:[" * 300, "OUTOFCUDA_VERBOSE": "x" * 5000,
        "OUTOFCUDA_OOM_SNAPSHOT": "/nonexistent/dir/x.pickle",
        # entries that name no row, escaped into the warning, and a name that
        # is no variable, escaped too
        "OUTOFCUDA_KNOWN_BUGS": ",".join(["\u202e\x1b\xff" * 30] * 40) + ",tf32-mixed-api",
        "OUTOFCUDA_\u2066\x1b" * 30: "1",
    }
    r = _run(san, r"""
        import json, _outofcuda
        cfg = _outofcuda.config()
        assert len(cfg["warnings"]) >= 7, cfg["warnings"]
        cases = [{}, {"OUTOFCUDA_ALLOC_CONF": ",".join(f"k{i}:{i}" for i in range(200))},
                 {"OUTOFCUDA_ALLOC_CONF": "k:" + "9" * 2000},
                 {"OUTOFCUDA_ALLOC_CONF": "a:[" + "]" * 50},
                 {"OUTOFCUDA_MEMORY_FRACTION": "1e-320"}, {"OUTOFCUDA_MEMORY_FRACTION": "0x1p-3"},
                 {"OUTOFCUDA_NUM_WORKERS": " 12 "}, {"OUTOFCUDA_TF32": "\udcff"},
                 {f"OUTOFCUDA_X{i}": "1" for i in range(100)}, {"OUTOFCUDA_DISABLE": 5}]
        for c in cases:
            try:
                _outofcuda._parse_config(c)
            except (TypeError, ValueError, UnicodeError):
                pass
        for d, u, v in [("", "", None), ("a:1", "a:2", "2.13.0"), ("a:[", "b", None),
                        ("x" * 5000 + ":1", "y:2", "2"), (",".join(["k:1"] * 100), "", "999.999.999"),
                        ("max_split_size_mb:128", "roundup_power2_divisions:[256:1,>:4]", "2.0")]:
            try:
                _outofcuda._merge_alloc_conf(d, u, v)
            except ValueError:
                pass
        for bad in ([], None, 5):
            try:
                _outofcuda._parse_config(bad)
            except TypeError:
                pass
        import torch
        print("ok")
    """, env=bad, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-4000:]


def test_watcher_edge_cases(san, tmp_path):
    # A stand-in torch package that fails its first import and works on the
    # retry: the hook must fire once, on the retry, and survive a module with
    # none of torch's attributes.
    pkg = tmp_path / "fake" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import builtins
        builtins._fake_torch_tries = getattr(builtins, "_fake_torch_tries", 0) + 1
        if builtins._fake_torch_tries == 1:
            raise RuntimeError("first import fails")
        __version__ = "2.13.0"
    """))
    r = _run(san, f"""
        import sys, threading, importlib
        sys.path.insert(0, {str(pkg.parent)!r})
        import _outofcuda
        finder = next(f for f in sys.meta_path if type(f).__module__ == "outofcuda_hook")
        assert finder.find_spec("numpy", None) is None
        assert finder.find_spec("torch.nn", None, None) is None
        for bad in [(), (1, 2, 3, 4), (None,), (5, None)]:
            try:
                finder.find_spec(*bad)
            except TypeError:
                pass
        finder.find_spec = lambda *a, **k: None      # tools patch finders like this
        del finder.find_spec
        try:
            import torch
        except RuntimeError:
            pass
        assert _outofcuda.status()["hook"]["fired"] is False
        sys.modules.pop("torch", None)
        results = []
        def imp():
            import torch
            results.append(torch.__version__)
        ts = [threading.Thread(target=imp) for _ in range(4)]
        for t in ts: t.start()
        for t in ts: t.join()
        assert results == ["2.13.0"] * 4, results
        assert _outofcuda.status()["hook"]["fired"] is True
        importlib.reload(sys.modules["torch"])
        _outofcuda.install(); _outofcuda.install()
        _outofcuda.status()
        print("ok")
    """, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-4000:]


def test_leak_loop_under_sanitizers(san, tmp_path):
    from test_leaks import CHILD_TEMPLATE
    r = _run(san, CHILD_TEMPLATE.replace("CALLS", "300"), env={"OUTOFCUDA_GC_COLLECT": "0"},
             cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "_outofcuda.install" in json.loads(r.stdout.strip().splitlines()[-1])


def test_monitor_interrupt_and_exit(san, tmp_path):
    from test_monitor import _script   # its prelude: feed(), need(), SIGINT, a hang guard
    code = _script("""
        import warnings
        warnings.simplefilter("ignore")
        import torch
        feed(900)                                   # 90 % used: above the threshold
        events = []
        try:
            with MemoryMonitor(threshold=0.85, interval=0.02, cooldown=0,
                               on_high=events.append, _source=SRC) as mon:
                need(lambda: len(events) >= 1, "the watchdog to act", 60.0)
                os.kill(os.getpid(), signal.SIGINT)
                need(lambda: False, "SIGINT to arrive as KeyboardInterrupt", 60.0)
        except KeyboardInterrupt:
            pass
        assert not mon.running
        n = len(events)
        left = MemoryMonitor(threshold=0.85, interval=0.02, cooldown=0,
                             on_high=events.append, _source=SRC).start()
        need(lambda: len(events) > n, "the monitor left running to act", 60.0)
        print("ok", len(events) > n)
    """, guard=120)
    r = _run(san, code, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok True", r.stderr[-4000:]


def test_monitor_freed_by_its_own_watchdog(san, tmp_path):
    """Use-after-free guard: the watchdog drops the last reference to its own
    monitor (from on_high, and through its gc.collect() on a cycle)."""
    from test_monitor import DROPPED_IN_OWN_THREAD, _script
    r = _run(san, _script(DROPPED_IN_OWN_THREAD, guard=120), cwd=tmp_path,
             env={"PYTHONWARNINGS": "ignore::RuntimeWarning"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ["dropped", 0]


def test_monitor_stopped_from_its_own_thread(san, tmp_path):
    """on_high stops its own monitor, then the monitor is dropped at once."""
    from test_monitor import _script
    r = _run(san, _script("""
        base = threads()
        for i in range(10):
            done = []
            def on_high(ev):
                m.stop()
                done.append(1)
            m = MemoryMonitor(threshold=0.5, interval=0.002, cooldown=0, on_high=on_high,
                              _source=SRC)
            feed(900)
            m.start()
            need(lambda: done, "on_high to stop its monitor")
            del m                     # freed while its thread may still be ending
            feed(100)
        import gc; gc.collect()
        outofcuda.monitor.core._monitor_stop_all()
        need(lambda: threads() == base, "every watchdog thread to end")
        print("ok")
    """, guard=120), cwd=tmp_path, env={"PYTHONWARNINGS": "ignore::RuntimeWarning"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]


def test_sanitizer_catches_a_bad_read(san, tmp_path):
    """Positive control: in this environment ASan really intercepts memory
    accesses (a read of a poisoned region through memcpy is reported)."""
    python, base_env, _ = san
    r = subprocess.run([str(python), "-c", textwrap.dedent("""
        import ctypes, _outofcuda
        buf = ctypes.create_string_buffer(64)
        ctypes.CDLL(None).__asan_poison_memory_region(buf, 64)
        ctypes.string_at(buf, 64)
    """)], env=_clean_env(base_env), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 86 and "ERROR: AddressSanitizer" in r.stderr, r.stderr[-3000:]


def test_leak_sanitizer_catches_a_leak(san, tmp_path):
    """Positive control for LeakSanitizer in this environment."""
    python, base_env, _ = san
    r = subprocess.run([str(python), "-c", textwrap.dedent("""
        import ctypes, _outofcuda
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc(4000)
    """)], env=_clean_env({**base_env, "ASAN_OPTIONS": "detect_leaks=1"}), cwd=tmp_path,
        capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Direct leak of 4000 byte(s)" in r.stderr, r.stderr[-3000:]


def test_no_torch_scenario_with_leak_detection(san, tmp_path):
    """LeakSanitizer on: config, status, allocator merge, NVML and a
    MemoryMonitor cycle without torch. Measured: CPython alone reports no
    leak here, so any report fails."""
    r = _run(san, """
        import warnings
        warnings.simplefilter("ignore")
        import _outofcuda, outofcuda
        for _ in range(200):
            _outofcuda.config(); _outofcuda.status(); _outofcuda.nvml_devices()
            _outofcuda._parse_config({"OUTOFCUDA_TF32": "bad", "OUTOFCUDA_ALLOC_CONF": "a:1"})
            _outofcuda._merge_alloc_conf("a:1,b:2", "b:3", "2.13.0")
            try:
                _outofcuda._merge_alloc_conf("a:[", "b:3")
            except ValueError:
                pass
        with outofcuda.MemoryMonitor(threshold=0.85, interval=0.02):
            pass
        print("ok")
    """, env={"ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1:exitcode=86",
              "OUTOFCUDA_TF32": "maybe"}, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-6000:]


def test_core_suites_under_sanitizers(tmp_path, venv_master):
    """The C-heavy test files (hook and watcher on real torch, release gating
    over every release, configuration) run whole against the sanitizer build, every scenario
    interpreter with the ASan runtime preloaded (tests/conftest.py,
    OUTOFCUDA_BUILD_SANITIZE=1), and only here where this test is part of the
    run. The other files run against the normal build."""
    if os.environ.get("OUTOFCUDA_BUILD_SANITIZE") == "1":
        pytest.skip("already running under the sanitizer build")
    # torch comes from a hard-link copy of the run's environment: the
    # sanitizer build replaces outofcuda there, never in a file it shares.
    env = _clean_env({"OUTOFCUDA_BUILD_SANITIZE": "1",
                      "OUTOFCUDA_TEST_VENV": str(hard_link_copy(venv_master, tmp_path / "venv")),
                      "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(tmp_path)})
    # One process (no workers): this test's own worker already shares the cores.
    # ddtrace's tests exercise the same watcher code as the tool tests there.
    # The main run leaves to this one the tests it runs (conftest.py
    # SanitizedRunCovers): their failures are shown here.
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        *(f"tests/{name}" for name in SANITIZED_FILES),
                        "-k", " and ".join(f"not {word}" for word in SANITIZED_LEFT_OUT)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join(r.stdout.splitlines()[-40:])
    assert r.returncode == 0, tail + r.stderr[-3000:]
    assert " passed" in tail and "failed" not in tail
