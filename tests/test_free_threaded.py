"""Free-threaded Python (3.13t, 3.14t, 3.15t): the source build refuses with
one sentence, and both extensions refuse to initialise in a free-threaded
interpreter, so none is ever loaded there and the GIL is never re-enabled for
a process. No free-threaded interpreter exists on these machines: the
interpreter's answers are simulated (sysconfig's Py_GIL_DISABLED for the
build, sys.abiflags at run time) on a GIL-enabled one. The engine declares
Py_mod_gil only where the running Python knows the slot (3.13+)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, _clean_env, wait_for_setup
from test_packaging import clean_copy, make_venv, pip, pyenv_python

# sysconfig answers as a free-threaded build's would, in every interpreter
# started with this folder on PYTHONPATH (pip's build backend included).
FREE_THREADED_BUILD = """
import sysconfig
_real = sysconfig.get_config_var
sysconfig.get_config_var = lambda name: 1 if name == "Py_GIL_DISABLED" else _real(name)
"""


def test_source_build_on_free_threaded_python_fails_with_one_sentence(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(FREE_THREADED_BUILD)
    src = clean_copy(tmp_path / "src")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(tmp_path / "out"), str(src)],
                       capture_output=True, text=True, timeout=300,
                       env=_clean_env({"PYTHONPATH": str(fake)}))
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    version = "{}.{}".format(*sys.version_info[:2])
    lines = [ln.strip() for ln in out.splitlines()
             if "outofcuda cannot be installed on free-threaded Python" in ln]
    assert len(lines) == 1, out[-3000:]
    sentence = lines[0]
    assert sentence.endswith(".") and sentence.count(". ") == 0, sentence
    assert f"({version}t)" in sentence and f"python{version} rather than python{version}t" \
        in sentence
    # Refused before anything compiles: no compiler ran, nothing was built.
    assert "gcc" not in out and not list((tmp_path / "out").glob("*.whl"))


def test_refusal_function_passes_a_gil_enabled_build():
    scope = {}
    code = (ROOT / "setup.py").read_text()
    start = code.index("def refuse_free_threaded_build")
    end = code.index("\n\n\n", start)
    exec(code[start:end], scope)
    scope["refuse_free_threaded_build"](lambda name: 0)
    scope["refuse_free_threaded_build"](lambda name: None)
    with pytest.raises(SystemExit) as exc:
        scope["refuse_free_threaded_build"](lambda name: 1 if name == "Py_GIL_DISABLED" else None)
    assert "free-threaded" in str(exc.value)


# A .pth that sorts before outofcuda's: sys.abiflags as a free-threaded
# interpreter has it, before outofcuda's hook line runs.
SIMULATE_FREE_THREADED = "import sys; sys.abiflags = sys.abiflags + 't'\n"

SCENARIO = """
import json, sys
out = {"abiflags": sys.abiflags,
       "boot": "outofcuda_hook" in sys.modules,
       "watchers": sum(type(f).__name__ == "TorchImportWatcher" for f in sys.meta_path)}
