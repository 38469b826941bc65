"""What outofcuda gains: training workloads under three configurations.

Each workload runs in fresh processes (the hook changes process-wide state)
in three configurations:
  defaults   torch as it comes (OUTOFCUDA_DISABLE=1);
  outofcuda  the zero-code hook, plus outofcuda.autocast_context() /
             outofcuda.compile_model() where the workload says so;
  expert     OUTOFCUDA_DISABLE=1 and flags set by hand in this script (TF32,
             cudnn.benchmark, bfloat16 autocast, channels_last for CNNs,
             expandable_segments).
It reports steps/s, samples/s, peak memory (max_memory_allocated and NVML),
achieved TFLOP/s (FLOPs counted by torch.utils.flop_counter over one step)
and the fraction of the device's dense peak for the precision in use.

On a machine without a GPU (or with --smoke) it runs tiny sizes as a smoke
test (under a minute) that checks each workload runs: it shows times only,
no ratios and no GPU columns, and says that this run measured no GPU gains. A
"vs defaults" ratio is given only where both rows are medians of at least
MIN_REPEATS_FOR_RATIO repeats. Progress goes to stderr, a line per workload
run; the table printed keeps to 80 columns (gain.md holds every column).

It ships in the package so that any installed copy can run it. Example::

    outofcuda bench --out bench-results              # GPU: full sizes
    outofcuda bench --smoke --out /tmp/smoke          # anywhere, tiny
    python -m outofcuda.bench --smoke --json          # the same, without the CLI
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

CONFIGS = ("defaults", "outofcuda", "expert")
WORKLOADS = {
    "gpt_fp32": {"kind": "gpt", "amp": False, "compile_model": False},
    "gpt_autocast": {"kind": "gpt", "amp": True, "compile_model": False},
    "cnn_fp32": {"kind": "cnn", "amp": False, "compile_model": False},
    "cnn_autocast": {"kind": "cnn", "amp": True, "compile_model": False},
    "cnn_fp32_compile_model": {"kind": "cnn", "amp": False, "compile_model": True},
    "cnn_autocast_compile_model": {"kind": "cnn", "amp": True, "compile_model": True},
    "mlp": {"kind": "mlp", "amp": False, "compile_model": False},
}
# Sizes: "gpu" makes one measurement take seconds on an H100/H200; "smoke"
# only proves the code runs.
SIZES = {
    "gpu": {"gpt": dict(batch=16, seq=1024, d=1024, heads=16, layers=12, vocab=32768),
            "cnn": dict(batch=128, image=224, base=64, blocks=(3, 4, 6, 3)),
            "mlp": dict(batch=8192, d=8192, layers=4),
            "warmup": 3, "steps": 5, "repeats": 3},
    "smoke": {"gpt": dict(batch=2, seq=32, d=32, heads=2, layers=1, vocab=128),
              "cnn": dict(batch=2, image=32, base=4, blocks=(1, 1, 1, 1)),
              "mlp": dict(batch=16, d=64, layers=2),
              "warmup": 1, "steps": 1, "repeats": 1},
}
# Dense peak TFLOP/s by precision (vendor data sheets, SXM parts).
PEAKS = {
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H100": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
}
MARK = "@@GAIN@@"
# The one GPU run so far (docs/measurements.md, "GPU gains").
MEASURED_RUN = ("GPU gains were measured once, on an H100 (torch 2.11.0+cu130, commit "
                "2f7a4db): docs/measurements.md, \"GPU gains\".")
SMOKE_NOTE = ("smoke: checks that each workload runs (tiny sizes, one step); the times "
              "say nothing of outofcuda's gains.")
WIDTH = 80  # the printed output's columns (docs/command-line.md)
# A ratio of two medians means something only with a few repeats behind each.
MIN_REPEATS_FOR_RATIO = 3
# Each worker is a fresh interpreter that runs this module's main(). The
# entry `-c` puts first on sys.path (the working directory) is dropped so a
# stray torch.py there cannot stand in for the installed one.
_WORKER_BOOT = (
    "import sys\n"
    "sys.path[:] = [p for p in sys.path if p != '']\n"
    "from outofcuda.bench import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


# ------------------------------------------------------------------ worker


def _models(torch):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads) \
                .permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, vocab, seq, d, heads, layers):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            cout = mid * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid),
                nn.ReLU(inplace=True), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    class ResNet(nn.Module):
        """ResNet-50's shape (bottlenecks 3-4-6-3) in plain torch."""

        def __init__(self, base, blocks, classes=1000):
            super().__init__()
            layers = [nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base),
                      nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
            cin = base
            for i, n in enumerate(blocks):
                mid = base * 2 ** i
                for j in range(n):
                    layers.append(Bottleneck(cin, mid, 2 if j == 0 and i > 0 else 1))
                    cin = mid * 4
            self.features = nn.Sequential(*layers)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x):
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))

    def mlp(d, layers):
        mods = []
        for _ in range(layers):
            mods += [nn.Linear(d, d), nn.ReLU()]
        return nn.Sequential(*mods)

    return GPT, ResNet, mlp


