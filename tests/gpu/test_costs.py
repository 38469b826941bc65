"""What outofcuda's defaults cost on the device (benchmarks/gpu_check.sh runs
tests/gpu): the largest batch of `outofcuda bench`'s GPT that fits with
outofcuda, with it and its memory cap off, and without it, with the memory
outside torch's caching allocator along the way; a CUDA tensor shared with a
second process under expandable segments; and where a ResNet-50 step's time
goes under bfloat16 and float16 autocast (BatchNorm and convolution kernels,
torch.profiler). Each check writes its figures to OUTOFCUDA_TEST_GPU_FIGURES
(a JSON file, summarised by benchmarks/gpu_figures.py) before it asserts."""
import shutil
import tempfile

from gpu import DRY_RUN, keep, size
from kit import last_json

SIZE = "smoke" if DRY_RUN else "gpu"  # outofcuda.bench.SIZES
# On the CPU of a dry run one thread: two, on a machine shared with other
# work, wait on each other at every operator (a tiny step 10 to 100 x slower).
ENV = size({}, {"OMP_NUM_THREADS": "1"})


# Memory outside the caching allocator: NVML's used for this process minus
# torch's reserved; where NVML lists no processes (a pid namespace), the
# device's used memory (cudaMemGetInfo) minus reserved, which on a machine of
# one's own is the same process's.
OUTSIDE = """
import os, torch, _outofcuda
def outside():
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    i = _outofcuda.nvml_index(0)
    procs = dict(map(tuple, _outofcuda.nvml_processes(i) or [])) if i is not None else {}
    free, total = torch.cuda.mem_get_info()
    used = procs.get(os.getpid())
    return {"nvml": None if used is None else used - reserved,
            "device": total - free - reserved, "reserved": reserved}
"""

# The largest batch of bench's GPT (float32, AdamW) whose training step fits:
# doubling from START until a step runs out of memory, then bisection to one
# sample, at most MAX_PROBES steps. TF32 is set by the program in every
# configuration, for speed only (memory is the same either way). The cache is
# emptied after each probe so each starts as a fresh process would.
LARGEST = OUTSIDE + """
import json, time
from outofcuda.bench import SIZES, _build
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
OOM = torch.cuda.OutOfMemoryError
START, LIMIT, MAX_PROBES = %d, %d, 14
torch.zeros(1, device="cuda")
at_start = outside()
model, (x, y), loss_fn, _ = _build(torch, "gpt", SIZES["%s"], torch.device("cuda"))
model = model.cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

def step(b):
    opt.zero_grad(set_to_none=True)
    loss_fn(model(x[:1].expand(b, -1)), y[:1].expand(b, -1)).backward()
    opt.step()

step(1)
after_step = outside()
probes = []

def fits(b):
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        step(b)
        torch.cuda.synchronize()
        ok = True
    except OOM:
        ok = False
    opt.zero_grad(set_to_none=True)
    probes.append([b, ok, round(time.perf_counter() - t0, 2), torch.cuda.max_memory_allocated()])
    torch.cuda.empty_cache()
    return ok

lo, hi, b = 1, None, START
while b <= LIMIT and len(probes) < MAX_PROBES:
    if not fits(b):
        hi = b
        break
    lo, b = b, b * 2
while hi is not None and hi - lo > 1 and len(probes) < MAX_PROBES:
    mid = (lo + hi) // 2
    if fits(mid):
        lo = mid
    else:
        hi = mid
fr = _outofcuda.status()["optimizations"]["memory_fraction"]["value"]
print("LARGEST=" + json.dumps({
    "largest": lo, "first_failing": hi, "bounded_by_limit": hi is None, "probes": probes,
    "outside": {"at_start": at_start, "after_step": after_step, "after_search": outside()},
    "fraction": fr and fr["fraction"], "total": torch.cuda.mem_get_info()[1],
    "allocator": _outofcuda.status()["optimizations"]["allocator"]["value"]}))
""" % (size(8, 2), size(4096, 4), SIZE)

LARGEST_CONFIGS = {"outofcuda": {}, "outofcuda_no_cap": {"OUTOFCUDA_MEMORY_FRACTION": "1.0"},
                   "without": {"OUTOFCUDA_DISABLE": "1"}}


