"""Known-bug checks on real CUDA (benchmarks/gpu_check.sh runs tests/gpu): the
reproduction of pytorch issue 196678 (TRL issue 7181's 12 lines) with and
without outofcuda's guard, each in a fresh process, and the attention speed of
the cuDNN and memory-efficient backends on the shapes of `outofcuda bench`
(gpt: batch 16, 16 heads of 64, sequence 1024, bfloat16), forward and backward;
the TF32 reads after CUDA starts with and without outofcuda (tf32-mixed-api),
a LOCAL_RANK=1 process's context on cuda:0 (torchrun-gpu0-context, two GPUs)
and a cuDNN convolution against the sub-library row.
What the GPU prints is in the test log (-rs lists the skips with their reason)."""
import json

import pytest

from gpu import DRY_RUN, keep, size
from kit import last_json

REPRO = """
import json, math, torch, torch.nn.functional as F, _outofcuda
torch.manual_seed(0)
L, D = 704, 64  # fails for every L % 128 == 64; 640 and 768 are clean
q = torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16) * 0.1
k = torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16) * 0.1
v = torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16)
q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(D)  # every row's logsumexp < -88.7
q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
mask = torch.ones(L, L, dtype=torch.bool, device="cuda").tril()[None, None]
out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
out.backward(torch.randn_like(out))
print(json.dumps({"nonfinite": (~torch.isfinite(q.grad)).sum().item(),
                  "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
                  "cudnn": torch.backends.cudnn.version(), "torch": torch.__version__,
                  "cc": list(torch.cuda.get_device_capability()),
                  # every attention row, by id
                  "bugs": {b["id"]: b for b in _outofcuda.status()["known_bugs"]
                           if "sdpa" in b["id"] or "attention" in b["title"]}}))
"""


@pytest.fixture(scope="module")
def repro(gpu, tmp_path_factory):
    """The reproduction with the guard and with OUTOFCUDA_KNOWN_BUGS=0, run
    once for every cuDNN-attention row's check; kept as sdpa_guard.json."""
    workdir = tmp_path_factory.mktemp("repro")
    runs = {"guarded": last_json(gpu.run(REPRO, cwd=workdir, timeout=120)),
            "bare": last_json(gpu.run(REPRO, env={"OUTOFCUDA_KNOWN_BUGS": "0"}, cwd=workdir,
                                      timeout=120))}
    keep("sdpa_guard.json", runs)
    return runs


def test_reproduction_with_and_without_the_guard(gpu, repro):
    guarded, bare = repro["guarded"], repro["bare"]
    print("guarded:", json.dumps(guarded), "\nOUTOFCUDA_KNOWN_BUGS=0:", json.dumps(bare))
    bug = guarded["bugs"]["cudnn-sdpa-nan-grad-sm90"]
    assert bare["cudnn_sdp"] is True
    assert bare["bugs"]["cudnn-sdpa-nan-grad-sm90"]["done"] is False
    # With the guard, whatever the stack: finite gradients wherever it acted.
    if bug["applies"]:
        assert bug["done"] and guarded["cudnn_sdp"] is False and guarded["nonfinite"] == 0
        # The table's claim, on the device: without the guard torch's default NaNs.
        assert bare["nonfinite"] > 0, bare
        return
    assert guarded["cudnn_sdp"] is True
    assert guarded["nonfinite"] == bare["nonfinite"]
    if bare["nonfinite"]:
        pytest.fail(f"NaN grad_q on a stack the table says is not affected: {bare}")
    pytest.skip(f"not a stack the guard is for (torch {bare['torch']}, cuDNN {bare['cudnn']}, "
                f"compute capability {bare['cc']}): {bug['reason']}")


def test_cudnn_attention_row_for_sm100(gpu, repro):
    """A place for a B200 (compute capability 10.x) cuDNN-attention row: the
    reproduction's figures there, with the row's decision, where the table
    has a row naming sm100 and the device is one."""
    bare = repro["bare"]
    rows = {k: {f: b[f] for f in ("applies", "done", "reason")}
            for k, b in repro["guarded"]["bugs"].items() if "sm100" in k + b["title"]}
    keep("sdpa_sm100.json", {"cc": bare["cc"], "rows": rows, "nonfinite": {
        k: repro[k]["nonfinite"] for k in repro}, "cudnn": bare["cudnn"], "torch": bare["torch"]})
    if bare["cc"][0] != 10 and not DRY_RUN:
        pytest.skip(f"compute capability {bare['cc'][0]}.{bare['cc'][1]}: the sm100 row is "
                    "checked on 10.x")
    if not rows:
        pytest.skip("no cuDNN-attention row names sm100 in this table")
    for k, row in rows.items():
        if row["applies"]:
            assert row["done"] and repro["guarded"]["nonfinite"] == 0, (k, repro)

SPEED = """
import json, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
B, H, L, D = SHAPE  # outofcuda bench's gpt shapes
REPEATS = 10
q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
mask = torch.ones(L, L, dtype=torch.bool, device="cuda").tril()
def step(**kw):
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    out.backward(torch.ones_like(out))
res = {}
for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                      ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                      ("flash", SDPBackend.FLASH_ATTENTION)):
    for kind, kw in (("causal", {"is_causal": True}), ("mask", {"attn_mask": mask})):
        if name == "flash" and kind == "mask":
            continue
        try:
            with sdpa_kernel([backend]):
                for _ in range(3):
                    step(**kw)
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(REPEATS):
                    step(**kw)
                b.record()
                torch.cuda.synchronize()
            res[f"{name}/{kind}"] = round(a.elapsed_time(b) / REPEATS, 3)
        except RuntimeError as e:
            res[f"{name}/{kind}"] = "unavailable: " + str(e)[:120]
print(json.dumps(res))
""".replace("SHAPE", str(size((16, 16, 1024, 64), (1, 2, 64, 16))))


