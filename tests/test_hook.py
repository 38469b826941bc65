"""The start-up hook and the import watcher, each scenario in a fresh
interpreter of a virtual environment holding the built wheel and torch."""
import json
import os
import shutil
import subprocess
import textwrap

import pytest

from conftest import ROOT, SANITIZE, _clean_env, _sanitizer_env
from fake_torch import make_fake_torch
from kit import damage_code

STATUS = "import _outofcuda, json; print('STATUS=' + json.dumps(_outofcuda.status()))"
FIRED_LINE = "torch 2.13.0"  # the verbose report's first line names torch once per firing


def S(code):
    """The scenario's code followed by a line that prints status() as JSON."""
    return textwrap.dedent(code) + "\n" + STATUS + "\n"


def status_of(result):
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("STATUS=")][-1]
    return json.loads(line[len("STATUS="):])


def firings(result):
    return sum(1 for ln in result.stderr.splitlines()
               if ln.startswith("outofcuda ") and FIRED_LINE in ln)


# ---- the .pth line ----

def test_plain_start_is_silent_and_imports_nothing_heavy(venv, workdir):
    r = venv.check("""
        import sys
        watchers = [f for f in sys.meta_path if type(f).__name__ == 'TorchImportWatcher']
        print(len(watchers), 'torch' in sys.modules, 'outofcuda' in sys.modules,
              '_outofcuda' in sys.modules, 'outofcuda_hook' in sys.modules)
        maps = open('/proc/self/maps').read()
        print('nvidia-ml' in maps, 'libcuda' in maps, '_outofcuda.abi3.so' in maps)
    """, cwd=workdir)
    # In a venv every .pth runs twice (CPython issue 75723): still one watcher.
    # Only the boot is loaded at start-up; the engine waits for `import torch`.
    assert r.stdout.split() == ["1", "False", "False", "False", "True", "False", "False", "False"]
    assert r.stderr == ""


def test_disable_skips_even_loading_the_extension(venv, workdir):
    for value in ("1", "true", "YES", "On", " on\t", "\v1\f"):
        r = venv.check("""
            import sys, torch
            print('_outofcuda' in sys.modules, any(type(f).__name__ == 'TorchImportWatcher'
                                                   for f in sys.meta_path))
            print(torch.backends.cudnn.benchmark, '_outofcuda.abi3.so' in open('/proc/self/maps').read())
            print('outofcuda_hook.abi3.so' in open('/proc/self/maps').read())
        """, env={"OUTOFCUDA_DISABLE": value}, cwd=workdir)
        # `1` is read by the .pth line, which then never maps the boot; the
        # other words by the boot once mapped (it installs nothing).
        assert r.stdout.split() == ["False", "False", "False", "False", str(value != "1")], value
    # Words that do not mean "yes" leave the hook on, as the engine's parser does.
    for value in ("0", "off", "no", "yess", "", "1 1"):
        r = venv.check(S("import torch"), env={"OUTOFCUDA_DISABLE": value}, cwd=workdir)
        assert status_of(r)["hook"]["fired"] is True, value


def test_disabled_is_told_from_not_installed(venv, workdir):
    """OUTOFCUDA_DISABLE=1: status() says the hook is installed and every step
    skipped with the code `off` (not pending, as if torch were still to
    come); OUTOFCUDA_VERBOSE=1 prints one line saying so (`1` without it stops
    the hook file's line before the boot loads, so as to get past a damaged
    boot); without the hook (python -S) it is not installed."""
    code = """
        import json, sys, torch, outofcuda
        st = outofcuda.status()
        print(json.dumps([st["hook"], sorted({(e["state"], e["code"], e["off_by"])
                                              for e in st["optimizations"].values()})]))
    """
    env = {"OUTOFCUDA_DISABLE": "yes", "OUTOFCUDA_VERBOSE": "1"}
    r = venv.check(code, env=env, cwd=workdir)
    hook, states = json.loads(r.stdout)
    assert hook == {"installed": True, "fired": False, "error": None}
    assert states == [["skipped", "off", "OUTOFCUDA_DISABLE"]]
    (line,) = r.stderr.splitlines()
    assert line == "outofcuda: off by OUTOFCUDA_DISABLE: torch imports as without outofcuda"
    quiet = venv.check(code, env={"OUTOFCUDA_DISABLE": "yes"}, cwd=workdir)
    assert quiet.stdout == r.stdout and quiet.stderr == ""
    env = {"OUTOFCUDA_DISABLE": "1", "OUTOFCUDA_VERBOSE": "1"}
    one = venv.check(code, env=env, cwd=workdir)
    assert one.stdout == r.stdout and one.stderr == r.stderr
    bare = venv.check(code, args=("-S",), env=dict(env, PYTHONPATH=str(venv.site)), cwd=workdir)
    hook, states = json.loads(bare.stdout)
    assert hook == {"installed": False, "fired": False, "error": None}
    assert states == [["skipped", "off", "OUTOFCUDA_DISABLE"]] and bare.stderr == ""