import torch
out["engine_after_torch"] = "_outofcuda" in sys.modules
for name in ("outofcuda_hook", "_outofcuda"):
    try:
        __import__(name)
        out[name] = "loaded"
    except ImportError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hook_venv(wheel, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ft")
    py = make_venv(sys.executable, tmp / "v")
    pip(py, "install", "--no-deps", str(wheel))
    site = subprocess.run([str(py), "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # A stand-in torch: the test asks only whether the engine loads for it.
    (tmp / "path" / "torch").mkdir(parents=True)
    (tmp / "path" / "torch" / "__init__.py").write_text("")
    return py, tmp / "path", site


def run_scenario(hook_venv, free_threaded, tmp_path):
    py, path, site = hook_venv
    pth = Path(site) / "00_simulate_free_threaded.pth"
    if free_threaded:
        pth.write_text(SIMULATE_FREE_THREADED)
    try:
        r = subprocess.run([str(py), "-c", SCENARIO], capture_output=True, text=True, cwd=tmp_path,
                           env=_clean_env({"PYTHONPATH": str(path), "OUTOFCUDA_DEBUG": "1"}),
                           timeout=120)
    finally:
        pth.unlink(missing_ok=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1]), r.stderr


def test_boot_and_engine_stay_out_of_a_free_threaded_interpreter(hook_venv, tmp_path):
    out, err = run_scenario(hook_venv, True, tmp_path)
    assert "t" in out["abiflags"]
    assert not out["boot"] and out["watchers"] == 0
    assert not out["engine_after_torch"]
    refusal = "outofcuda stays out of free-threaded Python"
    assert out["outofcuda_hook"].startswith(refusal), out
    assert out["_outofcuda"].startswith(refusal), out
    # Start-up stays silent: the .pth line swallows the refusal.
    assert err == "", err


def test_gil_enabled_interpreter_still_gets_the_hook(hook_venv, tmp_path):
    out, err = run_scenario(hook_venv, False, tmp_path)
    assert out["boot"] and out["watchers"] == 1 and out["engine_after_torch"], (out, err)
    assert out["outofcuda_hook"] == "loaded" and out["_outofcuda"] == "loaded"


# The engine's module slots as CPython holds them (PyModuleDef: the base's
# five pointers, then m_name, m_doc, m_size, m_methods, m_slots).
SLOTS = """
import ctypes, json, _outofcuda
get_def = ctypes.pythonapi.PyModule_GetDef
get_def.restype, get_def.argtypes = ctypes.c_void_p, [ctypes.py_object]
P = ctypes.sizeof(ctypes.c_void_p)
d = get_def(_outofcuda)
name = ctypes.c_char_p.from_address(d + 5 * P).value.decode()
class Slot(ctypes.Structure):
    _fields_ = [("slot", ctypes.c_int), ("value", ctypes.c_void_p)]
at, slots = ctypes.c_void_p.from_address(d + 9 * P).value, []
while True:
    s = Slot.from_address(at + len(slots) * ctypes.sizeof(Slot))
    if s.slot == 0:
        break
    slots.append([s.slot, s.value or 0])
print(json.dumps({"name": name, "slots": slots, "status": _outofcuda.status()["version"]}))
"""


@pytest.mark.parametrize("version,gil_slot", [("3.9", False), ("3.12", False), ("3.13", True)])
def test_engine_declares_py_mod_gil_only_where_python_knows_it(wheel, tmp_path, version, gil_slot):
    py = make_venv(pyenv_python(version), tmp_path / "v")
    pip(py, "install", "--no-deps", str(wheel))
    r = subprocess.run([str(py), "-c", SLOTS], capture_output=True, text=True, env=_clean_env(),
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = json.loads(r.stdout)
    assert out["name"] == "_outofcuda"
    kinds = [s[0] for s in out["slots"]]
    assert kinds[0] == 2  # Py_mod_exec
    # Py_mod_gil is 4; Py_MOD_GIL_USED is 0: the engine relies on the GIL.
    assert (4 in kinds) == gil_slot, out
    if gil_slot:
        assert [4, 0] in out["slots"]


# ---- the experimental abi3t build (OC_ABI3T) on a real Python 3.15 ----
# A Debian sid root with python3.15 and gcc (the one .ci/run builds);
# OUTOFCUDA_TEST_CHROOT names it. Both extensions are compiled by hand for
# abi3t (setuptools builds abi3t only when a free-threaded interpreter runs it),
# installed into a fresh 3.15 venv beside the package and the .pth line, and a
# stand-in torch 2.14.1 is imported under -W error.
# What abi3t asks of the C code (found with -DPy_TARGET_ABI3T=0x030f0000 against
# Debian's 3.15.2 headers, gcc 16.2): PyObject_HEAD is opaque (boot.c's finder,
# watcher.c's loader proxy keep their field in PyObject_GetTypeData, and the
# finder's setattr'd attributes in its own dict through tp_getattro/tp_setattro),
# and PyModuleDef is gone (boot.c and module.c export PyModExport_<name> slots);
# -DOC_ABI3T switches this, the normal build is unchanged. The line an abi3t wheel
# carries names the .abi3t.so and runs it (_imp.exec_dynamic: multi-phase).
# setuptools builds abi3t only when a free-threaded interpreter runs it
# (setuptools issue 5205, PR 5193). Only a free-threaded interpreter can show that
# the files load there, that the export hooks' refusal leaves the GIL disabled, and
# (before Py_MOD_GIL_NOT_USED could be declared) that the process-wide state is
# safe without the GIL, which needs locks the code does not have.
ABI3T_SCRIPT = r"""
set -e
cd "$1"
F="-std=c11 -Wall -Wextra -Werror -fvisibility=hidden -fPIC -shared -D_GNU_SOURCE=1 -I/usr/include/python3.15"
T="-DOC_ABI3T -DPy_LIMITED_API=0x030f0000 -DPy_TARGET_ABI3T=0x030f0000"
gcc $F $T src/boot.c -o outofcuda_hook.abi3t.so
gcc $F $T $(ls src/*.c | grep -v boot.c) -ldl -lpthread -o _outofcuda.abi3t.so
# the line the wheel would carry for this boot: its file name and size
sed -i "s/BOOT_SIZE/$(stat -c %s outofcuda_hook.abi3t.so)/" outofcuda_hook.pth
python3.15 -m venv --without-pip v
SITE=$(v/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp -r outofcuda outofcuda_hook.pth outofcuda_hook.abi3t.so _outofcuda.abi3t.so "$SITE/"
(cd tests && ../v/bin/python -c "from pathlib import Path; from fake_torch import make_fake_torch; make_fake_torch(Path('../fake'), '2.14.1')")
PYTHONPATH="$PWD/fake" v/bin/python -W error -c "$2"
"""

ABI3T_CHECK = """
import json, sys
boot = sys.modules.get("outofcuda_hook")
out = {"boot": getattr(boot, "__file__", None),
       "watchers": sum(type(f).__name__ == "TorchImportWatcher" for f in sys.meta_path)}
f = boot._finder()
orig = f.find_spec
f.find_spec = lambda *a, **k: orig(*a, **k)
out["patched"] = f.find_spec is not orig
del f.find_spec
import torch, _outofcuda
torch.cuda._fake_cuda_init()
st = _outofcuda.status()
out.update(engine=_outofcuda.__file__, hook=st["hook"], conf=torch._alloc_conf(),
           tf32=st["optimizations"]["tf32"]["applied"], loader=type(torch.__spec__.loader).__name__,
           version=sys.version.split()[0])
print(json.dumps(out))
"""


def test_abi3t_build_loads_and_works_on_gil_enabled_315(tmp_path):
    import os
    import shutil

    root = os.environ.get("OUTOFCUDA_TEST_CHROOT")
    wait_for_setup("chroot")
    if not root or not Path(root, "usr/bin/python3.15").exists():
        pytest.skip("OUTOFCUDA_TEST_CHROOT does not name a root with python3.15 and gcc")
    work = Path(root, "tmp", f"oc-abi3t-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        for name in ("src", "outofcuda"):
            shutil.copytree(ROOT / name, work / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        (work / "tests").mkdir()
        for name in ("fake_torch.py", "releases.json"):  # the stand-in and its records
            shutil.copy(ROOT / "tests" / name, work / "tests")
        # The line an abi3t wheel would carry: the abi3t file, and a load that
        # also gives the module its file (where the engine is found) and runs
        # it (the abi3t boot is a multi-phase module).
        line = (ROOT / "outofcuda_hook.pth").read_text().replace("abi3.so", "abi3t.so")
        create = "_imp.create_dynamic(sys.implementation.__class__(name='outofcuda_hook',origin=p))"
        assert create in line
        (work / "outofcuda_hook.pth").write_text(
            line.replace(create, f"m={create};m.__file__=p;_imp.exec_dynamic(m)"))
        (work / "run.sh").write_text(ABI3T_SCRIPT)
        inside = "/" + str(work.relative_to(root))
        r = subprocess.run(["chroot", root, "bash", f"{inside}/run.sh", inside, ABI3T_CHECK],
                           capture_output=True, text=True, timeout=600, env=_clean_env())
        if r.returncode != 0 and "Operation not permitted" in r.stderr:
            pytest.skip("chroot is not permitted here: " + r.stderr.strip())
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        out = json.loads(r.stdout.splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert out["version"].startswith("3.15")
    assert out["boot"].endswith("/outofcuda_hook.abi3t.so") and out["watchers"] == 1
    assert out["engine"].endswith("/_outofcuda.abi3t.so")
    assert out["hook"] == {"installed": True, "fired": True, "error": None}
    assert "expandable_segments:True" in out["conf"] and out["tf32"]
    assert out["patched"] and out["loader"] == "SourceFileLoader"