def _build(torch, kind, size, device):
    """(model, make_batch() -> (input, target), loss_fn, samples per step)."""
    GPT, ResNet, mlp = _models(torch)
    F = torch.nn.functional
    if kind == "gpt":
        s = size["gpt"]
        model = GPT(s["vocab"], s["seq"], s["d"], s["heads"], s["layers"])
        x = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device)
        y = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device)
        return model, (x, y), lambda out, t: F.cross_entropy(out.flatten(0, 1).float(),
                                                            t.flatten()), s["batch"] * s["seq"]
    if kind == "cnn":
        s = size["cnn"]
        model = ResNet(s["base"], s["blocks"])
        x = torch.randn(s["batch"], 3, s["image"], s["image"], device=device)
        y = torch.randint(0, 1000, (s["batch"],), device=device)
        return model, (x, y), lambda out, t: F.cross_entropy(out.float(), t), s["batch"]
    s = size["mlp"]
    model = mlp(s["d"], s["layers"])
    x = torch.randn(s["batch"], s["d"], device=device)
    return model, (x, torch.randn_like(x)), lambda out, t: F.mse_loss(out.float(), t), s["batch"]


def _amp_context(torch, config, device, notes):
    if config == "expert":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    if config == "outofcuda":
        try:
            import outofcuda

            return outofcuda.autocast_context
        except (ImportError, AttributeError) as e:
            notes.append(f"autocast_context unavailable ({e}); used torch.autocast")
    return lambda: torch.autocast(device.type)


def _precision(torch, amp_dtype, device):
    if amp_dtype is not None:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp_dtype, str(amp_dtype))
    # TF32 is a CUDA matmul mode: the flag says nothing about CPU matmuls.
    cuda = device.type == "cuda"
    return "tf32" if cuda and torch.backends.cuda.matmul.allow_tf32 else "fp32"


def _nvml_used(device):
    """Bytes NVML reports for this process on the device, or None."""
    if device.type != "cuda" or os.environ.get("CUDA_VISIBLE_DEVICES"):
        return None  # NVML indices differ from torch's under CUDA_VISIBLE_DEVICES
    try:
        import _outofcuda

        for pid, used in _outofcuda.nvml_processes(device.index or 0):
            if pid == os.getpid():
                return used
    except (ImportError, AttributeError):
        pass
    return None


def run_workload(torch, name, config, size, device, notes):
    spec = WORKLOADS[name]
    model, (x, y), loss_fn, samples = _build(torch, spec["kind"], size, device)
    model = model.to(device)
    wl_notes = list(notes)
    channels_last = spec["kind"] == "cnn" and config == "expert"
    if spec["compile_model"] and config == "outofcuda":
        try:
            import outofcuda

            model = outofcuda.compile_model(model)
            channels_last = spec["kind"] == "cnn"
        except (ImportError, AttributeError) as e:
            wl_notes.append(f"compile_model unavailable ({e})")
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp_dtype = None
    ctx = None
    if spec["amp"]:
        ctx = _amp_context(torch, config, device, wl_notes)
        with ctx():
            amp_dtype = torch.get_autocast_dtype(device.type) if hasattr(
                torch, "get_autocast_dtype") else None
    scaler = torch.amp.GradScaler(device.type) if (
        amp_dtype == torch.float16 and device.type == "cuda") else None

    def step():
        opt.zero_grad(set_to_none=True)
        if ctx is not None:
            with ctx():
                loss = loss_fn(model(x), y)
        else:
            loss = loss_fn(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(size["warmup"]):
        step()
    flops = None
    try:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            step()
        flops = counter.get_total_flops()
    except Exception as e:  # the counter is optional: report without TFLOP/s
        wl_notes.append(f"FLOP counter failed: {type(e).__name__}: {e}")
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rates = []
    for _ in range(size["repeats"]):
        sync()
        t0 = time.perf_counter()
        for _ in range(size["steps"]):
            step()
        sync()
        rates.append(size["steps"] / (time.perf_counter() - t0))
    sps = statistics.median(rates)
    precision = _precision(torch, amp_dtype, device)
    tflops = flops * sps / 1e12 if flops else None
    peak = None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        table = next((v for k, v in PEAKS.items() if k in gpu), None)
        if table and tflops is not None and precision in table:
            peak = tflops / table[precision]
    return {
        "workload": name, "config": config, "steps_per_s": sps, "samples_per_s": sps * samples,
        "rates": rates, "flops_per_step": flops, "tflops": tflops, "fraction_of_peak": peak,
        "precision": precision,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device)
        if device.type == "cuda" else None,
        "nvml_used_bytes": _nvml_used(device), "notes": wl_notes,
    }