def test_disable_with_blanks_is_honoured_by_the_c_check(venv, workdir):
    # The .pth line compares the exact value `1`; the boot trims blanks and
    # still refuses to install.
    r = venv.check("""
        import sys, torch
        print(any(type(f).__name__ == 'TorchImportWatcher' for f in sys.meta_path),
              torch.backends.cudnn.benchmark, 'outofcuda_hook' in sys.modules)
    """, env={"OUTOFCUDA_DISABLE": " on "}, cwd=workdir)
    assert r.stdout.split() == ["False", "False", "True"]


def test_no_site_means_no_hook(venv, workdir):
    r = venv.check("import sys; print(any(type(f).__name__ == 'TorchImportWatcher' "
                   "for f in sys.meta_path))", args=("-S",), cwd=workdir)
    assert r.stdout.strip() == "False"


def test_isolated_mode_still_runs_the_hook(venv, workdir):
    r = venv.check(S("import torch"), args=("-I",), cwd=workdir)
    assert status_of(r)["hook"]["fired"] is True


def test_dev_mode_with_warnings_as_errors_is_silent(venv, workdir):
    r = venv.check(S("import torch"), args=("-X", "dev", "-W", "error"), cwd=workdir)
    assert r.stderr == ""
    st = status_of(r)
    assert st["hook"]["fired"] and st["hook"]["error"] is None


def test_pth_and_start_files_are_constant_and_short(venv):
    """Python 3.9-3.17 get the .pth alone: a .start file would make site
    import pkgutil and 27 more modules in every process (3.15-3.17). The
    line loads the boot only at the size it had when it was built."""
    pth = (venv.site / "outofcuda_hook.pth").read_text()
    assert not (venv.site / "outofcuda_hook.start").exists()
    assert not (venv.site / "outofcuda_hook_start.py").exists()
    assert pth.count("\n") == 1 and pth.startswith("import _imp;")
    assert len(pth) < 320  # 303 with a 5-digit boot size
    (so,) = venv.site.glob("outofcuda_hook*.so")
    assert so.name == "outofcuda_hook.abi3.so"
    # OUTOFCUDA_DISABLE=1 is read before the boot's path is even compiled
    # (but with OUTOFCUDA_VERBOSE=1, the boot loads to say it is off).
    assert pth.index("os.getenv('OUTOFCUDA_DISABLE')=='1'!=os.getenv('OUTOFCUDA_VERBOSE')or "
                     "exec(") < pth.index("sitedir")
    assert f" if os.stat(p).st_size=={so.stat().st_size}:" in pth
    start = (ROOT / "outofcuda_hook.start").read_text()
    assert start.strip() == "outofcuda_hook_start:install"


# ---- the watcher ----

@pytest.mark.skipif(SANITIZE, reason="torch's reload throws a C++ exception, which a preloaded "
                    "ASan runtime cannot intercept (__cxa_throw CHECK in libasan)")
def test_fires_once_with_real_loader_restored(venv, workdir):
    r = venv.check(S("""
        import torch, importlib
        print(type(torch.__loader__).__name__, type(torch.__spec__.loader).__name__)
        try:
            importlib.reload(torch)
        except RuntimeError as exc:   # torch 2.13 cannot re-run its own __init__
            print('reload refused by torch:', 'TORCH_LIBRARY' in str(exc))
        import torch
    """), env={"OUTOFCUDA_VERBOSE": "1"}, cwd=workdir)
    assert r.stdout.split()[:2] == ["SourceFileLoader", "SourceFileLoader"]
    assert firings(r) == 1
    assert status_of(r)["hook"]["fired"] is True


def test_torch_imported_before_the_hook_installs(venv, workdir):
    r = venv.check(S("""
        import os, torch
        import _outofcuda
        print(_outofcuda.status()['hook'])
        del os.environ['OUTOFCUDA_DISABLE']
        _outofcuda.install()
        print(_outofcuda.status()['optimizations']['sdpa']['code'])
    """), env={"OUTOFCUDA_DISABLE": "1"}, cwd=workdir)
    st = status_of(r)
    assert st["hook"] == {"installed": True, "fired": True, "error": None}
    assert r.stdout.splitlines()[1] == "no_cuda"       # the bridge ran at install()
    # A CPU build has no CUDA allocator to miss (tests/test_apply.py: a CUDA build's reason).
    assert st["optimizations"]["allocator"]["code"] == "no_cuda"


def test_failed_first_import_then_success_fires_once(venv, workdir):
    r = venv.check(S("""
        import sys
        sys.modules['torch._C'] = None      # makes torch/__init__ fail
        try:
            import torch
        except ImportError:
            print('first import failed')
        import _outofcuda
        print('fired after failure:', _outofcuda.status()['hook']['fired'])
        for name in [n for n in sys.modules if n == 'torch' or n.startswith('torch.')]:
            del sys.modules[name]
        import torch
        print(torch.backends.cudnn.benchmark)
    """), env={"OUTOFCUDA_VERBOSE": "1"}, cwd=workdir)
    assert "first import failed" in r.stdout
    assert "fired after failure: False" in r.stdout
    assert firings(r) == 1
    assert status_of(r)["hook"]["fired"] is True


