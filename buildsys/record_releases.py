"""Regenerates tests/releases.json's records from the real torch wheels.

    python buildsys/record_releases.py 2.15.0 [2.14.1 ...] [--python 3.11] [--write]

Each release's wheel for Linux (the CUDA build the package index serves) is
fetched with `pip download torch==X --no-deps` from the package index alone
(pip's configuration files, local wheels and constraints left out; 0.5 to 0.9
GB each, 13 minutes for 2.0 to 2.15) and read as a zip, nothing installed or
imported: torch._C's names from torch/_C/__init__.pyi,
the bundled cuDNN, NCCL and CUDA versions from the wheel's METADATA
(nvidia-cudnn-cuXX==..., nvidia-nccl-cuXX==...) and torch/version.py, FSDP's
divide-factor setters from torch.distributed.fsdp's source, and the allocator
keys the release parses from the strings of libc10.so and libc10_cuda.so.
Without --write it prints each record and how it differs from the committed
one; with --write it puts them into tests/releases.json. Not part of the
suite (the downloads); a new release is one run of it.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

RECORDS = Path(__file__).resolve().parent.parent / "tests" / "releases.json"
# The allocator functions outofcuda calls (allocconf.c, api.c).
ALLOCATOR = ("_cuda_cudaCachingAllocator_set_allocator_settings",
             "_accelerator_getAllocatorSettings", "_accelerator_setAllocatorSettings")
# Keys any release's allocator parser has named (CUDAAllocatorConfig, AcceleratorAllocatorConfig).
KEYS = ("backend", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
        "roundup_power2_divisions", "expandable_segments", "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register", "pinned_num_register_threads",
        "pinned_use_background_threads", "pinned_reserve_segment_size_mb",
        "per_process_memory_fraction", "graph_capture_record_stream_reuse",
        "large_segment_size_mb")
# What each record's fields mean (written into releases.json with the records).
FIELDS = {
    "checked": "the patch release whose wheel was read",
    "allocator": "which of torch._C's allocator functions outofcuda calls the release has",
    "cudnn": "the cuDNN the wheel pins or bundles, as torch.backends.cudnn.version() numbers it",
    "nccl": "the NCCL the wheel pins (nvidia-nccl-cuXX)",
    "fsdp": "torch.distributed.fsdp: null without FSDPModule, 'no_divide_factor' with an FSDPModule "
            "without a divide-factor setter, 'divide_factor' with set_reduce_scatter_divide_factor "
            "or set_gradient_divide_factor",
    "autocast_getter": "the function that reads the autocast dtype",
    "cuda": "torch.version.cuda",
    "allocator_keys": "which of the allocator keys outofcuda knows the release's parser names",
}
FSDP_FILES = ("torch/distributed/fsdp/_fully_shard/_fully_shard.py",
              "torch/distributed/_composable/fsdp/fully_shard.py")


def version_number(text, cudnn=False):
    """'9.24.0.43' -> 92400 (torch.backends.cudnn.version()'s numbering;
    cuDNN 8 is major*1000+minor*100+patch)."""
    a, b, c = (list(map(int, re.findall(r"\d+", text)[:3])) + [0, 0])[:3]
    return a * (1000 if cudnn and a < 9 else 10000) + b * 100 + c


def inspect(wheel):
    """The record of one wheel (a zip), read without installing it."""
    z = zipfile.ZipFile(wheel)
    names = set(z.namelist())
    meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    # "nvidia-cudnn-cu12==9.1.0.70", or on old wheels "nvidia-cudnn-cu11 (==8.5.0.96)".
    deps = dict(re.findall(r"^Requires-Dist: (nvidia-\w+?)(?:-cu\d+)? ?\(?==([\d.]+)", meta, re.M))
    version = re.search(r"__version__ = '([^']+)'", z.read("torch/version.py").decode()).group(1)
    cuda = re.search(r"^cuda\b[^=\n]*= '?([\d.]+|None)", z.read("torch/version.py").decode(), re.M)
    pyi = z.read("torch/_C/__init__.pyi").decode()
    defs = set(re.findall(r"^def (\w+)\(", pyi, re.M))
    cudnn = deps.get("nvidia-cudnn")
    if cudnn is None:  # bundled in torch/lib (libcudnn.so.8.x.y), or none (CPU)
        bundled = [n for n in names if re.search(r"lib/libcudnn\.so\.\d+\.\d+", n)]
        cudnn = re.search(r"\.so\.([\d.]+)", bundled[0]).group(1) if bundled else None
    fsdp = None
    for f in FSDP_FILES:
        src = z.read(f).decode() if f in names else ""
        if "class FSDPModule" in src:
            fsdp = ("divide_factor" if re.search(
                r"def set_(gradient|reduce_scatter)_divide_factor", src) else "no_divide_factor")
    libs = b"".join(z.read(n) for n in ("torch/lib/libc10.so", "torch/lib/libc10_cuda.so")
                    if n in names)
    return {
        "checked": version.split("+")[0],
        "allocator": sorted(n for n in ALLOCATOR if n in defs),
        "cudnn": version_number(cudnn, cudnn=True) if cudnn else None,
        "nccl": deps.get("nvidia-nccl"),
        "fsdp": fsdp,
        "autocast_getter": "get_autocast_dtype" if "get_autocast_dtype" in defs
        else "get_autocast_gpu_dtype",
        "cuda": None if cuda is None or cuda.group(1) == "None" else cuda.group(1),
        # A key is a string of its own in the library's read-only data.
        "allocator_keys": [k for k in KEYS if b"\0" + k.encode() + b"\0" in libs],
    }


def dumps(data):
    """releases.json as committed: one line per release."""
    head = json.dumps({k: v for k, v in data.items() if k != "releases"}, indent=2)[:-2]
    rows = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in data["releases"].items())
    return head + ',\n  "releases": {\n' + rows + "\n  }\n}\n"


def download(release, python, dest):
    cmd = [sys.executable, "-m", "pip", "download", f"torch=={release}", "--no-deps",
           "--only-binary=:all:", "-d", str(dest)]
    if python:
        cmd += ["--python-version", python, "--platform", "manylinux_2_28_x86_64",
                "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]
    # The index's own wheel: no configuration file, no local wheels or constraints.
    env = {k: v for k, v in os.environ.items() if k not in (
        "PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_CONSTRAINT")}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(env, PIP_CONFIG_FILE=os.devnull))
    return next(Path(dest).glob(f"torch-{release}*.whl"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("releases", nargs="+", help="torch releases, e.g. 2.15.0")
    ap.add_argument("--python", help="the Python version whose wheel to fetch (default: this one)")
    ap.add_argument("--wheel", action="append", default=[], help="read this wheel, no download")
    ap.add_argument("--write", action="store_true", help="put the records into releases.json")
    args = ap.parse_args(argv)
    data = json.loads(RECORDS.read_text())
    changed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, release in enumerate(args.releases):
            start = time.monotonic()
            wheel = Path(args.wheel[i]) if i < len(args.wheel) else download(
                release, args.python, tmp)
            fetched = time.monotonic()
            rec = inspect(wheel)
            if i >= len(args.wheel):
                print(f"# {wheel.name}: {wheel.stat().st_size / 1e9:.2f} GB,"
                      f" {fetched - start:.0f} s to fetch", flush=True)
                wheel.unlink()  # read: the next one may be as large
            series = ".".join(release.split(".")[:2])
            old = data["releases"].get(series, {})
            diff = {k: (old.get(k), v) for k, v in rec.items() if k in old and old[k] != v}
            print(json.dumps({series: rec}), f"# {time.monotonic() - start:.0f} s in all,",
                  "differs from the record: " + json.dumps(diff) if diff else "as recorded")
            changed += bool(diff)
            if args.write:
                data["releases"][series] = dict(old, **rec)
    if args.write:
        today = datetime.date.today().isoformat()
        python = args.python or "%d.%d" % sys.version_info[:2]
        data.update(recorded=today, fields=FIELDS, source=(
            f"buildsys/record_releases.py, {today}: the real CUDA wheels that pip takes from the "
            f"package index for Linux x86_64 and Python {python} (torch==X, no local index), one "
            "patch release per series, read as zips without installing or importing them; the "
            "series' key is its major.minor"))
        RECORDS.write_text(dumps(data))
    return 1 if changed and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
