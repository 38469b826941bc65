#!/usr/bin/env python3
"""One line or a few per figures file the GPU checks wrote (tests/gpu, the
files `keep` writes), for benchmarks/gpu_check.sh's summary.txt:

    python benchmarks/gpu_figures.py OUT_FOLDER

A missing file is named with the check that writes it; a file that cannot be
read is named with the error. Always exits 0: the checks' own outcomes are in
gpu_tests.log."""
import json
import sys
from pathlib import Path


def mib(b):
    return "-" if b is None else f"{b / 2**20:,.0f} MiB"


def _outside(o):
    """NVML's figure where it listed the process, else the device's."""
    return mib(o["nvml"] if o.get("nvml") is not None else o.get("device"))


def outside(d):
    head = d["headroom"] and f"; the cap's headroom {mib(d['headroom'])}"
    return [f"outside the allocator, small CNN step: at start {mib(d['at_start'])}, after a "
            f"step {mib(d['after_step'])}{head or ''}"]


def largest(d):
    runs = ", ".join(f"{c} {r['largest']}" + ("+" if r["bounded_by_limit"] else "")
                     for c, r in d.items())
    lines = [f"largest gpt batch that fits: {runs}"]
    for c, r in d.items():
        o = r["outside"]
        lines.append(f"  outside the allocator, {c}: at start {_outside(o['at_start'])}, after "
                     f"a step {_outside(o['after_step'])}, after the search "
                     f"{_outside(o['after_search'])} ({len(r['probes'])} probes)")
    return lines


def ipc(d):
    def one(r):
        ok = r["child"] == "ok" and r["value"] == r["n"] == r["parent_sees"]
        seg = "expandable" if r["expandable"] == [True] else "not expandable"
        return "works" if ok else f"fails ({r['child']}: {str(r['value'])[:80]})", seg

    return ["cuda ipc: " + ", ".join(f"{c} {w} ({s})" for c, (w, s) in
                                     ((c, one(r)) for c, r in d.items()))]


def kernels(d):
    lines = [f"cnn step by autocast dtype and layout (cudnn.benchmark {d['benchmark']}), "
             f"outside the allocator after: {_outside(d['outside_after'])}"]
    for name, v in d["variants"].items():
        groups = ", ".join(f"{g} {us / 1000:.1f}" for g, us in sorted(v["us_per_step"].items()))
        bn = "cuDNN" if v["batchnorm_by_cudnn"] else "ATen" if v["batchnorm_by_aten"] else "?"
        lines.append(f"  {name}: {v['ms_per_step']:.1f} ms/step; {v['timer']} ms: {groups}; "
                     f"batchnorm by {bn}")
    return lines


def guard(d):
    g, b = d["guarded"], d["bare"]
    row = g["bugs"].get("cudnn-sdpa-nan-grad-sm90", {})
    return [f"cudnn-sdpa-nan-grad-sm90: applies {row.get('applies')}, NaN grad_q guarded "
            f"{g['nonfinite']}, bare {b['nonfinite']} (torch {b['torch']}, cuDNN {b['cudnn']}, "
            f"cc {b['cc']})"]


def sm100(d):
    rows = ", ".join(f"{k} applies {r['applies']}" for k, r in d["rows"].items()) or "none"
    return [f"sm100 cuDNN-attention rows: {rows}; cc {d['cc']}, NaN grad_q {d['nonfinite']}"]


FILES = (
    ("outside.json", outside, "test_memory_outside_the_allocator_fits_the_default_caps_headroom"),
    ("largest_batch.json", largest, "test_largest_batch_with_and_without_outofcuda"),
    ("ipc.json", ipc,
     "test_a_cuda_tensor_shared_with_another_process_under_expandable_segments"),
    ("autocast_kernels.json", kernels, "test_where_the_cnn_step_goes_under_bfloat16_and_float16"),
    ("sdpa_guard.json", guard, "test_reproduction_with_and_without_the_guard"),
    ("sdpa_sm100.json", sm100, "test_cudnn_attention_row_for_sm100"),
)


def main(argv):
    out = Path(argv[1] if len(argv) > 1 else ".")
    for name, summarise, test in FILES:
        path = out / name
        if not path.exists():
            print(f"{name} missing ({test} did not write it)")
            continue
        try:
            lines = summarise(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            lines = [f"{name} unreadable: {type(e).__name__}: {e}"]
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
