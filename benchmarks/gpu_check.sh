#!/usr/bin/env bash
# Everything that needs a GPU, in one go (< 8 minutes on an H200): installs this
# checkout, runs every GPU test (tests/gpu) against the installed package, then
# the gain benchmark. Exits 1 when there is no usable GPU, when a GPU test fails
# or none passed (skips are listed in summary.txt with their reasons). Logs and results go to $OUT, flat, 16 files: summary.txt,
# install.log, status.txt, gpu_tests.log, fragment.json (reserved vs allocated
# after a fragmenting pattern, with and without max_split_size_mb beside
# expandable segments), ipython_oom.json (allocated memory before and after a
# cell that ran out of memory in an IPython shell, with and without
# outofcuda), outside.json (memory outside torch's caching allocator after
# CUDA's start and a small training step), largest_batch.json (the largest
# batch of bench's GPT that fits with outofcuda, with its cap off, and
# without it; memory outside the allocator along the way), ipc.json (a CUDA
# tensor shared with a second process under expandable segments),
# autocast_kernels.json (a ResNet-50 step's kernels under bfloat16 and float16
# autocast, NCHW and channels_last), sdpa_guard.json and sdpa_sm100.json (the
# cuDNN-attention reproduction with and without the guard, and its sm100
# row's place), gain.log, gain.json, gain.md, gain.png. The JSON files'
# one-line summaries are in summary.txt (benchmarks/gpu_figures.py).
#
# IPython comes from the interpreter, or from the folder OUTOFCUDA_TEST_NOTEBOOK_DIR
# names (pip install --target DIR ipython); without either its check skips.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
#   OUT=/tmp/dry bash benchmarks/gpu_check.sh --dry-run
#
# --dry-run: every step on a machine without a GPU (the suite runs it,
# tests/test_gpu_dry_run.py), so the first run on a lent GPU cannot die of a
# typo, a missing import or a wrong path: tests/gpu with tiny shapes, each
# scenario once, "cuda" made the CPU and the stand-in NVIDIA library
# (tests/gpu/conftest.py), the benchmark at its smoke sizes. It measures nothing.
#
# The package goes into a virtual environment made here that sees the
# interpreter's own packages (torch, pytest, setuptools), built with those and
# no network: the interpreter itself is left as it was, which also works where
# it is marked externally managed.
set -u
DRY=0
case "${1:-}" in
    "") ;;
    --dry-run) DRY=1 ;;
    *) echo "usage: gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
# The checkout is where this script lives, wherever it is started from.
CHECKOUT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif command -v python > /dev/null 2>&1; then
    PY=python
else
    PY=python3
fi
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
[ "$DRY" = 1 ] && note "DRY RUN: the CPU in the GPU's place; no figure here is a GPU's"
# One CPU thread per process in a dry run: on a shared machine two threads of
# a tiny step wait on each other (a tiny ResNet step took 3.7 s on two, 0.03 s
# on one), and the dry run measures nothing.
[ "$DRY" = 1 ] && export OMP_NUM_THREADS=1

# One interpreter (an import of torch takes seconds), which fails only where
# torch does not import: a device name that cannot be read is printed.
"$PY" - >> "$SUMMARY" 2>&1 <<'EOF'
import traceback
import torch
try:
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
except Exception:
    traceback.print_exc()
EOF
if [ $? -ne 0 ]; then
    note "torch is not importable with $PY (error above)"
    exit 1
fi
if [ "$DRY" = 1 ]; then
    note "nvidia-smi: not asked (dry run)"
else
    note "nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
    # This script is the proof that the GPU paths work: without a usable GPU it
    # fails instead of reporting skipped tests as a pass.
    if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >> "$SUMMARY" 2>&1; then
        note "FAIL: torch.cuda.is_available() is False: nothing here can be verified"
        exit 1
    fi
fi

# Installed, not in place: the hook file only exists in an installed package.
VENV="$WORK/venv"
: > "$OUT/install.log"
if "$PY" -m venv --without-pip "$VENV" >> "$OUT/install.log" 2>&1; then
    VPY="$VENV/bin/python"
    # Every folder of the interpreter's sys.path, after the environment's own
    # site-packages: torch, pytest and setuptools as installed there.
    site="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$PY" -c 'import sys; print("\n".join(p for p in sys.path if p))' > "$site/_gpu_check_base.pth"
else
    note "no virtual environment could be made (install.log): installing into $PY itself"
    VPY="$PY"
    VENV=""
fi
# Built by setuptools' own build hook and unpacked by hand: no pip (the GPU
# machine need not have it), no network, nothing downloaded. GPU_CHECK_WHEEL
# names a wheel already built from this checkout to unpack instead (the
# suite's dry run: its session built one with the same hook).
site="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! (cd "$CHECKOUT" && timeout 240 "$VPY" - "$WORK/wheel" "$site" "${GPU_CHECK_WHEEL:-}" \
        >> "$OUT/install.log" 2>&1 <<'EOF'
