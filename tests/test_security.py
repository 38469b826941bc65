"""Security: outofcuda runs in every Python process of an environment, so it
must never load code or libraries chosen by whoever controls the working
directory, the script's directory or an OUTOFCUDA_* value.

Planted files write a marker when loaded: Python modules (`torch.py`,
`outofcuda.py`, `_outofcuda.py`, `outofcuda_hook.py`) and a tiny C shared
object `libnvidia-ml.so.1` whose constructor writes the marker. A positive
control loads the same fake library through LD_LIBRARY_PATH (the system
loader's own, user-chosen search path) to prove the marker works."""
import ast
import base64
import hashlib
import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLANTED_MODULES = ["torch", "outofcuda", "_outofcuda", "outofcuda_hook"]

FAKE_LIB_C = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void)
{
    int fd = open(MARKER, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
        (void)!write(fd, "loaded\n", 7);
        close(fd);
    }
}
"""

# Everything outofcuda does without a GPU: start-up, torch import, status,
# config, NVML queries, the API, a MemoryMonitor cycle, an uncaught OOM report.
EXERCISE = """
import json, os, sys, warnings
warnings.simplefilter("ignore")
ext = sys.modules.get("outofcuda_hook")  # the boot, loaded at start-up
ext_file = getattr(ext, "__file__", None)
import torch
import _outofcuda
_outofcuda.status(); _outofcuda.config(); _outofcuda.nvml_devices()
try:
    _outofcuda.nvml_processes(0)
except Exception:
    pass
from outofcuda._native import core
import outofcuda.api, outofcuda.monitor
outofcuda.api.memory_report(); outofcuda.api.clear_cache()
with outofcuda.monitor.MemoryMonitor(threshold=0.85, interval=0.05):
    pass
print(json.dumps({"ext_file": ext_file, "core_file": core.__file__,
                  "hook": _outofcuda.status()["hook"]}), flush=True)
raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
"""


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory):
    """Builds the fake libnvidia-ml.so.1; returns (library, marker path)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the fake NVIDIA library")
    d = tmp_path_factory.mktemp("fakelib")
    marker = d / "MARKER-libnvidia-ml"
    src = d / "fake.c"
    src.write_text(FAKE_LIB_C)
    lib = d / "libnvidia-ml.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), f'-DMARKER="{marker}"', str(src)],
                   check=True)
    return lib, marker


def _plant(directory, markers):
    for name in PLANTED_MODULES:
        (directory / f"{name}.py").write_text(
            f"open({str(markers / ('MARKER-' + name))!r}, 'w').close()\n")


def _markers(markers):
    return sorted(p.name for p in markers.glob("MARKER-*"))


SHADOWED = """
import json, torch, _outofcuda
print(json.dumps(_outofcuda.status()["hook"]))
"""


def _scenario(venv, workdir, tmp_path, fake_nvml, torch_beside_script):
    """Plants modules and the fake library in the working directory and in the
    script's directory (different folders), then runs EXERCISE as a script."""
    lib, lib_marker = fake_nvml
    markers = tmp_path / "markers"
    markers.mkdir()
    script_dir = tmp_path / "scripts"
    script_dir.mkdir()
    for d in (workdir, script_dir):
        _plant(d, markers)
        shutil.copy(lib, d / "libnvidia-ml.so.1")
    if not torch_beside_script:
        # The script itself imports torch and outofcuda by name: Python (not
        # outofcuda) would load those two from beside it.
        (script_dir / "torch.py").unlink()
        (script_dir / "outofcuda.py").unlink()
    script = script_dir / "train.py"
    # With torch.py beside the script, the script's own imports load planted
    # files (Python's rule, not outofcuda's): that script imports torch only.
    script.write_text(SHADOWED if torch_beside_script else EXERCISE)
    if lib_marker.exists():
        lib_marker.unlink()
    ld_log = tmp_path / "ld" / "debug"
    ld_log.parent.mkdir()
    r = venv.run(None, args=[str(script)], cwd=workdir, timeout=120,
                 env={"LD_DEBUG": "libs", "LD_DEBUG_OUTPUT": str(ld_log)})
    r.ld_debug = "".join(p.read_text(errors="replace") for p in ld_log.parent.iterdir())
    return r, _markers(markers), lib_marker.exists(), script_dir


