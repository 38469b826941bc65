"""Issue-3 checks on real CUDA (run on an H200 by benchmarks/gpu_check.sh): the
flags act, the fraction caps the allocator, exactly one CUDA context exists and
only on this process's device, bfloat16 is chosen on compute capability >= 8.0,
and a child forked after `import torch` can still use CUDA. Each scenario is a
fresh interpreter (the hook changes process-wide state)."""
import json
import os

import pytest

from gpu import DRY_RUN, size
from kit import last_json


def test_flags_act_without_initialising_cuda(gpu, workdir):
    d = last_json(gpu.run("""
import json, torch, _outofcuda
init_at_import = torch.cuda.is_initialized()
at_import = _outofcuda.status()
a = torch.randn(256, 256, device="cuda")
with torch.autocast("cuda"):
    y = a @ a
st = _outofcuda.status()
print(json.dumps({
    "init_at_import": init_at_import,
    "tf32": torch.backends.cuda.matmul.allow_tf32,
    "benchmark": torch.backends.cudnn.benchmark,
    "autocast_dtype": str(y.dtype),
    "cc": list(torch.cuda.get_device_capability()),
    "status": st, "at_import": at_import,
}))
""", cwd=workdir))
    assert d["init_at_import"] is False
    assert d["tf32"] is True and d["benchmark"] is True
    assert d["status"]["hook"]["error"] is None
    # TF32 waits for CUDA's start (the program may still choose its float32
    # precision by then), then applies.
    assert not d["at_import"]["optimizations"]["tf32"]["applied"], d["at_import"]
    for name in ("tf32", "cudnn_benchmark", "allocator", "memory_fraction", "amp_dtype",
                 "oom_handler"):
        assert d["status"]["optimizations"][name]["applied"], (name, d["status"])
    # SDPA's three backends are torch's defaults: nothing written.
    assert not d["status"]["optimizations"]["sdpa"]["applied"]
    expected = "torch.bfloat16" if d["cc"][0] >= 8 else "torch.float16"
    assert d["autocast_dtype"] == expected
    assert d["status"]["optimizations"]["amp_dtype"]["value"] == expected.split(".")[1]