def test_eight_threads_importing_torch_fire_once(venv, workdir):
    r = venv.check(S("""
        import threading
        barrier = threading.Barrier(8)
        seen = []
        def work():
            barrier.wait()
            import torch, _outofcuda
            seen.append(_outofcuda.status()['hook']['fired'])
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(seen)
    """), env={"OUTOFCUDA_VERBOSE": "1"}, cwd=workdir)
    assert r.stdout.splitlines()[0] == str([True] * 8)
    assert firings(r) == 1


def test_beside_a_finder_that_calls_find_spec(venv, workdir):
    r = venv.check(S("""
        import sys, importlib.util
        calls = []
        class Nosy:
            def find_spec(self, name, path=None, target=None):
                if name == 'torch' and not calls:
                    calls.append(name)
                    importlib.util.find_spec('torch')   # re-enters the meta path
                return None
        sys.meta_path.insert(0, Nosy())   # ahead of outofcuda's watcher
        sys.meta_path.append(Nosy())      # and behind it
        import torch
        print(calls, type(torch.__loader__).__name__)
    """), cwd=workdir)
    assert r.stdout.splitlines()[0] == "['torch'] SourceFileLoader"
    assert status_of(r)["hook"]["fired"] is True


def test_finder_accepts_setattr_patching(venv, workdir):
    r = venv.check(S("""
        import sys
        w = next(f for f in sys.meta_path if type(f).__name__ == 'TorchImportWatcher')
        original = w.find_spec
        w.find_spec = lambda *a, **k: original(*a, **k)
        import torch
    """), cwd=workdir)
    assert status_of(r)["hook"]["fired"] is True


def test_lazy_loader(venv, workdir):
    r = venv.check("""
        import importlib.util, sys, _outofcuda
        spec = importlib.util.find_spec('torch')
        loader = importlib.util.LazyLoader(spec.loader)
        spec.loader = loader
        module = importlib.util.module_from_spec(spec)
        sys.modules['torch'] = module
        loader.exec_module(module)
        print('before use', _outofcuda.status()['hook']['fired'])
        module.zeros(1)
        import torch
        print('after use', _outofcuda.status()['hook']['fired'],
              _outofcuda.status()['optimizations']['sdpa']['code'] == 'no_cuda')
    """, cwd=workdir)
    assert "before use False" in r.stdout
    assert "after use True True" in r.stdout


