"""A CUDA OOM in IPython and Jupyter (src/oom.c, "IPython and Jupyter"): a
real ipykernel driven by nbclient, terminal IPython running a file, and
IPython's InteractiveShell in a plain interpreter, on the CUDA build of
torch 2.14.1 with CUDA's start simulated (outofcuda's callback run from
torch's lazy-init queue, the device calls answered by stand-ins, as in
tests/test_cuda_build.py). The OOM is a stand-in: torch's own
torch.cuda.OutOfMemoryError raised from a function whose frame holds a
tensor, watched through a weak reference.

ipykernel, nbclient and nbformat (IPython with them) come from the package
index: tests/conftest.py's `notebook_dir` installs them once per session
into a folder of their own that the scenarios put on PYTHONPATH, so the
CUDA environment stays as it is (OUTOFCUDA_TEST_NOTEBOOK_DIR reuses one).

Choices the tests hold: set_custom_exc, IPython's documented hook, not a
replaced showtraceback (offered to subclasses only), so %run shows IPython's
traceback alone; a Ctrl-C inside the handler is shown, never raised (IPython
unregisters a handler that raises); on 3.9 to 3.12 a generator thrown the OOM
at a yield that caught it and waits there again looks left, and is closed."""
import json
from pathlib import Path

def _jupyter_env(tmp_path, notebook_dir, **extra):
    """Jupyter's and IPython's folders inside tmp_path, nothing read from home."""
    home = tmp_path / "home"
    for name in ("ipython", "config", "runtime", "data"):
        (home / name).mkdir(parents=True, exist_ok=True)
    return dict({"PYTHONPATH": notebook_dir, "IPYTHONDIR": str(home / "ipython"),
                 "JUPYTER_CONFIG_DIR": str(home / "config"),
                 "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
                 "JUPYTER_DATA_DIR": str(home / "data"),
                 "JUPYTER_PATH": str(home / "data"), "JUPYTER_PLATFORM_DIRS": "1",
                 "HOME": str(home)}, **extra)


# CUDA's start, as torch's _lazy_init runs it: outofcuda's callback from the
# queue, with the device calls it makes answered by stand-ins (no GPU here).
FAKE_CUDA_START = """
import json, os, sys, weakref, torch
C = torch._C
C._cuda_getDeviceCount = lambda: 1
C._cuda_getDevice = lambda: 0
C._cuda_setMemoryFraction = lambda fraction, device: None
C._cuda_attach_out_of_memory_observer = lambda fn: None
for fn, _stack in torch.cuda._queued_calls:
    if getattr(fn, "__name__", "").startswith("outofcuda"):
        fn()
MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
           "79.10 GiB of which 1.02 GiB is free.")
refs = []


def fill(n):
    held = torch.ones(n)  # what the failed frame holds
    refs.append(weakref.ref(held))
    raise torch.cuda.OutOfMemoryError(MESSAGE)


def oc_status():
    try:
        import _outofcuda
        return _outofcuda.status()["optimizations"]["oom_handler"]["value"]
    except Exception as e:  # OUTOFCUDA_DISABLE=1: no status
        return repr(e)


def oc_frames():  # what the handler did with the failed cell's frames
    try:
        import _outofcuda
        return _outofcuda._oom_last()["cell_frames"]
    except Exception as e:
        return repr(e)
"""

STATE = """print("STATE=" + json.dumps({
    "alive": [r() is not None for r in refs],
    "last": [hasattr(sys, n) for n in ("last_type", "last_value", "last_traceback")],
    "last_is_oom": isinstance(getattr(sys, "last_value", None), torch.cuda.OutOfMemoryError),
    "kept": kept.tolist(), "status": oc_status(), "frames": oc_frames()}))"""

CELLS = [
    FAKE_CUDA_START,
    "raise ValueError('not an OOM')",
    # A cell's own variable survives its failure; the frames' locals do not.
    "kept = torch.zeros(2)\nfill(1000)",
    STATE,
    # Keeping the frames for %debug, switched on inside the running kernel.
    "%env OUTOFCUDA_OOM_KEEP_FRAMES=1",
    "fill(1000)",
    STATE + """
import outofcuda.oom  # the handler imported none of outofcuda's Python
print("REPORT=" + json.dumps(outofcuda.oom.format_report(outofcuda.last_oom())))""",
]

# The notebook's driver, in the CUDA environment's interpreter: nbclient
# starts the kernel named by the kernelspec written below.
DRIVER = """
import json, sys
import nbformat
from nbclient import NotebookClient
nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in json.load(sys.stdin)])
NotebookClient(nb, kernel_name="outofcuda-test", timeout=120, startup_timeout=120,
               allow_errors=True).execute()
print("NB=" + json.dumps([cell.outputs for cell in nb.cells]))
"""