def test_attention_speed_of_both_backends(gpu, workdir):
    """Forward + backward milliseconds per step (CUDA events): the price of the
    guard is cudnn/* against efficient/* (masked calls) and flash/causal."""
    res = last_json(gpu.run(SPEED, env={"OUTOFCUDA_KNOWN_BUGS": "0"}, cwd=workdir, timeout=150))
    print("sdpa fwd+bwd ms/step:", json.dumps(res))
    assert isinstance(res["efficient/mask"], float), res
    assert isinstance(res["cudnn/causal"], float) or res["cudnn/causal"].startswith("unavail")


# The TF32 mixed-API trap (row tf32-mixed-api) on the real build and device:
# the program sets TF32 through one API before CUDA starts (CHOICE), CUDA
# starts (outofcuda's TF32 step runs), then each reader of either API is
# tried; what raised is printed. Run with and without outofcuda.
TF32 = """
import json, os, torch
C = torch.backends.cuda.matmul
choice = os.environ["CHOICE"]
if choice == "legacy":
    C.allow_tf32 = False
elif choice == "new":
    C.fp32_precision = "tf32"
elif choice == "precision":
    torch.set_float32_matmul_precision("high")
torch.zeros(1, device="cuda")  # CUDA starts
raised = []
for name, read in (("allow_tf32", lambda: C.allow_tf32),
                   ("fp32_precision", lambda: C.fp32_precision),
                   ("matmul_precision", torch.get_float32_matmul_precision),
                   ("cudnn_allow_tf32", lambda: torch.backends.cudnn.allow_tf32)):
    try:
        read()
    except RuntimeError:
        raised.append(name)
print(json.dumps(raised))
"""


def test_no_tf32_read_raises_because_of_outofcuda(gpu, workdir):
    """Whichever API the program uses, the reads that raise after CUDA starts
    are the same with outofcuda as without it."""
    for choice in ("none", "legacy", "new", "precision"):
        with_oc = last_json(gpu.run(TF32, env={"CHOICE": choice}, cwd=workdir, timeout=120))
        bare = last_json(gpu.run(TF32, env={"CHOICE": choice, "OUTOFCUDA_DISABLE": "1"},
                                 cwd=workdir, timeout=120))
        print(f"tf32 reads that raised, program chose {choice}: with outofcuda {with_oc}, "
              f"without {bare}")
        assert with_oc == bare, (choice, with_oc, bare)


# Row torchrun-gpu0-context: a LOCAL_RANK=1 process that touches cuda:0 before
# set_device holds a context there, and status() names it.
GPU0 = """
import json, torch, _outofcuda
n = torch.cuda.device_count()
if n >= 2:
    torch.zeros(1, device="cuda:0")  # the rank's mistake: device 0 before set_device
    torch.cuda.set_device(1)
    torch.zeros(1, device="cuda")
(e,) = [b for b in _outofcuda.status()["known_bugs"] if b["id"] == "torchrun-gpu0-context"]
print(json.dumps({"devices": n, "applies": e["applies"], "reason": e["reason"]}))
"""


def test_a_rank_on_device_0_is_named(gpu, workdir):
    d = last_json(gpu.run(GPU0, env={"LOCAL_RANK": "1"}, cwd=workdir, timeout=120))
    print("torchrun-gpu0-context:", json.dumps(d))
    if d["devices"] < 2:
        pytest.skip(f"one GPU here ({d['reason']}): a second device is needed to see a context "
                    "on another rank's")
    assert d["applies"] is True and "cuda:0" in d["reason"], d


# Row cudnn-sublibrary-mismatch: where the table says the stack is not
# affected, a cuDNN convolution runs; where it says affected, the failure (if
# another cuDNN is on the loader path) is the one the row names.
CONV = """
import json, torch, _outofcuda
(e,) = [b for b in _outofcuda.status()["known_bugs"] if b["id"] == "cudnn-sublibrary-mismatch"]
x = torch.randn(2, 3, 16, 16, device="cuda")
w = torch.randn(4, 3, 3, 3, device="cuda")
try:
    torch.nn.functional.conv2d(x, w)
    torch.cuda.synchronize()
    error = None
except RuntimeError as exc:
    error = str(exc)[:200]
print(json.dumps({"applies": e["applies"], "reason": e["reason"], "error": error,
                  "cudnn": torch.backends.cudnn.version(), "cuda": torch.version.cuda}))
"""


def test_a_convolution_runs_where_the_sublibrary_row_does_not_apply(gpu, workdir):
    d = last_json(gpu.run(CONV, cwd=workdir, timeout=120))
    print("cudnn-sublibrary-mismatch:", json.dumps(d))
    if d["applies"] is not True:
        assert d["error"] is None, d
    elif d["error"] is not None:
        assert "SUBLIBRARY_VERSION_MISMATCH" in d["error"], d