def test_collect_env_runs(venv, workdir):
    r = venv.run(None, args=("-m", "torch.utils.collect_env"), cwd=workdir, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "PyTorch version: 2.13.0" in r.stdout


# ---- fault matrix ----

def test_planted_torch_py_is_never_loaded_at_start_up(venv, workdir):
    (workdir / "torch.py").write_text(
        "open('marker', 'w').write('loaded')\n")
    r = venv.check("pass", cwd=workdir)
    assert r.stderr == "" and not (workdir / "marker").exists()
    # A user's own `import torch` then gets their file (Python's rule);
    # outofcuda stays quiet and says why nothing was applied.
    r = venv.check(S("import torch"), cwd=workdir)
    assert (workdir / "marker").exists() and r.stderr == ""
    st = status_of(r)
    assert st["hook"]["error"] is None
    for name, e in st["optimizations"].items():
        assert (e["state"], e["code"]) == ("skipped", "not_pytorch"), (name, e)


def test_torch_raising_during_import_is_torchs_error(venv, workdir):
    r = venv.run("""
        import sys
        sys.modules['torch._C'] = None
        import torch
    """, cwd=workdir)
    assert r.returncode == 1
    assert "import of torch._C halted" in r.stderr and "outofcuda" not in r.stderr


def _damage(so, damage):
    if damage == "delete":
        so.unlink()
    else:
        so.write_bytes(so.read_bytes()[:100])


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_damaged_engine_never_breaks_start_up(venv, workdir, damage):
    (so,) = venv.site.glob("_outofcuda*.so")
    backup = workdir / "backup.so"
    shutil.copy2(so, backup)
    try:
        _damage(so, damage)
        r = venv.check("import torch; print(torch.ones(2).sum().item())", cwd=workdir)
        assert r.stdout.strip() == "2.0" and r.stderr == ""
        r = venv.run("import outofcuda; outofcuda.status()", cwd=workdir)
        assert r.returncode == 1
        assert "reinstall outofcuda" in r.stderr
        r = venv.run(None, args=("-m", "outofcuda", "doctor"), cwd=workdir)
        assert r.returncode == 1 and "reinstall outofcuda" in r.stderr
    finally:
        shutil.copy2(backup, so)


@pytest.mark.parametrize("how", ["zero", "flip"])
def test_a_boot_damaged_at_its_size_leaves_a_way_out_from_the_shell(venv, workdir, how):
    """A boot damaged without a change of size passes the size check and may
    crash every Python of the environment when mapped (not asserted: that
    depends on the damage). OUTOFCUDA_DISABLE=1 is read by the .pth line
    before the boot is mapped, so Python and pip run with it, and the command
    docs/how-the-hook-works.md gives removes the hook file."""
    (so,) = venv.site.glob("outofcuda_hook*.so")
    backup, pth = workdir / "backup.so", venv.site / "outofcuda_hook.pth"
    line = pth.read_text()
    shutil.copy2(so, backup)
    off = {"OUTOFCUDA_DISABLE": "1"}
    try:
        damage_code(so, how)
        assert so.stat().st_size == backup.stat().st_size
        r = venv.run("import sys; print('outofcuda_hook' in sys.modules)", env=off, cwd=workdir)
        assert (r.returncode, r.stdout.split(), r.stderr) == (0, ["False"], "")
        r = venv.run("import torch; print(torch.ones(2).sum().item())", env=off, cwd=workdir)
        assert (r.returncode, r.stdout.split()) == (0, ["2.0"]), r.stderr
        r = venv.run(None, args=("-m", "pip", "--version"), env=off, cwd=workdir)
        assert r.returncode == 0, r.stderr
        doc = (ROOT / "docs" / "how-the-hook-works.md").read_text()
        (remove,) = [ln for ln in doc.splitlines() if ln.startswith("d=$(OUTOFCUDA_DISABLE=1 ")]
        bin_dir = str(venv.path / "bin")
        r = subprocess.run(["sh", "-c", remove], cwd=workdir, capture_output=True, text=True,
                           env=_clean_env({"PATH": bin_dir + os.pathsep + os.environ["PATH"]}))
        assert r.returncode == 0 and not pth.exists(), r.stderr
        r = venv.run("import sys; print('outofcuda_hook' in sys.modules)", cwd=workdir)
        assert (r.returncode, r.stdout.split()) == (0, ["False"]), r.stderr
    finally:
        shutil.copy2(backup, so)
        pth.write_text(line)


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_damaged_boot_never_breaks_start_up(venv, workdir, damage):
    (so,) = venv.site.glob("outofcuda_hook*.so")
    backup = workdir / "backup.so"
    shutil.copy2(so, backup)
    try:
        _damage(so, damage)
        r = venv.check("import torch, sys; print(torch.ones(2).sum().item(), "
                       "'_outofcuda' in sys.modules)", cwd=workdir)
        assert r.stdout.split() == ["2.0", "False"] and r.stderr == ""
        # The engine still answers, and says the hook is not there.
        r = venv.check("import outofcuda; print(outofcuda.status()['hook']['installed'])",
                       cwd=workdir)
        assert r.stdout.strip() == "False" and r.stderr == ""
    finally:
        shutil.copy2(backup, so)


def test_hook_modules_are_loaded_by_path_not_by_name(venv, workdir, tmp_path):
    """A `_outofcuda.py` or `outofcuda_hook.py` on PYTHONPATH (which is on
    sys.path before site-packages at start-up) is never run by the hook: the
    .pth line loads the boot from its own directory, and the boot loads the
    engine from its own directory."""
    planted = tmp_path / "planted"
    planted.mkdir()
    for name in ("_outofcuda", "outofcuda_hook"):
        (planted / f"{name}.py").write_text(
            f"open({str(workdir / ('MARKER-' + name))!r}, 'w').close()\n")
    r = venv.check(S("""
        import sys, torch, outofcuda
        print(sys.modules['outofcuda_hook'].__file__, sys.modules['_outofcuda'].__file__)
    """), env={"PYTHONPATH": str(planted)}, cwd=workdir)
    assert sorted(p.name for p in workdir.glob("MARKER-*")) == []
    hook_file, engine_file = r.stdout.split()[:2]
    assert hook_file.startswith(str(venv.site)) and engine_file.startswith(str(venv.site))
    assert status_of(r)["hook"] == {"installed": True, "fired": True, "error": None}
    assert r.stderr == ""


def test_shadowing_module_makes_import_outofcuda_fail_clearly(venv, workdir):
    (workdir / "_outofcuda.py").write_text("x = 1\n")
    r = venv.run("import _outofcuda, outofcuda", cwd=workdir)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("outofcuda._native.ShadowedError: outofcuda: the module '_outofcuda'")
    assert str(workdir / "_outofcuda.py") in last and "rename it" in last
    assert "AttributeError" not in r.stderr


def test_failure_inside_outofcuda_is_one_warning_and_recorded(venv, workdir):
    r = venv.check(S("""
        import os, sys, warnings
        import _outofcuda
        del os.environ['OUTOFCUDA_DISABLE']
        sys.meta_path = tuple(sys.meta_path)   # the watcher cannot be inserted
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            _outofcuda.install()
        print(len(caught), caught[0].message if caught else '')
    """), env={"OUTOFCUDA_DISABLE": "1"}, cwd=workdir)
    assert r.stdout.startswith("1 outofcuda: installing the import hook failed")
    assert "meta_path" in status_of(r)["hook"]["error"]


# ---- the user's Ctrl-C and exit() ----

INTERRUPT_SETTER = """
def _set_cudnn_benchmark(value):
    # the user's Ctrl-C (or an exit()) lands while outofcuda sets torch's flags
    raise {exc}
"""


@pytest.mark.parametrize("exc", ["KeyboardInterrupt", "SystemExit(3)"])
@pytest.mark.parametrize("when", ["import torch", "outofcuda.apply()"])
def test_ctrl_c_and_exit_inside_outofcuda_propagate(venv, tmp_path, exc, when):
    from fake_torch import make_fake_torch
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    with open(root / "torch" / "_C.py", "a") as f:
        f.write(INTERRUPT_SETTER.format(exc=exc))
    first = "import torch"
    env = {"PYTHONPATH": str(root)}
    if when != "import torch":
        # the hook stands aside at start-up, torch is imported, then the
        # program applies outofcuda itself
        first = "import os; os.environ['OUTOFCUDA_DISABLE'] = '0'; import torch, outofcuda; " + when
        env["OUTOFCUDA_DISABLE"] = "1"
    body = f"""
import sys
try:
    {first}
except KeyboardInterrupt:
    print('KeyboardInterrupt reached the program')
    sys.exit(5)
print('the program went on')
"""
    r = venv.run(body, env=env, cwd=tmp_path, args=("-W", "error"))
    if exc == "KeyboardInterrupt":
        assert r.returncode == 5, (r.stdout, r.stderr)
        assert "KeyboardInterrupt reached the program" in r.stdout
    else:
        assert r.returncode == 3, (r.stdout, r.stderr)
    assert "the program went on" not in r.stdout
    assert "SystemError" not in r.stderr, r.stderr


# Where outofcuda runs torch's code after the import: CUDA's start (its
# queued callback sets the fraction) and an API call (clear_cache asks
# whether CUDA is up). The interrupt is raised as that call returns, in the
# program's thread, never held for a later one.
LATE_INTERRUPTS = {
    "CUDA's start": ("_C.py", """
def _cuda_setMemoryFraction(fraction, device):
    raise {exc}
""", "torch.cuda._fake_cuda_init()"),
    "an API call": ("cuda/__init__.py", """
def is_initialized():
    raise {exc}
""", "outofcuda.clear_cache()"),
}


@pytest.mark.parametrize("exc", ["KeyboardInterrupt", "SystemExit(3)"])
@pytest.mark.parametrize("where", sorted(LATE_INTERRUPTS))
def test_ctrl_c_after_the_import_reaches_the_call_it_arrived_in(venv, tmp_path, exc, where):
    from fake_torch import make_fake_torch
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    path, code, call = LATE_INTERRUPTS[where]
    with open(root / "torch" / path, "a") as f:
        f.write(code.format(exc=exc))
    r = venv.run(S(f"""
        import sys, threading
        import torch, outofcuda
        try:
            {call}
        except KeyboardInterrupt:
            print('KeyboardInterrupt reached the call')
            sys.exit(5)
        print('the program went on')
    """), env={"PYTHONPATH": str(root), "OUTOFCUDA_MEMORY_FRACTION": "0.9"}, cwd=tmp_path,
        args=("-W", "error"))
    assert "the program went on" not in r.stdout, (r.stdout, r.stderr)
    if exc == "KeyboardInterrupt":
        assert r.returncode == 5, (r.stdout, r.stderr)
    else:
        assert r.returncode == 3, (r.stdout, r.stderr)
    assert "SystemError" not in r.stderr, r.stderr


def test_ctrl_c_where_outofcuda_looks_for_a_missing_name_propagates(venv, tmp_path):
    # the engine asks torch for names that may be absent (a missing one is an
    # answer, not an error): a Ctrl-C raised by the look-up is the program's
    from fake_torch import make_fake_torch
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    with open(root / "torch" / "cuda" / "__init__.py", "a") as f:
        f.write("del _lazy_call\n"
                "def __getattr__(name):\n"
                "    if name == '_lazy_call':\n"
                "        raise KeyboardInterrupt\n"
                "    raise AttributeError(name)\n")
    r = venv.run(S("""
        import sys
        try:
            import torch
        except KeyboardInterrupt:
            print('KeyboardInterrupt reached the program')
            sys.exit(5)
        print('the program went on')
    """), env={"PYTHONPATH": str(root)}, cwd=tmp_path, args=("-W", "error"))
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert "SystemError" not in r.stderr, r.stderr


def test_systemexit_in_a_thread_ends_that_thread_not_the_program(venv, tmp_path):
    # sys.exit() inside torch code that outofcuda runs in a worker thread: as
    # without outofcuda, it ends the thread; the main thread never sees it.
    from fake_torch import make_fake_torch
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    with open(root / "torch" / "cuda" / "__init__.py", "a") as f:
        f.write(LATE_INTERRUPTS["an API call"][1].format(exc="SystemExit(3)"))
    r = venv.run(S("""
        import threading
        import torch, outofcuda
        seen = []
        def worker():
            try:
                outofcuda.clear_cache()
            except SystemExit:
                seen.append('SystemExit')
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        print(seen, outofcuda.clear_cache.__name__)
        outofcuda.status()
        print('the program went on')
    """), env={"PYTHONPATH": str(root)}, cwd=tmp_path, args=("-W", "error"))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "['SystemExit'] clear_cache" in r.stdout
    assert "the program went on" in r.stdout


def test_apply_beside_a_stand_in_torch_waits_for_the_real_one(venv, workdir):
    # a test suite puts a mock in sys.modules, calls apply(), then removes it
    r = venv.run(S("""
        import os, sys, types
        os.environ['OUTOFCUDA_DISABLE'] = '0'
        sys.modules['torch'] = types.ModuleType('torch')
        import outofcuda
        outofcuda.apply()
        del sys.modules['torch']
        import torch
    """), env={"OUTOFCUDA_DISABLE": "1", "OUTOFCUDA_VERBOSE": "1"}, cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert firings(r) == 1, r.stderr
    assert status_of(r)["torch"].startswith("2.13.0")


# ---- a partly written install (an interrupted pip, a full disk) ----

@pytest.mark.parametrize("size", [1000, 8000, 16000])
def test_partly_written_boot_never_breaks_start_up(venv, workdir, size):
    """The .pth line loads the boot only at the size recorded when it was
    built: a truncated file is never mapped (mapping one dies with SIGBUS), so
    Python starts, pip can repair the install, and torch imports untouched."""
    (so,) = venv.site.glob("outofcuda_hook*.so")
    backup = workdir / "backup.so"
    shutil.copy2(so, backup)
    try:
        so.write_bytes(backup.read_bytes()[:size])
        r = venv.run("pass", cwd=workdir)
        assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stderr)
        r = venv.check("import sys, torch; print(torch.ones(2).sum().item(), "
                       "'outofcuda_hook' in sys.modules, '_outofcuda' in sys.modules)", cwd=workdir)
        assert r.stdout.split() == ["2.0", "False", "False"] and r.stderr == ""
        r = venv.run(None, args=("-m", "pip", "--version"), cwd=workdir)
        assert r.returncode == 0, r.stderr
    finally:
        shutil.copy2(backup, so)


def test_partly_written_engine_never_breaks_import_torch(venv, workdir):
    """The boot checks that the engine holds every byte its ELF headers
    promise before it loads it: a truncated engine is reported (under
    OUTOFCUDA_DEBUG) and torch imports as without outofcuda."""
    (so,) = venv.site.glob("_outofcuda*.so")
    backup = workdir / "backup.so"
    shutil.copy2(so, backup)
    try:
        so.write_bytes(backup.read_bytes()[:100_000])
        r = venv.check("import sys, torch; print(torch.ones(2).sum().item(), "
                       "'_outofcuda' in sys.modules)", cwd=workdir)
        assert r.stdout.split() == ["2.0", "False"] and r.stderr == ""
        r = venv.check("import torch", env={"OUTOFCUDA_DEBUG": "1"}, cwd=workdir)
        assert "is incomplete (a partly written file): reinstall outofcuda" in r.stderr, r.stderr
        # `import outofcuda` works and says so where the engine is needed, and
        # doctor explains: neither dies of the mapping
        r = venv.run("import outofcuda; outofcuda.status()", cwd=workdir)
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "is incomplete (a partly written file): reinstall outofcuda" in r.stderr, r.stderr
        r = venv.run(None, args=("-m", "outofcuda", "doctor"), cwd=workdir)
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "is incomplete (a partly written file): reinstall outofcuda" in r.stderr, r.stderr
    finally:
        shutil.copy2(backup, so)


# ---- import tools in front of the watcher (tracers, coverage, ddtrace) ----

@pytest.fixture(scope="session")
def ddtrace_dir(venv, tmp_path_factory):
    """The real ddtrace 4.16.0 from the package index, installed once into a
    folder of its own that a scenario puts on PYTHONPATH (the shared
    environment stays as it is). OUTOFCUDA_TEST_DDTRACE_DIR reuses one."""
    from conftest import pip_target
    return pip_target(venv.python, "ddtrace==4.16.0", "OUTOFCUDA_TEST_DDTRACE_DIR",
                      tmp_path_factory)


LOADERS = S("""
    import importlib.machinery, torch
    print('LOADERS=' + json.dumps([type(torch.__loader__).__name__, type(torch.__spec__.loader).__name__,
                                   isinstance(torch.__loader__, importlib.machinery.SourceFileLoader)]))
""".replace("import importlib", "import json, importlib"))


@pytest.mark.parametrize("how", ["ddtrace-run", "import ddtrace.auto"])
def test_real_ddtrace_imports_torch(venv, workdir, ddtrace_dir, how):
    code = LOADERS if how == "ddtrace-run" else "import ddtrace.auto\n" + LOADERS
    args = ("-m", "ddtrace.commands.ddtrace_run", str(venv.python), "-c", code) \
        if how == "ddtrace-run" else ()
    # TMPDIR: ddtrace keeps files for its processes in the temporary folder.
    env = {"PYTHONPATH": ddtrace_dir, "DD_TRACE_ENABLED": "true", "DD_INSTRUMENTATION_TELEMETRY_ENABLED": "false",
           "DD_REMOTE_CONFIGURATION_ENABLED": "false", "TMPDIR": str(workdir)}
    runs = {}
    for label, extra in (("with", {}), ("without", {"OUTOFCUDA_DISABLE": "1"})):
        r = venv.run(None if args else code, args=args, env=dict(env, **extra), cwd=workdir,
                     timeout=300)
        assert r.returncode == 0, f"{label}: exit {r.returncode}\n{r.stderr[-3000:]}"
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("LOADERS=")][-1]
        runs[label] = (json.loads(line[len("LOADERS="):]), status_of(r)["hook"])
    # ddtrace's wrapper stays on the spec, the real loader on the module, as without outofcuda.
    assert runs["with"][0] == runs["without"][0] == \
        ["SourceFileLoader", "_ImportHookChainedLoader", True]
    assert runs["with"][1] == {"installed": True, "fired": True, "error": None}
    assert runs["without"][1]["fired"] is False


