"""outofcuda.apply() where the start-up hook cannot run: ``python -S`` (no
site, so no .pth file), before and after ``import torch``, twice, and beside
the hook. A stand-in of a CUDA build (tests/fake_torch.py), since a CPU-only
build of torch keeps its own defaults (nothing readable to apply), and real
torch (a CPU build) beside the hook."""
import re

from fake_torch import make_fake_torch
from kit import last_json


def applied_count(stderr):
    """How many times the optimisations were applied: OUTOFCUDA_VERBOSE=1
    prints this line each time."""
    return len(re.findall(r"^outofcuda \S+: torch \S+ imported$", stderr, re.M))


def _no_site(venv, code, workdir, env=None):
    """`python -S`: site-packages is put on sys.path by hand, as an embedding
    application or a frozen app does; no .pth file runs."""
    prelude = (f"import sys\nassert sys.flags.no_site and 'site' not in sys.modules\n"
               f"sys.path.append({str(venv.site)!r})\n")
    return venv.check(prelude + code, args=("-S",), cwd=workdir,
                      env=dict({"OUTOFCUDA_VERBOSE": "1"}, **(env or {})))


def _cuda_stand_in(tmp_path):
    return {"PYTHONPATH": str(make_fake_torch(tmp_path / "fake", "2.14.1"))}


def test_apply_before_import_torch_without_site(venv, workdir, tmp_path):
    r = _no_site(venv, """
import json, outofcuda, _outofcuda
before = _outofcuda.status()
armed = outofcuda.apply()
again = outofcuda.apply()
import torch
after = outofcuda.status()
print(json.dumps([before["hook"], armed["hook"], again["hook"], after]))
""", workdir, env=_cuda_stand_in(tmp_path))
    before, armed, again, after = last_json(r)
    assert before == {"installed": False, "fired": False, "error": None}
    assert armed == {"installed": True, "fired": False, "error": None}
    assert again == armed
    assert after["hook"] == {"installed": True, "fired": True, "error": None}
    opts = after["optimizations"]
    assert opts["cudnn_benchmark"]["applied"] is True and opts["memory_fraction"]["queued"] is True
    assert opts["oom_handler"]["queued"] is True
    # Armed before torch loaded: the allocator string reached it in time.
    assert opts["allocator"]["applied"] is True, opts["allocator"]
    assert applied_count(r.stderr) == 1, r.stderr


def test_apply_after_import_torch_without_site(venv, workdir, tmp_path):
    r = _no_site(venv, """
import json, torch, outofcuda
untouched = outofcuda.status()["optimizations"]["cudnn_benchmark"]
benchmark_before = torch._C._get_cudnn_benchmark()
first = outofcuda.apply()
second = outofcuda.apply()
print(json.dumps([untouched, benchmark_before, torch._C._get_cudnn_benchmark(),
                  first, second, torch.cuda.is_initialized()]))
""", workdir, env=_cuda_stand_in(tmp_path))
    untouched, bench_before, bench_after, first, second, cuda_up = last_json(r)
    assert untouched["applied"] is False
    assert (untouched["state"], untouched["code"]) == ("pending", "no_hook"), untouched
    assert bench_before is False and bench_after is True
    assert first == second
    assert first["hook"] == {"installed": True, "fired": True, "error": None}
    opts = first["optimizations"]
    assert opts["cudnn_benchmark"]["applied"] is True and opts["memory_fraction"]["queued"] is True
    # Too late for the allocator variable: the report says so (the reason is
    # pinned by the next test).
    assert opts["allocator"]["applied"] is False and opts["allocator"]["code"] == "imported_early"
    assert cuda_up is False
    assert applied_count(r.stderr) == 1, r.stderr


def test_apply_sets_the_allocator_variable_before_a_cuda_torch_loads(venv, tmp_path):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    workdir = tmp_path / "work"
    workdir.mkdir()
    code = """
import json, outofcuda
{first}
import torch
{second}
print(json.dumps([torch._C.ENV_AT_LOAD, outofcuda.status()["optimizations"]["allocator"],
                  torch._alloc_conf()]))
"""
    env = {"PYTHONPATH": str(root)}
    early = last_json(_no_site(venv, code.format(first="outofcuda.apply()", second=""), workdir,
                           env))
    late = last_json(_no_site(venv, code.format(first="", second="outofcuda.apply()"), workdir,
                          env))
    env_at_load, alloc, conf = early
    assert alloc["applied"] is True
    # 2.14.1 takes it through its runtime setter: the environment stays unwritten.
    assert env_at_load["PYTORCH_ALLOC_CONF"] is None and conf == alloc["value"]
    assert "expandable_segments:True" in alloc["value"]
    env_at_load, alloc, conf = late
    assert env_at_load["PYTORCH_ALLOC_CONF"] is None
    assert alloc["applied"] is False and alloc["code"] == "imported_early"
    # The sentence names the fix (a golden text).
    assert "before torch loads" in alloc["reason"] and "apply()" in alloc["reason"]


def test_apply_beside_the_hook_changes_nothing(venv, workdir):
    r = venv.check("""
import json, outofcuda
hook_before = outofcuda.status()["hook"]
armed = outofcuda.apply()["hook"]
import torch
after_import = outofcuda.status()
again = outofcuda.apply()
print(json.dumps([hook_before, armed, after_import, again]))
""", cwd=workdir, env={"OUTOFCUDA_VERBOSE": "1"})
    hook_before, armed, after_import, again = last_json(r)
    assert hook_before == armed == {"installed": True, "fired": False, "error": None}
    assert after_import == again
    assert again["hook"] == {"installed": True, "fired": True, "error": None}
    assert applied_count(r.stderr) == 1, r.stderr


def test_apply_respects_outofcuda_disable(venv, workdir):
    r = _no_site(venv, """
import json, outofcuda, torch
st = outofcuda.apply()
print(json.dumps([st["hook"], torch.backends.cudnn.benchmark]))
""", workdir, {"OUTOFCUDA_DISABLE": "1"})
    hook, benchmark = last_json(r)
    assert hook["installed"] is False and hook["fired"] is False
    assert benchmark is False