def test_planted_files_with_torch_shadowed(venv, workdir, tmp_path, fake_nvml):
    """torch.py beside the script: Python itself (the script's `import torch`)
    loads it, and the hook fires on that module. outofcuda still loads none of
    its own planted names, no library, and does not crash the process."""
    r, loaded, lib_loaded, _ = _scenario(venv, workdir, tmp_path, fake_nvml, True)
    assert r.returncode >= 0, f"killed by signal {-r.returncode}"
    assert "MARKER-torch" in loaded, "control: the script's own import should load torch.py"
    assert [m for m in loaded if m != "MARKER-torch"] == [], loaded
    assert r.returncode == 0, r.stderr[-3000:]
    hook = json.loads(r.stdout)
    assert hook["installed"] is True and hook["fired"] is True
    assert not lib_loaded, "the planted libnvidia-ml.so.1 was loaded"


def test_planted_files_are_never_loaded(venv, workdir, tmp_path, fake_nvml):
    """torch.py only in the working directory (not on a script's sys.path):
    the real torch loads, outofcuda does all its work, and none of the
    planted files is loaded, nor even looked at by the system loader."""
    r, loaded, lib_loaded, script_dir = _scenario(venv, workdir, tmp_path, fake_nvml, False)
    assert r.returncode == 1 and "torch.OutOfMemoryError" in r.stderr, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[0])
    assert out["ext_file"] and out["ext_file"].startswith(str(venv.site)), out
    # The engine (loaded on import torch) sits beside the boot that loaded it.
    assert Path(out["core_file"]).parent == Path(out["ext_file"]).parent
    assert out["hook"] == {"installed": True, "fired": True, "error": None}
    assert "out of memory" in r.stderr
    assert loaded == [], f"planted modules were loaded: {loaded}"
    assert not lib_loaded, "the planted libnvidia-ml.so.1 was loaded"
    assert "libnvidia-ml.so.1" in r.ld_debug, "control: NVML was looked up by soname"
    for d in (workdir, script_dir):
        assert f"{d}/libnvidia-ml" not in r.ld_debug


def test_planted_extension_module_with_hook_disabled(venv, workdir, tmp_path):
    """With the hook off (_outofcuda not imported at start-up), `import
    outofcuda` loads the extension by path beside the package, not the
    `_outofcuda.py` in the working directory (which is on sys.path for -c)."""
    markers = tmp_path / "m"
    markers.mkdir()
    _plant(workdir, markers)
    (workdir / "outofcuda.py").unlink()       # `import outofcuda` itself is the user's choice
    (workdir / "torch.py").unlink()
    r = venv.check("""
        import sys
        assert "_outofcuda" not in sys.modules
        import outofcuda
        print(outofcuda._core.__file__)
        outofcuda.status()
    """, cwd=workdir, env={"OUTOFCUDA_DISABLE": "1"})
    assert r.stdout.strip().startswith(str(venv.site)) and r.stdout.strip().endswith(".so")
    assert _markers(markers) == []


def test_fake_library_marker_works(venv, workdir, fake_nvml):
    """Positive control: the fake library does announce itself when the
    system loader is told to look in its folder (LD_LIBRARY_PATH), and
    outofcuda then reports NVML unusable instead of crashing."""
    lib, marker = fake_nvml
    if marker.exists():
        marker.unlink()
    r = venv.check("import _outofcuda; print(_outofcuda.nvml_devices())",
                   env={"LD_LIBRARY_PATH": str(lib.parent)}, cwd=workdir)
    assert marker.exists(), r.stdout + r.stderr


# ---- the start-up files ----

def _hook_files(venv):
    # The .pth as installed; the .start as the 3.18 wheel carries it.
    return {"outofcuda_hook.pth": (venv.site / "outofcuda_hook.pth").read_text(),
            "outofcuda_hook.start": (ROOT / "outofcuda_hook.start").read_text()}