def _run_notebook(venv, tmp_path, notebook_dir, cells, disable=False):
    env = _jupyter_env(tmp_path, notebook_dir, OUTOFCUDA_DISABLE="1" if disable else None)
    spec = Path(env["JUPYTER_DATA_DIR"]) / "kernels" / "outofcuda-test"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(venv.python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "outofcuda test (CUDA build)", "language": "python"}))
    return venv.json(DRIVER, "NB=", env=env, cwd=tmp_path, input=json.dumps(cells), timeout=300)


def _state(outputs):
    (line,) = [o["text"] for o in outputs if o.get("name") == "stdout"]
    return json.loads(line.split("STATE=", 1)[1].splitlines()[0])


def test_notebook_oom_cell_reports_and_releases_its_frames(cuda_venv, notebook_dir, tmp_path):
    mine = _run_notebook(cuda_venv, tmp_path / "mine", notebook_dir, CELLS)
    plain = _run_notebook(cuda_venv, tmp_path / "plain", notebook_dir, CELLS, disable=True)
    for outputs in (mine, plain):
        assert not [o for o in outputs[0] if o["output_type"] == "error"], outputs[0]

    # Every other exception is untouched: byte for byte as without outofcuda.
    assert mine[1] == plain[1] and mine[1][0]["ename"] == "ValueError", mine[1]

    # The OOM: IPython's traceback as without outofcuda, then the report in
    # the cell's output (stderr), the one last_oom() holds; it says what was
    # done with the cell's frames and names the variable that keeps them.
    errors = [o for o in mine[2] if o["output_type"] == "error"]
    assert errors == [o for o in plain[2] if o["output_type"] == "error"]
    assert errors[0]["ename"] == "OutOfMemoryError"
    assert [o for o in plain[2] if o["output_type"] == "stream"] == []
    report = json.loads(mine[6][-1]["text"].split("REPORT=", 1)[1])
    assert [o["output_type"] for o in mine[2]] == ["error", "stream"], mine[2]
    assert mine[5][1]["name"] == "stderr" and mine[5][1]["text"] == report + "\n\n"
    released_line = ("  cell frames        released, so %debug has no traceback "
                     "(%env OUTOFCUDA_OOM_KEEP_FRAMES=1 keeps them)")
    kept_line = ("  cell frames        kept for %debug (OUTOFCUDA_OOM_KEEP_FRAMES=1): they hold "
                 "the cell's tensors until the next error")
    assert [ln for ln in report.splitlines() if ln.startswith("  cell frames")] == [kept_line]
    assert mine[2][1]["name"] == "stderr"
    assert mine[2][1]["text"] == report.replace(kept_line, released_line) + "\n\n"

    # The failed frames' tensor is gone and so are IPython's references; the
    # cell's own variable is kept. Without outofcuda both stay.
    released, leaked = _state(mine[3]), _state(plain[3])
    assert released["status"]["ipython"] == "set", released["status"]
    assert released["frames"] == "released"
    assert released["alive"] == [False] and released["last"] == [False] * 3
    assert released["kept"] == [0.0, 0.0]
    assert leaked["alive"] == [True] and leaked["last"] == [True] * 3

    # OUTOFCUDA_OOM_KEEP_FRAMES=1 (set with %env in the running kernel): the
    # report still comes, the frames and sys.last_* stay for %debug.
    assert [o["output_type"] for o in mine[5]] == ["error", "stream"], mine[5]
    kept = _state(mine[6])
    assert kept["alive"] == [False, True] and kept["last"] == [True] * 3 and kept["last_is_oom"]
    assert kept["frames"] == "kept"


# Terminal IPython running a file: IPython runs it outside any cell
# (safe_execfile), shows the uncaught OOM with its own traceback and exits
# 1; the report follows at exit.
SCRIPT = FAKE_CUDA_START + """
print("STATUS=" + json.dumps(oc_status()), flush=True)
fill(1000)
"""