TOOL = """
import importlib.abc, importlib.machinery, json, sys
calls = {"find_spec": 0, "exec_module": 0, "set": []}

class Chained:
    # What tracers and ddtrace's ModuleWatchdog do: wrap the loader they were
    # handed, set attributes on it, and chain to it.
    def __init__(self, loader):
        self.loader = loader
    def create_module(self, spec):
        return self.loader.create_module(spec)
    def exec_module(self, module):
        calls["exec_module"] += 1
        get_code = self.loader.get_code
        self.loader.get_code = lambda fullname: (calls["set"].append(fullname), get_code(fullname))[1]
        self.loader.exec_module(module)
    def __getattr__(self, name):
        return getattr(self.loader, name)

class Tool:
    guarded = GUARDED
    busy = False
    def find_spec(self, name, path=None, target=None):
        if name != "torch" or (self.guarded and self.busy):
            return None
        calls["find_spec"] += 1
        self.busy = True
        try:
            for f in sys.meta_path:
                if f is not self:
                    spec = f.find_spec(name, path, target)
                    if spec is not None:
                        spec.loader = Chained(spec.loader)
                        return spec
        finally:
            self.busy = False

sys.meta_path.insert(0, Tool())
import torch, _outofcuda
calls["loaders"] = [type(torch.__loader__).__name__, type(torch.__spec__.loader).__name__,
                    type(torch.__spec__.loader.loader).__name__]
calls["fired"] = _outofcuda.status()["hook"]["fired"]
print("TOOL=" + json.dumps(calls))
"""


