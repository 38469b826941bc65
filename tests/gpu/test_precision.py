"""TF32 under each float32-precision choice of a program, on real CUDA (run on
the GPU machine by benchmarks/gpu_check.sh): a program that chose nothing gets
TF32 matmuls once CUDA starts; one that chose before CUDA started computes
exactly as without outofcuda. The matmul's error against a float64 product
tells TF32 (about 1e-3 relative) from full float32 (about 1e-6)."""

import pytest

from gpu import size

N = size(2048, 128)  # the matmul's side

PROGRAM = """
import json, torch
{action}
a = torch.randn({n}, {n}, device="cuda")
b = torch.randn({n}, {n}, device="cuda")
ref = (a.double() @ b.double())
err = ((a @ b).double() - ref).abs().max().item() / ref.abs().max().item()
out = {{"err": err}}
for name, get in (("allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
                  ("fp32_precision", lambda: torch.backends.cuda.matmul.fp32_precision),
                  ("fmp", torch.get_float32_matmul_precision)):
    try:
        out[name] = get()
    except RuntimeError:
        out[name] = "raises"
print("P=" + json.dumps(out))
"""

ACTIONS = ["pass",
           "torch.backends.cuda.matmul.fp32_precision = 'ieee'",
           "torch.backends.fp32_precision = 'ieee'",
           "torch.backends.cuda.matmul.allow_tf32 = False",
           "torch.set_float32_matmul_precision('highest')",
           "torch.set_float32_matmul_precision('high')"]


def run(gpu, workdir, action, env=None):
    return gpu.json(PROGRAM.format(action=action, n=N), "P=", env=env, cwd=workdir)


def tf32(err):
    # Max error over the max of a 2048-deep product of normals: TF32 (10
    # mantissa bits) near 5e-4, full float32 near 1e-7.
    return err > 1e-5


@pytest.mark.parametrize("action", ACTIONS)
def test_tf32_matmuls_follow_the_programs_choice(gpu, workdir, action):
    with_oc = run(gpu, workdir, action)
    without = run(gpu, workdir, action, {"OUTOFCUDA_DISABLE": "1"})
    if action == "pass":
        assert tf32(with_oc["err"]) and not tf32(without["err"]), (with_oc, without)
        assert (with_oc["allow_tf32"], with_oc["fp32_precision"], with_oc["fmp"]) == \
            (True, "tf32", "high")
    else:
        assert tf32(with_oc["err"]) == tf32(without["err"]), (with_oc, without)
        assert {k: with_oc[k] for k in ("allow_tf32", "fp32_precision", "fmp")} == \
            {k: without[k] for k in ("allow_tf32", "fp32_precision", "fmp")}