def test_largest_batch_with_and_without_outofcuda(gpu, workdir):
    # The dry run proves the scenario once; the configurations differ only
    # by their environment.
    configs = size(list(LARGEST_CONFIGS), ["outofcuda"])
    runs = {c: last_json(gpu.run(LARGEST, env=dict(ENV, **LARGEST_CONFIGS[c]), cwd=workdir,
                                 timeout=150),
                         "LARGEST=") for c in configs}
    keep("largest_batch.json", runs)
    for name, d in runs.items():
        assert d["probes"] and not d["bounded_by_limit"], (name, d)
    if "without" in runs:
        # outofcuda's allocator, its cap aside, fits torch's batch (within
        # one sample, about 1.25 GiB here: an edge a run may land either side of).
        assert runs["outofcuda_no_cap"]["largest"] >= runs["without"]["largest"] - 1, runs
    mine = runs["outofcuda"]
    if mine["fraction"]:
        # The cap's headroom holds what lives outside the allocator after
        # the largest step that fits.
        out = mine["outside"]["after_search"]
        outside = out["nvml"] if out["nvml"] is not None else out["device"]
        assert outside < mine["total"] * (1 - mine["fraction"]), mine


# A tensor made on the GPU after a child was forked (CUDA starts in each
# process on its own), sent to the child through torch.multiprocessing (a
# CUDA IPC handle), changed there in place and read back here.
IPC = """
import json, os, queue, torch, _outofcuda
import torch.multiprocessing as mp
N = %d


def child(inbox, outbox):
    try:
        x = inbox.get(timeout=60)
        x.add_(1)
        torch.cuda.synchronize()
        outbox.put(["ok", x.sum().item()])
        inbox.get(timeout=60)  # the parent's memory stays mapped until it has read
    except BaseException as e:
        outbox.put(["error", f"{type(e).__name__}: {e}"[:400]])


if __name__ == "__main__":
    ctx = mp.get_context("fork")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(inbox, outbox))
    p.start()
    x = torch.zeros(N, device="cuda")
    segs = torch.cuda.memory._snapshot()["segments"]
    inbox.put(x)
    try:
        kind, value = outbox.get(timeout=90)
    except queue.Empty:
        kind, value = "timeout", "the child answered nothing in 90 s"
    torch.cuda.synchronize()
    seen = x.sum().item()
    inbox.put(None)
    p.join(30)
    if p.is_alive():
        p.kill()
        p.join()
    print("IPC=" + json.dumps({
        "child": kind, "value": value, "parent_sees": seen, "n": N, "exitcode": p.exitcode,
        "expandable": sorted({bool(s.get("is_expandable")) for s in segs}),
        "allocator": _outofcuda.status()["optimizations"]["allocator"]["value"]}))
""" % size(64 << 20, 1024)


def test_a_cuda_tensor_shared_with_another_process_under_expandable_segments(gpu, workdir):
    script = workdir / "ipc_check.py"
    script.write_text(IPC)
    configs = size({"outofcuda": {}, "without": {"OUTOFCUDA_DISABLE": "1"}},
                   {"outofcuda": {}})
    # A short TMPDIR of its own: torch.multiprocessing passes the storage
    # through a Unix socket made there, whose path may not pass 107 bytes.
    short = tempfile.mkdtemp(prefix="oc-ipc-", dir="/tmp")
    try:
        runs = {c: last_json(gpu.run(None, args=[str(script)], cwd=workdir, timeout=150,
                                     env=dict(ENV, TMPDIR=short, **env)), "IPC=")
                for c, env in configs.items()}
    finally:
        shutil.rmtree(short, ignore_errors=True)
    keep("ipc.json", runs)
    mine = runs["outofcuda"]
    # The check means something only where outofcuda's default turned
    # expandable segments on.
    assert mine["expandable"] == [True], mine
    works = {c: d["child"] == "ok" and d["value"] == d["n"] == d["parent_sees"]
             for c, d in runs.items()}
    assert works["outofcuda"], runs