@pytest.mark.parametrize("guarded", [False, True])
def test_an_import_tool_ahead_runs_once_and_keeps_its_loader(venv, workdir, guarded):
    code = TOOL.replace("GUARDED", str(guarded))
    runs = {}
    for label, extra in (("with", {}), ("without", {"OUTOFCUDA_DISABLE": "1"})):
        r = venv.run(code, env=extra, cwd=workdir)
        assert r.returncode == 0, f"{label}: {r.stderr[-3000:]}"
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("TOOL=")][-1]
        runs[label] = json.loads(line[len("TOOL="):])
    with_, without = runs["with"], runs["without"]
    # One find_spec and one exec_module for one import, the get_code it set used.
    assert with_["find_spec"] == without["find_spec"] == 1
    assert with_["exec_module"] == without["exec_module"] == 1
    assert with_["set"] == without["set"] == ["torch"]
    # The tool's wrapper where it put it, the real loader inside it.
    assert with_["loaders"] == without["loaders"] == ["Chained", "Chained", "SourceFileLoader"]
    assert with_["fired"] is True and without["fired"] is False


def test_find_spec_without_import_gives_a_loader_that_answers_as_the_real_one(venv, workdir):
    r = venv.check(S("""
        import importlib.abc, importlib.machinery, importlib.util, sys
        spec = importlib.util.find_spec('torch')
        loader = spec.loader
        out = [isinstance(loader, importlib.abc.Loader),
               isinstance(loader, importlib.machinery.SourceFileLoader),
               loader.__class__.__name__, loader.is_package('torch')]
        loader.marker = 42                      # writes reach the loader it wraps
        out.append(vars(loader).get('marker'))
        del loader.marker
        out.append(hasattr(loader, 'marker'))
        out.append('torch' in sys.modules)
        print(json.dumps(out))
    """.replace("import importlib.abc", "import json, importlib.abc")), cwd=workdir)
    assert json.loads(r.stdout.splitlines()[0]) == [True, True, "SourceFileLoader", True, 42, False, False]


