"""GPU-only checks (skip without a GPU); a package so their basenames may repeat tests/.

OUTOFCUDA_TEST_GPU_DRY_RUN=1 (benchmarks/gpu_check.sh --dry-run, run by the suite in
tests/test_gpu_dry_run.py): every check runs on the CPU with tiny shapes
(`size`), the device calls answered by tests/gpu/dry_run/sitecustomize.py and
the stand-in NVIDIA library."""
import json
import os

DRY_RUN = os.environ.get("OUTOFCUDA_TEST_GPU_DRY_RUN", "").strip() == "1"


def size(real, dry):
    """real on the GPU, dry in a dry run (a shape the CPU computes in moments)."""
    return dry if DRY_RUN else real


def keep(name, figures):
    """Writes figures as JSON to OUTOFCUDA_TEST_GPU_FIGURES/name, where
    benchmarks/gpu_check.sh collects them (benchmarks/gpu_figures.py)."""
    folder = os.environ.get("OUTOFCUDA_TEST_GPU_FIGURES")
    if folder:
        with open(os.path.join(folder, name), "w") as f:
            json.dump(figures, f, indent=1)