VARIANTS = [(t, f) for t in ("bfloat16", "float16") for f in ("nchw", "channels_last")]
# bench's ResNet-50 shape (NCHW as bench runs it, and channels_last), a
# forward and backward pass under autocast in each dtype: milliseconds per
# step (CUDA events, before profiling) and the profiler's kernels, grouped.
KERNELS = OUTSIDE + """
import json
from torch.profiler import ProfilerActivity, profile, supported_activities
from outofcuda.bench import SIZES, _build
STEPS, WARMUP, VARIANTS = %d, %d, %r
GROUPS = {"batchnorm": ("batch_norm", "batchnorm", "bn_fw", "bn_bw"),
          "layout": ("nchwtonhwc", "nhwctonchw", "transpose"),
          "convolution": ("conv", "xmma", "implicit_gemm", "fprop", "dgrad", "wgrad")}
SIZE = dict(SIZES["%s"])
SIZE["cnn"] = dict(SIZE["cnn"], **%r)
model, (x, y), loss_fn, _ = _build(torch, "cnn", SIZE, torch.device("cuda"))
model = model.cuda()
acts = [a for a in (ProfilerActivity.CPU, ProfilerActivity.CUDA) if a in supported_activities()]


def group(name):
    low = name.lower()
    return next((g for g, keys in GROUPS.items() if any(k in low for k in keys)), "other")


def step(dtype, inp):
    with torch.autocast("cuda", dtype=dtype):
        loss = loss_fn(model(inp), y)
    loss.backward()
    model.zero_grad(set_to_none=True)


res = {}
for dtype_name, layout in VARIANTS:
    dtype = getattr(torch, dtype_name)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    model.to(memory_format=fmt)
    inp = x.contiguous(memory_format=fmt)
    for _ in range(WARMUP):  # cudnn.benchmark chooses its algorithms here
        step(dtype, inp)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(STEPS):
        step(dtype, inp)
    b.record()
    torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(STEPS):
            step(dtype, inp)
        torch.cuda.synchronize()
    events = prof.key_averages()
    # Kernels only: a CPU operator's device time repeats its kernels'.
    rows = [(e.key, e.count, e.self_device_time_total) for e in events
            if str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
    timer = "device" if rows else "cpu"
    rows = rows or [(e.key, e.count, e.self_cpu_time_total) for e in events
                    if e.key.startswith("aten::")]
    rows.sort(key=lambda r: -r[2])
    groups = {}
    for name, _, us in rows:
        groups[group(name)] = groups.get(group(name), 0) + us / STEPS
    # Kernel names only: CPU operators (the dry run's) name no backend.
    bn = [name for name, _, _ in rows if group(name) == "batchnorm" and timer == "device"]
    res[f"{dtype_name}/{layout}"] = {
        "ms_per_step": a.elapsed_time(b) / STEPS, "timer": timer,
        "us_per_step": {g: round(v, 1) for g, v in groups.items()},
        # ATen's kernels are at::native's; any other BatchNorm kernel is cuDNN's.
        "batchnorm_by_cudnn": any("at::native" not in n for n in bn),
        "batchnorm_by_aten": any("at::native" in n for n in bn),
        "top": [[name[:140], count, round(us / STEPS, 1)] for name, count, us in rows[:12]]}
print("KERNELS=" + json.dumps({"variants": res, "outside_after": outside(),
                               "benchmark": torch.backends.cudnn.benchmark}))
""" % (size(3, 1), size(2, 0), size(VARIANTS, VARIANTS[::3]), SIZE,
       size({}, {"batch": 2, "image": 16}))


def test_where_the_cnn_step_goes_under_bfloat16_and_float16(gpu, workdir):
    """docs/measurements.md's cnn_autocast (0.82x: bfloat16 against float16,
    eager NCHW): torch sends float16 BatchNorm with float32 weights to cuDNN
    and bfloat16 BatchNorm to its own kernels (_select_batch_norm_backend)."""
    d = last_json(gpu.run(KERNELS, env=ENV, cwd=workdir, timeout=240), "KERNELS=")
    keep("autocast_kernels.json", d)
    v = d["variants"]
    assert set(v) == {f"{t}/{f}" for t, f in VARIANTS}, v
    assert v["bfloat16/nchw"]["timer"] == "device", v["bfloat16/nchw"]
    assert v["bfloat16/nchw"]["batchnorm_by_aten"], v["bfloat16/nchw"]["top"]
    assert v["float16/nchw"]["batchnorm_by_cudnn"], v["float16/nchw"]["top"]
