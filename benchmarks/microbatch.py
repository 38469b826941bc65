"""What auto_microbatch costs a training step that hits no OOM: an 8x8 Linear
on the CPU, forward, loss and backward, bare and through auto_microbatch,
measured side by side in one process (rounds alternate, so drift of a shared
machine hits both), reported as the ratio of their medians. Two loops: the
usual one, whose gradients start empty each step (zero_grad(set_to_none=True),
torch's default, in both arms), and one that accumulates gradients across
steps, where auto_microbatch adds each step's gradient into the kept one.

    python benchmarks/microbatch.py [--rounds 30] [--steps 2000] [--json out.json]

Run it with a Python that has torch and outofcuda installed.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.steps < 1:
        p.error("--rounds and --steps must be at least 1")

    import torch

    import outofcuda

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    mse = torch.nn.functional.mse_loss

    def bare(x, y):
        loss = mse(model(x), y)
        loss.backward()
        return loss.detach()

    @outofcuda.auto_microbatch
    def wrapped(x, y):
        return mse(model(x), y)

    def per_step(step, fresh):
        t0 = time.perf_counter()
        for _ in range(a.steps):
            if fresh:
                model.zero_grad(set_to_none=True)
            step(x, y)
        return (time.perf_counter() - t0) / a.steps * 1e6

    out = {"rounds": a.rounds, "steps": a.steps, "torch": torch.__version__}
    for loop, fresh in (("fresh_gradients", True), ("accumulating", False)):
        for step in (bare, wrapped):  # warm-up: autograd's first graphs, imports
            per_step(step, fresh)
        times = {"bare": [], "auto_microbatch": []}
        for i in range(a.rounds):
            order = (("bare", bare), ("auto_microbatch", wrapped))
            for name, step in order if i % 2 == 0 else order[::-1]:
                times[name].append(per_step(step, fresh))
        med = {k: statistics.median(v) for k, v in times.items()}
        out[loop] = {"bare_us": med["bare"], "auto_microbatch_us": med["auto_microbatch"],
                     "ratio": med["auto_microbatch"] / med["bare"]}
        print(f"{loop:16s} bare {med['bare']:7.1f} us, auto_microbatch "
              f"{med['auto_microbatch']:7.1f} us, ratio {out[loop]['ratio']:.3f} "
              f"(medians of {a.rounds} rounds of {a.steps} steps)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