def test_allocator_variable_reaches_torch(gpu, workdir):
    d = last_json(gpu.run("""
import json, os, torch, _outofcuda
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
segs = torch.cuda.memory._snapshot()["segments"]
value = _outofcuda.status()["optimizations"]["allocator"]["value"]
get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
print(json.dumps({"value": value, "settings": get() if get else None,
                  "expandable": [s.get("is_expandable") for s in segs],
                  "env": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}}))
""", cwd=workdir))
    # No max_split_size_mb beside expandable segments (pytorch issue 123548).
    assert d["value"] == "garbage_collection_threshold:0.8,expandable_segments:True", d
    # Handed to torch's runtime setter, the variable given back (unset here):
    # the allocator still uses the merge after the variable is gone.
    assert d["env"] == {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": None}
    assert d["settings"] in (None, d["value"])
    # outofcuda's default turns expandable segments on: torch must have used them.
    assert "expandable_segments:True" in d["value"], d
    assert d["expandable"] and all(e is True for e in d["expandable"]), d


# A fragmenting pattern: blocks from 1 GiB down to 64 MiB, each freed before
# the next. Inside expandable segments max_split_size's oversize rules keep a
# freed block of 128 MiB or more from serving a request more than
# max_non_split_rounding (20 MiB) smaller, so with max_split_size_mb beside
# expandable segments every request maps new pages (the freed block before it
# coalesces with it and grows further out of reach); without it the one
# freed block is split and reused. Live memory never exceeds 1 GiB.
FRAGMENT = """
import json, torch, _outofcuda
MiB = 1 << 20
for size in range(1024, 0, -64):
    t = torch.empty(size * MiB, dtype=torch.uint8, device="cuda")
    del t
torch.cuda.synchronize()
segs = torch.cuda.memory._snapshot()["segments"]
settings = torch.cuda.memory._snapshot().get("allocator_settings", {})
print(json.dumps({
    "reserved": torch.cuda.memory_reserved(), "peak_allocated": torch.cuda.max_memory_allocated(),
    "expandable": sorted({bool(s.get("is_expandable")) for s in segs}),
    "settings": {k: str(v) for k, v in settings.items()},
    "allocator": _outofcuda.status()["optimizations"]["allocator"]["value"]}))
"""


def test_default_allocator_reuses_freed_blocks_inside_expandable_segments(gpu, workdir):
    runs = {}
    for name, env in [("default", {}),
                      # the pre-0.3 default, the combination of pytorch issue 123548
                      ("max_split_beside_expandable", {
                          "OUTOFCUDA_ALLOC_CONF": "max_split_size_mb:128,"
                                                  "garbage_collection_threshold:0.8,"
                                                  "expandable_segments:True"})]:
        d = last_json(gpu.run(FRAGMENT, env=env, cwd=workdir))
        d["reserved_per_peak"] = d["reserved"] / d["peak_allocated"]
        runs[name] = d
    figures = os.environ.get("OUTOFCUDA_TEST_GPU_FIGURES")
    if figures:  # benchmarks/gpu_check.sh keeps the figures
        with open(os.path.join(figures, "fragment.json"), "w") as f:
            json.dump(runs, f, indent=1)
    default, bad = runs["default"], runs["max_split_beside_expandable"]
    assert default["allocator"] and "max_split_size_mb" not in default["allocator"], default
    assert default["expandable"] == [True] and bad["expandable"] == [True], runs
    # outofcuda's default keeps reserved memory near the live peak. The
    # combination is measured beside it, not asserted: on an H100 with torch
    # 2.11 (2026-12) it kept 1.02 x the peak too, where this test expected
    # more than 2 x (pytorch issue 123548).
    assert default["reserved_per_peak"] < 1.5, runs


# Memory outside torch's caching allocator (NVML's used for this process minus
# torch's reserved) after CUDA's start and after a training step of a small
# convolution network under autocast, against the headroom the default cap
# leaves (docs/what-it-changes.md, "The memory cap").
OUTSIDE = """
import json, os, torch, _outofcuda
def outside():
    torch.cuda.synchronize()
    procs = dict(map(tuple, _outofcuda.nvml_processes(_outofcuda.nvml_index(0)) or []))
    used = procs.get(os.getpid())
    return None if used is None else used - torch.cuda.memory_reserved()
torch.zeros(1, device="cuda")
at_start = outside()
n, hw = %d, %d
model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.BatchNorm2d(64),
                            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                            torch.nn.Linear(64, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(n, 3, hw, hw, device="cuda")
with torch.autocast("cuda"):
    loss = model(x).float().square().mean()
loss.backward()
opt.step()
fr = _outofcuda.status()["optimizations"]["memory_fraction"]["value"]
total = torch.cuda.mem_get_info()[1]
print(json.dumps({"at_start": at_start, "after_step": outside(), "total": total,
                  "fraction": fr and fr["fraction"],
                  "headroom": fr and fr["fraction"] and int(total * (1 - fr["fraction"]))}))
"""


def test_memory_outside_the_allocator_fits_the_default_caps_headroom(gpu, workdir):
    d = last_json(gpu.run(OUTSIDE % (size(64, 2), size(224, 8)), cwd=workdir))
    figures = os.environ.get("OUTOFCUDA_TEST_GPU_FIGURES")
    if figures:  # benchmarks/gpu_check.sh keeps the figures
        with open(os.path.join(figures, "outside.json"), "w") as f:
            json.dump(d, f, indent=1)
    if d["at_start"] is None:
        pytest.skip("NVML lists no processes here (pid namespace): nothing to measure")
    assert d["headroom"] and d["after_step"] < d["headroom"], d


# One size n for both fraction tests, fixed by the device's total memory:
# above the 0.9 cap, and below the memory free here, so the capped run can only
# fail because of the cap and the uncapped run shows the same n fits.
FRACTION_N = """
import json, torch
MARGIN = 512 << 20
free, total = torch.cuda.mem_get_info()
n = int(total * 0.9) + MARGIN
if n + MARGIN > free:
    print(json.dumps({"skip": f"no size between 0.9 * total ({total * 0.9 / 2**30:.1f} GiB) and "
                              f"free memory ({free / 2**30:.1f} GiB): other processes hold "
                              "this GPU"}))
    raise SystemExit(0)
"""


def _fraction_run(gpu, workdir, fraction, body):
    d = last_json(gpu.run(FRACTION_N + body, env={"OUTOFCUDA_MEMORY_FRACTION": fraction},
                          cwd=workdir))
    if "skip" in d:
        pytest.skip(d["skip"])
    return d


def test_fraction_caps_the_allocator(gpu, workdir):
    d = _fraction_run(gpu, workdir, "0.9", """
ok = torch.empty(int(total * 0.5), dtype=torch.uint8, device="cuda")
del ok
torch.cuda.empty_cache()
try:
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    capped = False
except torch.cuda.OutOfMemoryError:
    capped = True
print(json.dumps({"capped": capped, "n": n, "total": total}))
""")
    assert d["capped"] is True, d


def test_fraction_off_lets_the_same_allocation_through(gpu, workdir):
    d = _fraction_run(gpu, workdir, "1", """
x = torch.empty(n, dtype=torch.uint8, device="cuda")
print(json.dumps({"ok": x.numel() == n, "n": n}))
""")
    assert d["ok"] is True, d


def test_one_context_on_the_expected_device(gpu, workdir):
    """Where two GPUs exist, LOCAL_RANK=1: the fraction goes to cuda:1 and the
    only context is there (a context on cuda:0 would show outofcuda touching
    another device). With one GPU, LOCAL_RANK=0 is all there is: the check
    then only shows that one context exists, on cuda:0."""
    # The dry run's stand-in is one device: no interpreter needed to count it.
    count = 1 if DRY_RUN else int(last_json(gpu.run(
        "import json, torch; print(json.dumps(torch.cuda.device_count()))", cwd=workdir)))
    rank = 1 if count >= 2 else 0
    d = last_json(gpu.run("""
import json, os, torch, _outofcuda
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
x = torch.ones(1, device="cuda")
torch.cuda.synchronize()
seen = {}
for i in range(torch.cuda.device_count()):
    seen[i] = [p for p, _ in _outofcuda.nvml_processes(_outofcuda.nvml_index(i))]
print(json.dumps({"pid": os.getpid(), "seen": seen,
                  "device": torch.cuda.current_device(),
                  "fraction": _outofcuda.status()["optimizations"]["memory_fraction"]["value"]}))
""", env={"LOCAL_RANK": str(rank)}, cwd=workdir))
    assert d["device"] == rank
    assert d["fraction"] and d["fraction"]["device"] == rank, d
    holders = [int(i) for i, pids in d["seen"].items() if d["pid"] in pids]
    if not any(d["seen"].values()):
        pytest.skip("NVML lists no processes here (pid namespace): context count unverified")
    assert holders == [rank], d


def test_child_forked_after_import_uses_cuda(gpu, workdir):
    # Each side closes the pipe end it does not use, so a child that dies
    # without writing gives the parent end-of-file at once, and every wait is
    # bounded: a failure costs seconds, not the run's timeout.
    d = last_json(gpu.run("""
import json, os, select, time, torch
assert not torch.cuda.is_initialized()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    try:
        v = torch.ones(4, device="cuda").sum().item()
        os.write(w, str(v).encode())
    except BaseException as e:
        os.write(w, f"error: {type(e).__name__}: {e}"[:400].encode())
    finally:
        os._exit(0)
os.close(w)
ready, _, _ = select.select([r], [], [], 60)
got = os.read(r, 512).decode() if ready else "timeout: the child wrote nothing in 60 s"
end = time.monotonic() + 10
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done or time.monotonic() > end:
        break
    time.sleep(0.05)
if not done:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(json.dumps({"child": got, "exited": bool(done)}))
""", cwd=workdir, timeout=90))
    assert d["child"] == "4.0", d
    assert d["exited"] is True
