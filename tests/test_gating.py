"""Release gating: the hook against stand-ins of CUDA builds of torch 2.0 ...
newest (tests/fake_torch.py holds the table of names, keys and warnings per
release). Each run is `python -W error`, so any deprecated or warning call fails."""
import json

import pytest

from fake_torch import RELEASES, make_fake_torch

REPORT = """
import json, os, torch, _outofcuda
torch.cuda._fake_cuda_init()
print('REPORT=' + json.dumps({
    'calls': [list(map(str, c)) for c in torch._C.calls],
    'env_at_load': torch._C.ENV_AT_LOAD,
    'conf_read': torch._alloc_conf(),
    'status': _outofcuda.status(),
}))
"""


def run_release(venv, tmp_path, release, env=None, cuda=True, code=REPORT):
    root = make_fake_torch(tmp_path / "fake", release, cuda=cuda)
    full_env = {"PYTHONPATH": str(root)}
    full_env.update(env or {})
    r = venv.run(code, env=full_env, args=("-W", "error"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT=")][-1]
    return json.loads(line[len("REPORT="):]), r


def names(report):
    return [c[0] for c in report["calls"]]


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_every_release_applies_without_warning(venv, tmp_path, release):
    rep, r = run_release(venv, tmp_path, release, env={"OUTOFCUDA_AMP_DTYPE": "bfloat16",
                                                       "LOCAL_RANK": "2"})
    assert r.stderr == ""
    st = rep["status"]
    assert st["hook"]["error"] is None
    opts = st["optimizations"]
    called = names(rep)
    # TF32 through the legacy setter, never only the new API.
    assert ["_set_cublas_allow_tf32", "True"] in rep["calls"]
    assert opts["tf32"]["applied"]
    assert ["_set_cudnn_benchmark", "True"] in rep["calls"]
    for fn in ("_set_sdp_use_flash", "_set_sdp_use_mem_efficient", "_set_sdp_use_math"):
        assert [fn, "True"] in rep["calls"]
    assert "_set_sdp_use_cudnn" not in called          # cuDNN attention left alone
    # Autocast dtype through the release's own API.
    if RELEASES[release]["autocast_new"]:
        assert ["set_autocast_dtype", "cuda", "torch.bfloat16"] in rep["calls"]
        assert "set_autocast_gpu_dtype" not in called
    else:
        assert ["set_autocast_gpu_dtype", "torch.bfloat16"] in rep["calls"]
    # Memory fraction: queued, applied at CUDA init to LOCAL_RANK's device only.
    fractions = [c for c in rep["calls"] if c[0] == "_cuda_setMemoryFraction"]
    assert fractions == [["_cuda_setMemoryFraction", "0.95", "2"]]
    assert opts["memory_fraction"]["value"] == {"fraction": 0.95, "device": 2}
    # Allocator: set before torch loaded, in the variable this release reads,
    # with only keys it accepts.
    conf = rep["conf_read"]
    assert opts["allocator"]["applied"] and conf == opts["allocator"]["value"]
    keys = {item.split(":")[0] for item in conf.split(",")}
    assert keys <= RELEASES[release]["keys"]
    assert "max_split_size_mb" in keys and "garbage_collection_threshold" in keys
    assert ("expandable_segments" in keys) == ("expandable_segments" in RELEASES[release]["keys"])


def test_cudnn_tf32_setter_skipped_on_2_9_0_only(venv, tmp_path):
    rep, _ = run_release(venv, tmp_path, "2.9.0")
    assert "_set_cudnn_allow_tf32" not in names(rep)
    rep, _ = run_release(venv, tmp_path / "b", "2.9.1")
    assert ["_set_cudnn_allow_tf32", "True"] in rep["calls"]


@pytest.mark.parametrize("release,var", [("2.4.0", "PYTORCH_CUDA_ALLOC_CONF"),
                                         ("2.11.0", "PYTORCH_ALLOC_CONF"),
                                         ("2.14.1", "PYTORCH_CUDA_ALLOC_CONF")])
def test_user_allocator_keys_win(venv, tmp_path, release, var):
    user = "max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2,>:4]"
    rep, _ = run_release(venv, tmp_path, release, env={var: user})
    conf = rep["conf_read"]
    assert conf.startswith(user)                       # the user's keys, untouched
    assert conf.count("max_split_size_mb") == 1
    assert "garbage_collection_threshold:0.8" in conf  # outofcuda's default fills the gap
    assert rep["env_at_load"][var] == conf
    assert "user's keys kept" in rep["status"]["optimizations"]["allocator"]["reason"]


def test_unknown_keys_are_left_out_and_named(venv, tmp_path):
    rep, _ = run_release(venv, tmp_path, "2.4.0",
                         env={"OUTOFCUDA_ALLOC_CONF": "per_process_memory_fraction:0.5,backend:native"})
    assert rep["conf_read"] == "backend:native"
    assert "per_process_memory_fraction" in rep["status"]["optimizations"]["allocator"]["reason"]


def test_malformed_user_variable_is_left_whole(venv, tmp_path):
    rep, _ = run_release(venv, tmp_path, "2.4.0", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments"},
                         code=REPORT.replace("import json, os, torch", "import json, os\ntry:\n import torch\nexcept RuntimeError: raise SystemExit(3)\nimport torch"))
    assert rep["env_at_load"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments"
    assert not rep["status"]["optimizations"]["allocator"]["applied"]
    assert "not understood" in rep["status"]["optimizations"]["allocator"]["reason"]


def test_cpu_build_changes_no_cuda_state(venv, tmp_path):
    rep, _ = run_release(venv, tmp_path, "2.14.1", cuda=False)
    called = names(rep)
    assert "_cuda_setMemoryFraction" not in called and "set_autocast_dtype" not in called
    assert rep["env_at_load"] == {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_HIP_ALLOC_CONF": None,
                                  "PYTORCH_ALLOC_CONF": None}


def test_frozen_flags_and_tf32_override_are_respected(venv, tmp_path):
    rep, _ = run_release(venv, tmp_path, "2.14.1", env={"NVIDIA_TF32_OVERRIDE": "0"})
    assert "_set_cublas_allow_tf32" not in names(rep)
    assert "NVIDIA_TF32_OVERRIDE" in rep["status"]["optimizations"]["tf32"]["reason"]


def test_a_failing_setter_is_one_warning_and_torch_still_imports(venv, tmp_path):
    code = """
import torch._C as C
def broken(flag):
    raise RuntimeError("cudnn setter exploded")
C._set_cudnn_benchmark = broken
""" 
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    # Make the setter fail inside the real import: patch _C before torch/__init__ finishes.
    init = root / "torch" / "__init__.py"
    init.write_text(init.read_text().replace("from torch import _C\n", "from torch import _C\n" + code.replace("import torch._C as C\n", "C = _C\n")))
    r = venv.run("import torch, json, _outofcuda\nprint('ok', json.dumps(_outofcuda.status()['hook']))",
                 env={"PYTHONPATH": str(root)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok")
    hook = json.loads(r.stdout.split("ok ", 1)[1])
    assert "cudnn setter exploded" in hook["error"]
    assert r.stderr.count("UserWarning") == 1 and "cudnn setter exploded" in r.stderr