def test_pth_and_start_are_constant_and_short(venv, wheel):
    files = _hook_files(venv)
    (boot,) = venv.site.glob("outofcuda_hook*.so")
    # The checkout's line, with the boot's size filled in at build time.
    expected = {"outofcuda_hook.pth": (ROOT / "outofcuda_hook.pth").read_text().replace(
                    "BOOT_SIZE", str(boot.stat().st_size)),
                "outofcuda_hook.start": (ROOT / "outofcuda_hook.start").read_text()}
    for name, text in files.items():
        assert text == expected[name], f"installed {name} differs from the checkout"
        # 320: the line reads OUTOFCUDA_VERBOSE beside OUTOFCUDA_DISABLE=1 (tests/test_hook.py).
        assert len(text) <= 320 and text.count("\n") <= 1, f"{name} is not one short line"
    assert files["outofcuda_hook.start"].strip() == "outofcuda_hook_start:install"
    pth = files["outofcuda_hook.pth"].strip()
    assert pth.startswith("import ")
    # Every exec/eval/compile/__import__ in the line takes a constant: no
    # environment value or file content is ever turned into code.
    tree = ast.parse(pth)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id in ("exec", "eval", "compile",
                                                                "__import__")]
    assert calls, "the .pth line was expected to exec a constant guard"
    for c in calls:
        assert all(isinstance(a, ast.Constant) for a in c.args), ast.dump(c)
        code = c.args[0].value
        assert "open(" not in code and "outofcuda_hook" in code
        # The guard reads one variable, by a constant name, as data.
        inner = ast.parse(code)
        reads = [n for n in ast.walk(inner) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and n.func.attr in ("getenv", "get")]
        assert all(isinstance(r.args[0], ast.Constant) and r.args[0].value == "OUTOFCUDA_DISABLE"
                   for r in reads)
        assert not any(isinstance(n, ast.Name) and n.id in ("eval", "exec", "compile")
                       for n in ast.walk(inner))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"_imp", "os", "sys"}
    # Inside the guard: the boot by path from the .pth file's own directory
    # (`sitedir`, site's variable), by name only when that fails (editable).
    inner_imports = {a.name for c in calls for n in ast.walk(ast.parse(c.args[0].value))
                     if isinstance(n, ast.Import) for a in n.names}
    assert inner_imports <= {"_imp", "outofcuda_hook"}
    # The wheel's RECORD vouches for exactly these bytes.
    with zipfile.ZipFile(wheel) as zf:
        record = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD")))
    for name, text in files.items():
        if name == "outofcuda_hook.start":
            continue  # in the cp318-abi3 wheel only
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        assert f"{name},sha256={digest.decode()},{len(text.encode())}".encode() in record


# ---- OUTOFCUDA_* values never name code or a library ----

def _all_variables():
    names = set()
    for path in list((ROOT / "src").glob("*.c")) + list((ROOT / "outofcuda").glob("*.py")):
        names |= set(re.findall(r"\bOUTOFCUDA_[A-Z0-9_]+\b", path.read_text()))
    return sorted(n for n in names if not n.endswith("_"))


