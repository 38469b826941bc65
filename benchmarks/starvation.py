#!/usr/bin/env python3
"""Cost of the exit summary's input-wait measurement: the same training loop
with and without OUTOFCUDA_SUMMARY, as a ratio of the loop's wall time.

With the summary on, a native thread takes the GIL about every 200 ms to look
at the main thread's stack (src/summary.c); this measures what that costs a
loop that holds the GIL most of the time (a small model on the CPU, a
DataLoader with num_workers=0 whose items are made in Python). Target: a
median ratio of at most 1.02 (TARGET).

The interpreter given must have outofcuda installed (its hook fires on
`import torch`). Runs alternate (off, on, off, on, ...) so that drift in the
machine's load falls on both sides; each run is a fresh interpreter and times
only the loop, not the start-up.

    python benchmarks/starvation.py --python /path/to/venv/bin/python --runs 7 \\
        --out benchmarks/results/starvation-cpu.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

TARGET = 1.02

LOOP = r"""
import json, sys, time
import torch

class Items(torch.utils.data.Dataset):
    # Items made in Python: the main thread holds the GIL while it fetches.
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        return torch.full((64,), float(i % 7)), i % 10

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = torch.utils.data.DataLoader(Items(), batch_size=32, shuffle=True, num_workers=0)
epochs = int(sys.argv[1])
t0 = time.perf_counter()
c0 = time.process_time()
for _ in range(epochs):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
res = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}
import _outofcuda
frames = _outofcuda._summary_stats()["frames"]
res.update(samples=frames["samples"], gil_held_s=frames["gil_held_s"])
print(json.dumps(res))
"""


def run_once(python, epochs, summary, out_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTOFCUDA_")}
    if summary:
        # The JSON form: the figures are written, nothing is printed.
        env["OUTOFCUDA_SUMMARY"] = os.path.join(out_dir, "summary.json")
    r = subprocess.run([python, "-c", LOOP, str(epochs)], env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"the loop failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="interpreter with outofcuda")
    ap.add_argument("--runs", type=int, default=7, help="runs per side (alternating)")
    ap.add_argument("--epochs", type=int, default=30, help="epochs of 128 steps per run")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        run_once(args.python, 1, False, tmp)  # warm the file cache
        for _ in range(args.runs):
            off.append(run_once(args.python, args.epochs, False, tmp))
            on.append(run_once(args.python, args.epochs, True, tmp))
        with open(os.path.join(tmp, "summary.json")) as f:
            wait = json.load(f)["input_wait"]
    med = {side: {k: statistics.median(r[k] for r in runs) for k in ("wall", "cpu")}
           for side, runs in (("off", off), ("on", on))}
    best = {side: min(r["wall"] for r in runs) for side, runs in (("off", off), ("on", on))}
    held = sum(r["gil_held_s"] for r in on) / sum(r["samples"] for r in on)
    result = {
        "python": args.python, "runs": args.runs, "epochs": args.epochs,
        "median_wall_s": {"off": med["off"]["wall"], "on": med["on"]["wall"]},
        "median_cpu_s": {"off": med["off"]["cpu"], "on": med["on"]["cpu"]},
        "ratio_wall": med["on"]["wall"] / med["off"]["wall"],
        "ratio_cpu": med["on"]["cpu"] / med["off"]["cpu"],
        # The fastest run of each side: what a loaded machine adds falls out first.
        "ratio_wall_best": best["on"] / best["off"],
        # What the sampler itself takes from the loop: the GIL it holds per sample.
        "gil_held_us_per_sample": 1e6 * held,
        "samples_per_run": statistics.median(r["samples"] for r in on),
        "load_average": os.getloadavg(),
        "target": TARGET,
        "last_run_input_wait": wait,
    }
    result["pass"] = result["ratio_wall"] <= TARGET
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