import os, sys, zipfile
out, site, built = sys.argv[1:4]  # read first: the build hook rewrites sys.argv
from setuptools import build_meta
os.makedirs(out, exist_ok=True)
path = built or os.path.join(out, build_meta.build_wheel(out))
with zipfile.ZipFile(path) as z:
    z.extractall(site)
print("installed", os.path.basename(path), "into", site)
EOF
); then
    note "building or installing the wheel failed: see install.log"
    exit 1
fi
# From $OUT, so the checkout's outofcuda/ folder cannot stand in for the
# installed package.
installed="$(cd "$OUT" && "$VPY" -c 'import _outofcuda, outofcuda; print(_outofcuda.__file__, outofcuda.__file__)' 2>&1)"
note "installed: $installed"
case "$installed" in
    "$VENV"*" $VENV"*) ;;
    *) note "FAIL: the import is not the package just installed"; exit 1 ;;
esac
(cd "$OUT" && "$VPY" -m outofcuda status > "$OUT/status.txt" 2>&1)
note "outofcuda status exit $?"

rc=0
TESTS="$CHECKOUT/tests/gpu"
if [ -d "$TESTS" ]; then
    # From a folder outside the checkout so `import outofcuda` is the installed
    # one. OUTOFCUDA_TEST_REQUIRE_GPU=1: the `gpu` fixture fails where it would skip.
    (cd "$OUT" && OUTOFCUDA_TEST_REQUIRE_GPU=1 OUTOFCUDA_TEST_GPU_DRY_RUN="$DRY" OUTOFCUDA_TEST_GPU_FIGURES="$OUT" \
        OUTOFCUDA_TEST_PYTHON="$VPY" timeout "$([ "$DRY" = 1 ] && echo 900 || echo 330)" \
        "$VPY" -m pytest "$TESTS" -v -rsx -p no:cacheprovider -p no:xdist --continue-on-collection-errors > "$OUT/gpu_tests.log" 2>&1)
    t=$?
    last="$(tail -1 "$OUT/gpu_tests.log")"
    note "gpu tests exit $t: $last"
    grep -E "^(SKIPPED|XFAIL)" "$OUT/gpu_tests.log" | tee -a "$SUMMARY"
    # Allocator without max_split_size_mb beside expandable segments: reserved
    # memory per live peak after the fragmenting pattern (tests/gpu/test_hook.py).
    "$VPY" -c "import json, sys; d = json.load(open(sys.argv[1])); print('fragment reserved/peak:', ', '.join(f'{k} {v[\"reserved_per_peak\"]:.2f}' for k, v in d.items()))" \
        "$OUT/fragment.json" >> "$SUMMARY" 2>&1 || note "fragment.json missing (test_default_allocator_reuses_freed_blocks_inside_expandable_segments did not run)"
    # A failed cell in an IPython shell: what its frames held, before and after
    # (tests/gpu/test_oom.py).
    "$VPY" -c "import json, sys; d = json.load(open(sys.argv[1])); m = lambda b: f'{b / 2**20:.2f} MiB'; print('ipython failed cell: allocated', ', '.join(f'{k} {m(d[k][\"before\"])} before, {m(d[k][\"after\"])} after' for k in ('outofcuda', 'without')), '(the cell held', m(d['held']) + ')')" \
        "$OUT/ipython_oom.json" >> "$SUMMARY" 2>&1 || note "ipython_oom.json missing (test_ipython_failed_cell_gives_its_memory_back did not run)"
    # The costs of the defaults and the known-bug rows' figures (tests/gpu).
    "$VPY" "$CHECKOUT/benchmarks/gpu_figures.py" "$OUT" >> "$SUMMARY" 2>&1
    [ "$t" -ne 0 ] && rc=1
    if [ "$DRY" = 0 ] && ! echo "$last" | grep -q " passed"; then
        note "FAIL: no GPU test passed"
        rc=1
    fi
else
    note "FAIL: no tests/gpu folder in $CHECKOUT"
    rc=1
fi

SMOKE=()
# One workload is enough to prove the step runs here; every workload's smoke
# run is tests/test_bench.py's.
[ "$DRY" = 1 ] && SMOKE=(--smoke --workloads mlp)
(cd "$OUT" && timeout 300 "$VPY" "$CHECKOUT/benchmarks/gain.py" ${SMOKE[@]+"${SMOKE[@]}"} --out "$OUT" \
    --timeout 120 > "$OUT/gain.log" 2>&1)
g=$?
note "gain benchmark exit $g (table: gain.md, data: gain.json, chart: gain.png if matplotlib)"
[ "$g" -ne 0 ] && rc=1
grep -E "^\| (gpt|cnn|mlp)" "$OUT/gain.md" 2>/dev/null | head -30 >> "$SUMMARY"
note "gpu check exit $rc"
exit $rc