def test_the_loader_proxy_copies_pickles_and_is_weakly_referenced_as_the_loader(venv, workdir):
    """copy.copy, copy.deepcopy and pickle (every protocol) of find_spec's
    loader give a copy of torch's own loader (not watched); a weak reference
    to the proxy works and dies with it. Only type() names the proxy
    (docs/how-the-hook-works.md says so)."""
    out = venv.json("""
        import copy, gc, importlib.util, json, pickle, weakref
        spec = importlib.util.find_spec('torch')
        loader = spec.loader
        copies = [copy.copy(loader), copy.deepcopy(loader)] + [
            pickle.loads(pickle.dumps(loader, p)) for p in range(pickle.HIGHEST_PROTOCOL + 1)]
        ref = weakref.ref(loader)
        out = {"copies": sorted({type(c).__name__ for c in copies}),
               "equal": all(c == loader and c.path == loader.path for c in copies),
               "weak": ref() is loader, "type": type(loader).__name__,
               "class": loader.__class__.__name__}
        del spec, loader
        gc.collect()
        out["dead"] = ref() is None
        import torch, _outofcuda
        out["fired"] = _outofcuda.status()["hook"]["fired"]
        print(json.dumps(out))
    """, cwd=workdir)
    assert out == {"copies": ["SourceFileLoader"], "equal": True, "weak": True,
                   "type": "LoaderProxy", "class": "SourceFileLoader", "dead": True,
                   "fired": True}


