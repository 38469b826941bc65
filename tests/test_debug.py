"""OUTOFCUDA_DEBUG=1: every error outofcuda swallows (so that nothing it does
fails the program) is printed to stderr, where and what; without it the same
run prints nothing. A stand-in of a CUDA build (tests/fake_torch.py) whose
cuDNN getter raises makes status() swallow one."""
import pytest

from fake_torch import make_fake_torch

CODE = """
import torch, _outofcuda
def broken():
    raise RuntimeError("getter exploded")
torch._C._get_cudnn_benchmark = broken
st = _outofcuda.status()["optimizations"]["cudnn_benchmark"]
print(st["now"], st["applied"])
"""


@pytest.mark.parametrize("debug", [None, "0", "1", " yes "])
def test_a_swallowed_error_leaves_a_trace_under_debug(venv, tmp_path, debug):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    r = venv.run(CODE, env={"PYTHONPATH": str(root), "OUTOFCUDA_DEBUG": debug},
                 args=("-W", "error"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "True"]   # the program still gets its answer
    if debug in ("1", " yes "):
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("outofcuda debug: ")]
        assert any(ln.startswith("outofcuda debug: report.c:") and
                   ln.endswith("RuntimeError: getter exploded") for ln in lines), r.stderr
    else:
        assert r.stderr == ""


CLOSED = """
import sys
{prepare}
f = open('out.json', 'w')  # with descriptor 2 closed, the program's file gets it
import torch, _outofcuda
def broken():
    raise RuntimeError("getter exploded")
torch._C._get_cudnn_benchmark = broken
_outofcuda.status()
import json
json.dump({{'x': 1}}, f)
f.close()
"""


@pytest.mark.parametrize("how", ["descriptor 2 closed", "sys.stderr closed", "sys.stderr None"])
def test_nothing_is_written_when_stderr_is_closed(venv, tmp_path, how):
    # the verbose table, a debug line and a warning (OUTOFCUDA_TF32=maybe under
    # -W error) all have somewhere to go but sys.stderr: they must not go there
    import subprocess
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    prepare = {"descriptor 2 closed": "", "sys.stderr closed": "sys.stderr.close()",
               "sys.stderr None": "sys.stderr = None"}[how]
    env = {"PYTHONPATH": str(root), "OUTOFCUDA_DEBUG": "1", "OUTOFCUDA_VERBOSE": "1",
           "OUTOFCUDA_TF32": "maybe", "PATH": "/usr/bin:/bin"}
    cmd = [str(venv.python), "-W", "error", "-c", CLOSED.format(prepare=prepare)]
    if how == "descriptor 2 closed":
        r = subprocess.run(["sh", "-c", 'exec "$@" 2>&-', "sh", *cmd], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    else:
        r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert (tmp_path / "out.json").read_text() == '{"x": 1}'
    assert r.stderr == "" and r.stdout == ""