def test_no_variable_names_code_or_a_library(venv, workdir, tmp_path, fake_nvml):
    lib, lib_marker = fake_nvml
    markers = tmp_path / "m"
    markers.mkdir()
    (workdir / "evil_module.py").write_text(
        f"open({str(markers / 'MARKER-evil_module')!r}, 'w').close()\ndef run(): pass\n")
    shutil.copy(lib, workdir / "libnvidia-ml.so.1")
    payloads = [
        f"__import__('os').system('touch {markers}/MARKER-eval')",
        f"$(touch {markers}/MARKER-shell)",
        f"`touch {markers}/MARKER-backtick`",
        str(lib), "./libnvidia-ml.so.1", "libnvidia-ml.so.1", "evil_module", "evil_module:run",
        f"import evil_module; open('{markers}/MARKER-exec','w')",
    ]
    names = [n for n in _all_variables() if n not in ("OUTOFCUDA_DISABLE",)]
    assert "OUTOFCUDA_ALLOC_CONF" in names and len(names) >= 15, names
    if lib_marker.exists():
        lib_marker.unlink()

    def run(env, code):
        r = venv.run(code, env=env, cwd=workdir, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "ok", (env, r.stderr[-3000:])
        assert "Traceback" not in r.stderr, (env, r.stderr[-3000:])

    def env_for(assign):
        env = dict(assign)
        if "OUTOFCUDA_OOM_SNAPSHOT" in env:  # a path it may write at an OOM: keep it here
            env["OUTOFCUDA_OOM_SNAPSHOT"] = str(tmp_path / "snap" / "x.pickle")
        return env

    # Every variable holds every payload once, without torch (fast) ...
    for payload in payloads:
        run(env_for({n: payload for n in names}), """
            import _outofcuda, outofcuda, os
            _outofcuda.status(); _outofcuda.config(); _outofcuda.nvml_devices()
            _outofcuda._parse_config({k: v for k, v in os.environ.items()})
            print("ok")
        """)
    # ... and, rotated over three runs, through `import torch` and the API.
    for k in range(3):
        run(env_for({n: payloads[(i + 3 * k) % len(payloads)] for i, n in enumerate(names)}), """
            import torch, _outofcuda, outofcuda, warnings
            warnings.simplefilter("ignore")
            _outofcuda.status(); _outofcuda.config(); _outofcuda.nvml_devices()
            outofcuda.memory_report(); outofcuda.clear_cache()
            print("ok")
        """)
    assert _markers(markers) == [], _markers(markers)
    assert not lib_marker.exists(), "a library named by an OUTOFCUDA_* value was loaded"


# ---- text from other processes reaches a terminal escaped ----

HOSTILE_NAME = b"\x1b[2J\x1b]0;x\x07"   # clear the screen, retitle the window, bell
NAMED_CHILD = """
import ctypes, sys
ctypes.CDLL(None).prctl(15, {name!r}, 0, 0, 0)   # PR_SET_NAME: any process may
print('named', flush=True)
sys.stdin.read()
"""


# Bytes that are no UTF-8 (a lone 0xff 0xfe, a three-byte sequence cut after
# two): a name Python cannot decode must not cost the report.
NOT_UTF8_NAME = b"\xff\xfegpu\xe2\x82"


# Characters that turn or hide the text after them: a right-to-left override
# (the rest of the line reads backwards), a zero-width space, a left-to-right
# isolate and a byte order mark; 15 bytes, the most a name may have.
BIDI_NAME = "\u202egpu\u200b\u2066\ufeff".encode()


@pytest.mark.parametrize("name,escaped", [(HOSTILE_NAME, r"\x1b[2J\x1b]0;x\x07"),
                                          (NOT_UTF8_NAME, r"\xff\xfegpu\xe2\x82"),
                                          (BIDI_NAME, r"\u202egpu\u200b\u2066\ufeff")])
def test_other_processes_names_are_shown_escaped(venv, workdir, tmp_path, stub_nvml_libs, name,
                                                 escaped):
    import sys
    from conftest import stub_nvml_config, stub_nvml_device
    child = subprocess.Popen([sys.executable, "-c", NAMED_CHILD.format(name=name)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "named\n"
        assert Path(f"/proc/{child.pid}/comm").read_bytes().rstrip(b"\n") == name
        cfg = stub_nvml_config(tmp_path / "nvml.cfg",
                               [stub_nvml_device(total=80 << 30, used=79 << 30)],
                               procs=[(0, child.pid, 30 << 30)])
        env = {"LD_LIBRARY_PATH": str(stub_nvml_libs["full"]), "STUB_NVML_CONFIG": str(cfg)}
        report = venv.run(None, args=("-m", "outofcuda", "report"), env=env, cwd=workdir)
        api = venv.run("""
import json, outofcuda, _outofcuda as core
rep = outofcuda.memory_report()
core._oom_observer(0, 2 * 2**30, 80 * 2**30, 2**29)
oom = outofcuda.last_oom()
print(json.dumps([rep["cuda:0"]["processes"][0]["name"], oom["other_processes"][0]["name"],
                  oom["advice"], outofcuda.oom.format_report(oom)]))
""", env=env, cwd=workdir)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
        child.stdout.close()
    assert report.returncode == 0 and api.returncode == 0, (report.stderr, api.stderr)
    for text in (report.stdout, api.stdout):
        assert "\x1b" not in text and "\x07" not in text
        assert not {"\u202e", "\u200b", "\u2066", "\ufeff"} & set(text)
    assert escaped in report.stdout, report.stdout
    mem_name, oom_name, advice, formatted = json.loads(api.stdout)
    assert mem_name == oom_name == escaped
    assert escaped in formatted and any(escaped in a for a in advice)


def test_the_audit_command_of_the_docs_runs(venv, workdir):
    """security.md's audit command, in the README's install (/tmp/oc there, the
    test environment here), exits 0 and shows the hook file."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    (command,) = re.findall(r"Audit it.*?```sh\n(.*?)\n```", text, re.S)
    assert "/tmp/oc/bin/python3" in command
    command = command.replace("/tmp/oc/bin/python3", str(venv.python))
    r = subprocess.run(["sh", "-c", command], capture_output=True, text=True, cwd=workdir,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (venv.site / "outofcuda_hook.pth").read_text()
