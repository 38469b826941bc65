#!/usr/bin/env python3
"""Start-up tax of outofcuda: the same Python with and without it installed.

Two virtual environments that differ only by outofcuda (both hold torch and
numpy) are compared on
  1. `python -c pass`: instructions under callgrind (repeatable to a few
     hundred instructions on one machine); target: at most 1.5 % more;
  2. `python -c "import torch"`: wall time, alternating runs, median; target:
     at most 1 % more; and `torch.cuda.is_initialized()` stays False.
Without valgrind, (1) falls back to alternating wall-clock medians.

Example (builds the wheel and both environments, ~2 minutes)::

    python benchmarks/startup.py --out benchmarks/results/startup.json

Reuse environments you already have (the "with" one must hold outofcuda,
the "without" one must not)::

    python benchmarks/startup.py --with-venv /tmp/a --without-venv /tmp/b
"""
import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PASS_TARGET = 1.015
IMPORT_TARGET = 1.01


def clean_env(extra=None):
    """The caller's environment minus anything that changes Python or outofcuda;
    PYTHONHASHSEED fixed so instruction counts repeat."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OUTOFCUDA_", "PYTHON", "PYTORCH_"))}
    env["PYTHONHASHSEED"] = "0"
    env.update(extra or {})
    return env


def venv_python(path):
    return str(Path(path) / "bin" / "python")


def pip(python, *args):
    subprocess.run([python, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True, env=clean_env())


def build_wheel(workdir):
    out = Path(workdir) / "wheel"
    src = Path(workdir) / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "*.so", ".venv*", "__pycache__", "bench-results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)], check=True, env=clean_env())
    return next(out.glob("outofcuda-*.whl"))


def make_venv(path, torch_spec, wheel=None):
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = venv_python(path)
    if torch_spec:
        pip(python, "install", "numpy", torch_spec)
    if wheel:
        pip(python, "install", "--no-deps", str(wheel))
    return path


def has_outofcuda(python):
    code = ("import sysconfig, pathlib; p = pathlib.Path(sysconfig.get_paths()['purelib']); "
            "print(int((p / 'outofcuda_hook.pth').is_file()))")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=clean_env())
    return r.stdout.strip() == "1"


def callgrind_instructions(python, code="pass"):
    """Instructions executed by `python -c code` (callgrind's 'Collected')."""
    r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                        python, "-c", code], capture_output=True, text=True, env=clean_env())
    m = re.search(r"Collected\s*:\s*(\d+)", r.stderr)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"callgrind failed ({r.returncode}): {r.stderr[-800:]}")
    return int(m.group(1))