# ---- an application that embeds Python and starts it again ----

EMBED_C = r"""
#include <Python.h>
#include <stdlib.h>

/* argv[2] run by argv[3] interpreters, one after the other in one process,
 * each started as the Python argv[1] (its pyvenv.cfg makes the environment's
 * site-packages, and the hook there, the interpreter's). */
int main(int argc, char **argv)
{
    for (int i = 0; argc == 4 && i < atoi(argv[3]); i++) {
        PyConfig config;
        PyStatus status;
        int rc;
        PyConfig_InitPythonConfig(&config);
        status = PyConfig_SetBytesString(&config, &config.program_name, argv[1]);
        if (!PyStatus_Exception(status))
            status = Py_InitializeFromConfig(&config);
        PyConfig_Clear(&config);
        if (PyStatus_Exception(status))
            Py_ExitStatusException(status);
        rc = PyRun_SimpleString(argv[2]);
        if (Py_FinalizeEx() < 0 || rc != 0)
            return 1;
    }
    return argc == 4 ? 0 : 2;
}
"""

EMBEDDED = """
import json, sys
import torch, _outofcuda
torch.cuda._fake_cuda_init()
print(json.dumps({
    "watchers": sum(type(f).__name__ == "TorchImportWatcher" for f in sys.meta_path),
    "ours": sys.modules["outofcuda_hook"]._finder() in sys.meta_path,
    "fired": _outofcuda.status()["hook"]["fired"], "conf": torch._alloc_conf()}))
"""


def test_python_started_again_in_one_process_gets_a_hook_that_works(venv, workdir, tmp_path):
    """Py_FinalizeEx then Py_InitializeFromConfig, three times in one process
    (an application that embeds Python): each interpreter gets a finder of its
    own and imports a stand-in torch, where the boot used to hand the second
    the ended interpreter's objects (importlib's TypeError). outofcuda applies
    its settings once per process: in the first interpreter."""
    bindir, version, libdir = venv.json(
        "import json, sysconfig; print(json.dumps([sysconfig.get_config_var(k) for k in "
        "('BINDIR', 'VERSION', 'LIBDIR')]))")
    config = os.path.join(bindir, f"python{version}-config")
    if not os.path.exists(config) or shutil.which("gcc") is None:
        pytest.skip(f"no gcc or no {config} to build an embedding program with")
    flags = [f for opt in (["--includes"], ["--embed", "--ldflags"]) for f in subprocess.run(
        [config, *opt], capture_output=True, text=True, check=True).stdout.split()]
    (tmp_path / "embed.c").write_text(EMBED_C)
    subprocess.run(["gcc", "-Wall", "-Wextra", "-Werror", str(tmp_path / "embed.c"), "-o",
                    str(tmp_path / "embed"), *flags, f"-Wl,-rpath,{libdir}"], check=True)
    fake = make_fake_torch(tmp_path / "fake", "2.14.1")
    env = dict(_sanitizer_env() if SANITIZE else {}, PYTHONPATH=str(fake))
    r = subprocess.run([str(tmp_path / "embed"), str(venv.python), EMBEDDED, "3"], cwd=workdir,
                       env=_clean_env(env), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    runs = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [(o["watchers"], o["ours"], o["fired"]) for o in runs] == [(1, True, True)] * 3
    assert "expandable_segments:True" in runs[0]["conf"]
    assert runs[1]["conf"] == runs[2]["conf"] == ""

