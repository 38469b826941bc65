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