def test_ipython_script_gets_the_report_after_its_traceback(cuda_venv, notebook_dir, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    runs = {}
    for name, disable in (("mine", None), ("plain", "1")):
        env = _jupyter_env(tmp_path / name, notebook_dir, OUTOFCUDA_DISABLE=disable)
        runs[name] = cuda_venv.run(None, args=("-m", "IPython", "--colors=nocolor", str(script)),
                                   env=env, cwd=tmp_path, timeout=120)
    mine, plain = runs["mine"], runs["plain"]
    assert (mine.returncode, plain.returncode) == (1, 1), (mine.stderr, plain.stderr)
    # IPython's traceback (on stdout) is the same; the report is outofcuda's only.
    status, mine_tb = mine.stdout.split("\n", 1)
    assert mine_tb == plain.stdout.split("\n", 1)[1] and "OutOfMemoryError" in mine_tb
    assert "outofcuda" not in plain.stderr
    status = json.loads(status.split("STATUS=", 1)[1])
    assert status["ipython"] == "set", status
    assert mine.stderr.count("outofcuda: CUDA out of memory on cuda:0\n") == 1, mine.stderr


# IPython's InteractiveShell in a plain interpreter, the way a program embeds
# it (IPython.embed()): CUDA starts before any shell exists, then a shell
# appears and torch's OOM observer fires in its cell; then a shell that
# already has a custom exception handler of the user's.
EMBEDDED = FAKE_CUDA_START + """
import _outofcuda, io, contextlib
from IPython.core.interactiveshell import InteractiveShell
out = {"before": oc_status()["ipython"]}
sh = InteractiveShell.instance()
sh.push({"fill": fill, "_outofcuda": _outofcuda})
err = io.StringIO()
with contextlib.redirect_stderr(err):
    sh.run_cell("_outofcuda._oom_observer(0, 2 << 30, 0, 1 << 30)\\nfill(10)")
out.update(late=oc_status()["ipython"], late_alive=refs[-1]() is not None,
           late_report=err.getvalue().count("outofcuda: CUDA out of memory on cuda:0"))

# The program sets its own handler once outofcuda's is the shell's.
theirs = []
sh.set_custom_exc((torch.cuda.OutOfMemoryError,), lambda *a, **k: theirs.append(a[1].__name__))
err = io.StringIO()
with contextlib.redirect_stderr(err):
    sh.run_cell("fill(10)")
out.update(replaced=oc_status()["ipython"], theirs=theirs,
           replaced_report="outofcuda" in err.getvalue())

InteractiveShell.clear_instance()
sh = InteractiveShell.instance()
sh.push({"fill": fill, "_outofcuda": _outofcuda})
seen = []
def mine(shell, etype, value, tb, tb_offset=None):
    seen.append(etype.__name__)
sh.set_custom_exc((torch.cuda.OutOfMemoryError,), mine)
err = io.StringIO()
with contextlib.redirect_stderr(err):
    sh.run_cell("_outofcuda._oom_observer(0, 2 << 30, 0, 1 << 30)\\nfill(10)")
out.update(user=oc_status()["ipython"], seen=seen, user_report="outofcuda" in err.getvalue(),
           custom=[t.__name__ for t in sh.custom_exceptions])
print("EMB=" + json.dumps(out))
"""


def test_shell_started_after_cuda_and_a_users_handler(cuda_venv, notebook_dir, tmp_path):
    out = cuda_venv.json(EMBEDDED, "EMB=", env=_jupyter_env(tmp_path, notebook_dir),
                         cwd=tmp_path)
    assert out["before"] == "no_shell"
    assert out["late"] == "set" and out["late_report"] == 1 and out["late_alive"] is False
    # Replaced by the program: status() reads the shell's handler when asked.
    assert out["replaced"] == "replaced" and out["theirs"] == ["OutOfMemoryError"]
    assert out["replaced_report"] is False
    # The user's handler is the shell's one: kept, called, and no report.
    assert out["user"] == "user_handler_kept" and out["seen"] == ["OutOfMemoryError"]
    assert out["user_report"] is False and out["custom"] == ["OutOfMemoryError"]


# A Ctrl-C while the handler runs: a real SIGINT raised from C by a finaliser
# that only the handler's gc.collect() finds (no Python frame of its own, so
# the signal is pending when the collection returns, as a Ctrl-C during a long
# collection is). IPython unregisters a handler that raises anything; this one
# shows the interrupt as IPython's showtraceback shows one during its display.
INTERRUPTED = FAKE_CUDA_START + """
import _outofcuda, contextlib, ctypes, functools, gc, io, signal
from IPython.core.interactiveshell import InteractiveShell
sh = InteractiveShell.instance()
sh.push({"fill": fill})
_outofcuda._oom_observer(0, 2 << 30, 0, 1 << 30)  # gives the new shell the handler
ours = sh.CustomTB


class CtrlC:
    __del__ = staticmethod(functools.partial(getattr(ctypes.CDLL(None), "raise"),
                                             signal.SIGINT))


def cell(code):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        r = sh.run_cell(code)
    return {"out": out.getvalue(), "err": err.getvalue(),
            "error": type(r.error_in_exec).__name__ if r.error_in_exec else None}


gc.disable()  # the handler's collection is the one that finds it
c = CtrlC()
c.cycle = c
del c
res = {"first": cell("fill(10)"), "ours": sh.CustomTB is ours, "status": oc_status()["ipython"],
       "shown": sh.get_exception_only((KeyboardInterrupt, KeyboardInterrupt(), None)),
       "first_alive": refs[-1]() is not None}
res.update(second=cell("fill(10)"), second_alive=refs[-1]() is not None,
           after=cell("went_on = 1"), still_ours=sh.CustomTB is ours)
# A Ctrl-C during IPython's traceback, before the handler decides: the
# frames stay, and the report says why.
shown = sh.showtraceback


def showtraceback(*args, **kwargs):
    sh.showtraceback = shown
    shown(*args, **kwargs)
    raise KeyboardInterrupt


sh.showtraceback = showtraceback
res.update(third=cell("fill(10)"), third_alive=refs[-1]() is not None, third_frames=oc_frames())
print("INT=" + json.dumps(res))
"""


def test_ctrl_c_during_the_handler_keeps_it_registered(cuda_venv, notebook_dir, tmp_path):
    out = cuda_venv.json(INTERRUPTED, "INT=", env=_jupyter_env(tmp_path, notebook_dir),
                         cwd=tmp_path)
    first, second = out["first"], out["second"]
    report = "outofcuda: CUDA out of memory on cuda:0"
    # The cell fails with its OOM, IPython's traceback shown once; the report,
    # then the interrupt as IPython shows one that comes during its display.
    assert first["error"] == "OutOfMemoryError" and first["out"].count("OutOfMemoryError") == 2
    assert "Custom TB Handler failed" not in first["out"] + first["err"], first
    assert first["err"].count(report) == 1 and first["err"].index(report) == 0, first["err"]
    assert first["err"].endswith("\n" + out["shown"] + "\n"), first["err"]
    assert out["shown"].startswith("KeyboardInterrupt")
    assert out["first_alive"] is False  # the frames were released before the collection
    # The handler stays the shell's: the next OOM gets the report, its frames go.
    assert out["ours"] and out["still_ours"] and out["status"] == "set"
    assert second["error"] == "OutOfMemoryError" and second["err"].count(report) == 1
    assert "KeyboardInterrupt" not in second["err"] and out["second_alive"] is False
    # Nothing of the interrupt is left over for a later cell.
    assert out["after"] == {"out": "", "err": "", "error": None}
    # Interrupted before the handler decided: kept, and not said to be by the setting.
    third = out["third"]
    assert third["error"] == "OutOfMemoryError" and third["err"].count(report) == 1, third
    assert out["third_frames"] == "interrupted" and out["third_alive"] is True
    assert "OUTOFCUDA_OOM_KEEP_FRAMES" not in third["err"], third["err"]


# A generator that caught the OOM and yielded it is suspended with its frame
# in the traceback; clearing that frame would close it (before 3.13). One the
# OOM left (raised inside it) is finished: its frame is cleared.
GENERATORS = FAKE_CUDA_START + """
import _outofcuda, contextlib, io
from IPython.core.interactiveshell import InteractiveShell
sh = InteractiveShell.instance()
_outofcuda._oom_observer(0, 2 << 30, 0, 1 << 30)  # gives the new shell the handler


def paused():
    try:
        fill(10)
    except torch.cuda.OutOfMemoryError as e:
        yield e
    yield "went on"


def failing():
    held = torch.ones(10)
    refs.append(weakref.ref(held))
    yield 1
    fill(10)


sh.push({"paused": paused(), "failing": failing()})
with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
    sh.run_cell("next(failing)")
    errors = [type(sh.run_cell(c).error_in_exec).__name__
              for c in ("raise next(paused)", "next(failing)", "after = next(paused)")]
print("GEN=" + json.dumps({"errors": errors, "after": sh.user_ns.get("after"),
                           "alive": [r() is not None for r in refs],
                           "status": oc_status()["ipython"]}))
"""


def test_generator_in_the_traceback_goes_on(cuda_venv, notebook_dir, tmp_path):
    out = cuda_venv.json(GENERATORS, "GEN=", env=_jupyter_env(tmp_path, notebook_dir),
                         cwd=tmp_path)
    assert out["status"] == "set"
    assert out["errors"] == ["OutOfMemoryError", "OutOfMemoryError", "NoneType"], out
    # The suspended generator goes on, as without outofcuda.
    assert out["after"] == "went on"
    # paused's fill frame, failing's own frame and its fill frame: released.
    assert out["alive"] == [False, False, False], out