def wall(python, code):
    t0 = time.perf_counter()
    subprocess.run([python, "-c", code], check=True, env=clean_env(),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def alternating(py_with, py_without, code, runs):
    """Median wall time of each, runs interleaved (A B B A ...) so drift in
    machine load hits both sides alike. One warm-up run each first."""
    wall(py_with, code)
    wall(py_without, code)
    a, b = [], []
    for i in range(runs):
        pair = [(py_with, a), (py_without, b)]
        for py, acc in (pair if i % 2 == 0 else pair[::-1]):
            acc.append(wall(py, code))
    return {"with_s": statistics.median(a), "without_s": statistics.median(b),
            "ratio": statistics.median(a) / statistics.median(b), "runs": runs,
            "with_all_s": a, "without_all_s": b}


def check_no_cuda_init(python):
    code = ("import json, torch, _outofcuda; print(json.dumps({'cuda_initialized': "
            "torch.cuda.is_initialized(), 'fired': _outofcuda.status()['hook']['fired']}))")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=clean_env())
    if r.returncode != 0:
        return {"error": r.stderr[-800:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(py_with, py_without, runs, repeats, skip_torch):
    res = {"pass": {}, "import_torch": None}
    if shutil.which("valgrind"):
        a = [callgrind_instructions(py_with) for _ in range(repeats)]
        b = [callgrind_instructions(py_without) for _ in range(repeats)]
        res["pass"] = {"method": "callgrind instructions", "with": statistics.median_low(a),
                       "without": statistics.median_low(b), "with_all": a, "without_all": b,
                       "extra": statistics.median_low(a) - statistics.median_low(b),
                       "ratio": statistics.median_low(a) / statistics.median_low(b)}
    else:
        res["pass"] = dict(alternating(py_with, py_without, "pass", runs * 2),
                           method="wall-clock median (valgrind not found)")
    res["pass"]["target"] = PASS_TARGET
    res["pass"]["ok"] = res["pass"]["ratio"] <= PASS_TARGET
    if not skip_torch:
        t = alternating(py_with, py_without, "import torch", runs)
        t.update(method="wall-clock median of alternating runs", target=IMPORT_TARGET,
                 ok=t["ratio"] <= IMPORT_TARGET)
        t["with_outofcuda"] = check_no_cuda_init(py_with)
        res["import_torch"] = t
    return res


def text_report(r):
    p = r["pass"]
    lines = [f"outofcuda start-up tax ({r['date']}, Python {r['python']}, {r['machine']})"]
    if "extra" in p:
        lines.append(f"  python -c pass   {p['with']:,} vs {p['without']:,} instructions: "
                     f"+{p['extra']:,} = ratio {p['ratio']:.4f} (target <= {p['target']}) "
                     f"{'OK' if p['ok'] else 'OVER'}")
    else:
        lines.append(f"  python -c pass   {p['with_s'] * 1e3:.1f} ms vs {p['without_s'] * 1e3:.1f} "
                     f"ms: ratio {p['ratio']:.4f} (target <= {p['target']}) "
                     f"{'OK' if p['ok'] else 'OVER'} [{p['method']}]")
    t = r["import_torch"]
    if t:
        lines.append(f"  import torch     {t['with_s']:.3f} s vs {t['without_s']:.3f} s (median of "
                     f"{t['runs']} alternating): ratio {t['ratio']:.4f} (target <= {t['target']}) "
                     f"{'OK' if t['ok'] else 'OVER'}")
        w = t["with_outofcuda"]
        lines.append(f"  after import torch: hook fired={w.get('fired')}, "
                     f"torch.cuda.is_initialized()={w.get('cuda_initialized')}"
                     + (f" error={w['error']}" if "error" in w else ""))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--with-venv", help="reuse: a venv holding outofcuda, torch, numpy")
    ap.add_argument("--without-venv", help="reuse: the same venv without outofcuda")
    ap.add_argument("--wheel", help="outofcuda wheel to install (default: build this checkout)")
    ap.add_argument("--workdir", help="where to create venvs (default: a temporary folder)")
    ap.add_argument("--torch-spec", default="torch==2.13.0", help="torch to install in new venvs")
    ap.add_argument("--runs", type=int, default=21, help="alternating wall-clock runs (>= 3)")
    ap.add_argument("--repeats", type=int, default=3, help="callgrind runs per side (>= 1)")
    ap.add_argument("--skip-torch", action="store_true", help="only `python -c pass`")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = ap.parse_args(argv)
    if args.runs < 3:
        ap.error("--runs must be at least 3")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="oc-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    torch_spec = None if args.skip_torch else args.torch_spec
    if args.with_venv:
        py_with = venv_python(args.with_venv)
    else:
        wheel = args.wheel or build_wheel(work)
        py_with = venv_python(make_venv(work / "with", torch_spec, wheel))
    py_without = venv_python(args.without_venv or make_venv(work / "without", torch_spec))
    if not has_outofcuda(py_with):
        ap.error(f"{py_with}: outofcuda_hook.pth not installed there")
    if has_outofcuda(py_without):
        ap.error(f"{py_without}: outofcuda is installed there; it must not be")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "machine": platform.machine() + " " + platform.node(),
        "with_python": py_with, "without_python": py_without,
    }
    result.update(measure(py_with, py_without, args.runs, args.repeats, args.skip_torch))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if args.json else text_report(result))
    ok = result["pass"]["ok"] and (result["import_torch"] is None or result["import_torch"]["ok"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