def _expert_env():
    """The allocator variable an expert would set, chosen by torch release
    (read from metadata: torch is not imported yet)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(p) for p in version("torch").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return
    var = "PYTORCH_ALLOC_CONF" if (major, minor) >= (2, 10) else "PYTORCH_CUDA_ALLOC_CONF"
    os.environ.setdefault(var, "expandable_segments:True")


def worker(config, size_name, names):
    if config == "expert":
        _expert_env()
    import torch

    notes = []
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    hook = None
    try:
        import _outofcuda

        hook = _outofcuda.status()["hook"]
    except ImportError:
        notes.append("outofcuda's extension is not importable")
    if config == "outofcuda" and not (hook or {}).get("fired"):
        notes.append("the outofcuda hook did not fire: this row equals torch defaults")
    if config == "expert":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    size = SIZES[size_name]
    for name in names:
        try:
            res = run_workload(torch, name, config, size, device, notes)
        except Exception as e:  # one failing workload must not hide the others
            res = {"workload": name, "config": config, "error": f"{type(e).__name__}: {e}"}
        res["hook_fired"] = bool((hook or {}).get("fired"))
        res["device"] = str(device)
        res["cuda"] = getattr(torch.version, "cuda", None)
        sys.stdout.write(MARK + json.dumps(res) + "\n")
        sys.stdout.flush()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------ parent


def _env_for(config):
    env = dict(os.environ)
    if config == "outofcuda":
        env.pop("OUTOFCUDA_DISABLE", None)
    else:
        env["OUTOFCUDA_DISABLE"] = "1"
    return env


def _spawn(config, size, names, timeout, progress=None):
    """Runs one worker; progress(row) is called as each workload's row
    arrives (the worker prints one when it finishes a workload)."""
    cmd = [sys.executable, "-c", _WORKER_BOOT, "--worker", config, "--size", size,
           "--workloads", ",".join(names)]
    rows, killed = [], []

    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=_env_for(config), stdout=subprocess.PIPE, stderr=err,
                                text=True)

        def kill():
            killed.append(True)
            proc.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith(MARK):
                    rows.append(json.loads(line[len(MARK):]))
                    if progress:
                        progress(rows[-1])
            rc = proc.wait()  # the timer still stands behind this wait
        except BaseException:  # Ctrl-C or a bad line: the worker goes too
            proc.kill()
            raise
        finally:
            timer.cancel()
            proc.stdout.close()
            proc.wait()
        err.seek(0)
        message = f"timed out after {timeout} s" if killed else err.read().strip()[-600:]
    done = {r["workload"] for r in rows}
    for n in names:
        if n not in done:
            rows.append({"workload": n, "config": config,
                         "error": f"worker exited {rc}: {message}"})
            if progress:
                progress(rows[-1])
    return rows


def _environment():
    """GPU (NVML), torch and CUDA versions, without importing torch here."""
    info = {"gpus": [], "nvml_error": None, "torch": None, "cuda": None}
    try:
        import _outofcuda

        info["gpus"], info["nvml_error"] = _outofcuda.nvml_devices()
    except ImportError as e:
        info["nvml_error"] = f"outofcuda extension not importable: {e}"
    from importlib.metadata import PackageNotFoundError, version

    try:
        info["torch"] = version("torch")
    except PackageNotFoundError:
        pass
    return info


def _ratios(rows):
    """steps/s relative to the defaults row of the same workload, or None
    where either row has fewer than MIN_REPEATS_FOR_RATIO repeats (or failed)."""
    def measured(r):
        return r is not None and r.get("steps_per_s") and \
            len(r.get("rates") or ()) >= MIN_REPEATS_FOR_RATIO

    base = {r["workload"]: r for r in rows if r["config"] == "defaults"}
    for r in rows:
        b = base.get(r["workload"])
        r["speedup_vs_defaults"] = (r["steps_per_s"] / b["steps_per_s"]
                                    if measured(r) and measured(b) else None)


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _no_gains(result):
    """Why this run measured no GPU gains, or None where it did."""
    if result["gpu_gains_measured"]:
        return None
    if result["mode"] == "gpu":
        return "some workloads failed"
    return "smoke sizes" + ("" if result["gpu"] else ", no GPU here")


def _ms(r):
    return 1000 / r["steps_per_s"] if r.get("steps_per_s") else None


def markdown(result):
    """gain.md: every column a GPU run measures; under smoke sizes the times
    only (ratios and GPU columns would be noise or empty there)."""
    lines = [f"# outofcuda gain benchmark ({result['mode']})", "",
             f"{result['date']} · GPU: {result['gpu'] or 'none'} · torch {result['torch']} · "
             f"CUDA {result['cuda'] or '-'}", ""]
    why = _no_gains(result)
    if why:
        lines += [f"**This run measured no GPU gains** ({why}). {MEASURED_RUN}", ""]
    if result["mode"] != "gpu":
        lines += [SMOKE_NOTE, "", "| workload | config | ms/step |", "|---|---|---:|"]
        lines += [f"| {r['workload']} | {r['config']} | "
                  + (f"error: {r['error'][:80]} |" if "error" in r else f"{_ms(r):.1f} |")
                  for r in result["rows"]]
        return "\n".join(lines) + "\n"
    ratios = any(r.get("speedup_vs_defaults") is not None for r in result["rows"])
    if not ratios:
        lines += [f"No \"vs defaults\" ratios: a ratio needs {MIN_REPEATS_FOR_RATIO} repeats "
                  f"per row (these rows have {result['sizes']['repeats']} repeat(s) of "
                  f"{result['sizes']['steps']} step(s)); with so few it is noise.", ""]
    ratio_head, ratio_rule = (" vs defaults |", "---:|") if ratios else ("", "")
    lines += [f"| workload | config | steps/s | samples/s |{ratio_head} peak alloc MiB | "
              "NVML MiB | TFLOP/s | % of peak | precision |",
              f"|---|---|---:|---:|{ratio_rule}---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['config']} | error: {r['error'][:80]} "
                         "| | | | | | |" + (" |" if ratios else ""))
            continue
        mib = lambda b: None if b is None else b / 2**20  # noqa: E731
        frac = None if r["fraction_of_peak"] is None else 100 * r["fraction_of_peak"]
        ratio = r["speedup_vs_defaults"]
        ratio_cell = (" -- |" if ratio is None else f" {ratio:.2f}x |") if ratios else ""
        lines.append(
            f"| {r['workload']} | {r['config']} | {_fmt(r['steps_per_s'], '.3f')} | "
            f"{_fmt(r['samples_per_s'], ',.0f')} |{ratio_cell} "
            f"{_fmt(mib(r['peak_allocated_bytes']), ',.0f')} | "
            f"{_fmt(mib(r['nvml_used_bytes']), ',.0f')} | {_fmt(r['tflops'], '.2f')} | "
            f"{_fmt(frac, '.1f')} | {r['precision']} |")
    return "\n".join(lines) + "\n"


def _wrap(text):
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def text(result):
    """What the terminal shows: at most WIDTH columns (prose wrapped, the
    table cut to the columns that fit; gain.md has them all)."""
    smoke = result["mode"] != "gpu"
    lines = [_wrap(SMOKE_NOTE)] if smoke else []
    lines.append(_wrap(f"GPU: {result['gpu'] or 'none'}; torch {result['torch']}; "
                       f"CUDA {result['cuda'] or '-'}"))
    if smoke:
        head = f"{'workload':<26} {'config':<9} {'ms/step':>8}"
    else:
        head = (f"{'workload':<26} {'config':<9} {'steps/s':>8} {'vs def':>6} "
                f"{'alloc GiB':>9} {'TFLOP/s':>7} prec")
    lines += ["", head]
    for r in result["rows"]:
        row = f"{r['workload']:<26} {r['config']:<9}"
        if "error" in r:
            row += " error: " + " ".join(r["error"].split())
        elif smoke:
            row += f" {_ms(r):>8.1f}"
        else:
            gib = r["peak_allocated_bytes"]
            ratio = r["speedup_vs_defaults"]
            row += (f" {_fmt(r['steps_per_s'], '8.3f'):>8} "
                    f"{'--' if ratio is None else f'{ratio:.2f}x':>6} "
                    f"{_fmt(None if gib is None else gib / 2**30, '9.1f'):>9} "
                    f"{_fmt(r['tflops'], '7.1f'):>7} {r['precision']}")
        lines.append(row[:WIDTH])
    return "\n".join(lines)


def plot(result, path):
    """Draws the ratios; False when there are none or matplotlib is missing."""
    if not any(r.get("speedup_vs_defaults") is not None for r in result["rows"]):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(dict.fromkeys(r["workload"] for r in result["rows"]))
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 3, 4))
    width = 0.27
    for i, config in enumerate(CONFIGS):
        vals = [next((r.get("speedup_vs_defaults") or 0 for r in result["rows"]
                      if r["workload"] == n and r["config"] == config), 0) for n in names]
        ax.bar([j + (i - 1) * width for j in range(len(names))], vals, width, label=config)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("steps/s relative to torch defaults")
    ax.set_title(f"outofcuda gain ({result['gpu'] or 'CPU smoke: not a GPU measurement'})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def add_arguments(ap, json=True):
    """The benchmark's options, on its own parser and on `outofcuda bench`'s
    (json=False there: the command line adds --json itself)."""
    ap.add_argument("--out", default="bench-results",
                    help="folder for gain.json, gain.md and gain.png (default: ./bench-results)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes even on a GPU")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="comma-separated subset of: " + ", ".join(WORKLOADS) + " (default: all)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per worker process")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    if json:
        ap.add_argument("--json", action="store_true", help="print the JSON result")


def argument_error(args):
    """What is wrong with the options add_arguments declared, or None: checked
    by whichever parser read them, so its usage line is the one shown."""
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        return f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}"
    if args.timeout < 1:
        return "--timeout must be positive"
    return None


def main(argv=None, prog=None):
    """Runs the benchmark (or, with --worker, one worker); returns the exit code."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=sorted(SIZES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    problem = argument_error(args)
    if problem:
        ap.error(problem)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    if args.worker:
        worker(args.worker, args.size or "smoke", names)
        return 0
    env = _environment()
    gpu_mode = bool(env["gpus"]) and not args.smoke
    size = "gpu" if gpu_mode else "smoke"
    t0 = time.perf_counter()
    rows = []
    total = len(names) * len(CONFIGS)
    say = prog or "bench"
    print(_wrap(f"{say}: {len(names)} workload(s) x {len(CONFIGS)} configurations, "
                + ("GPU sizes, one process each" if gpu_mode else SMOKE_NOTE.split(" (")[0])),
          file=sys.stderr, flush=True)

    def progress(r):
        what = f"error: {' '.join(r['error'].split())}" if "error" in r else \
            f"{_fmt(_ms(r), '.1f')} ms/step"
        print(f"{say}: [{len(rows) + 1}/{total}] {r['workload']} {r['config']}: {what}"[:WIDTH],
              file=sys.stderr, flush=True)
        rows.append(r)

    if gpu_mode:  # one process per (workload, config): nothing carries over
        for n in names:
            for c in CONFIGS:
                _spawn(c, size, [n], args.timeout, progress)
    else:  # smoke: one process per config keeps it under a minute
        for c in CONFIGS:
            _spawn(c, size, names, args.timeout, progress)
    order = {c: i for i, c in enumerate(CONFIGS)}
    rows.sort(key=lambda r: (names.index(r["workload"]), order[r["config"]]))
    _ratios(rows)
    measured = gpu_mode and all("error" not in r for r in rows)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "gpu" if gpu_mode else "cpu-smoke",
        "gpu_gains_measured": measured,
        "gpu": env["gpus"][0]["name"] if env["gpus"] else None,
        "gpus": env["gpus"], "nvml_error": env["nvml_error"], "torch": env["torch"],
        "cuda": None, "sizes": SIZES[size], "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    result["cuda"] = next((r.get("cuda") for r in rows if r.get("cuda")), None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gain.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "gain.md").write_text(markdown(result))
    png = not args.no_plot and plot(result, out / "gain.png")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(text(result))
        written = ["gain.json", "gain.md"] + (["gain.png"] if png else [])
        if args.no_plot or png:
            why = ""
        elif any(r.get("speedup_vs_defaults") is not None for r in rows):
            why = " (no PNG: matplotlib missing)"
        else:
            why = " (no PNG: no ratios to draw)"
        print(_wrap(f"written to {out}: {', '.join(written)}{why}"))
        why = _no_gains(result)
        if why:
            print(_wrap(f"This run measured NO GPU gains ({why}). {MEASURED_RUN}"))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(prog="python -m outofcuda.bench"))
