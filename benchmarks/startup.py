#!/usr/bin/env python3
"""Start-up tax of outofcuda: the same Python with and without it installed.

Two virtual environments that differ only by outofcuda (paths of equal length;
both hold torch and numpy unless --skip-torch) are compared under callgrind
(instruction counts repeat exactly on one machine):
  1. `python -c pass`; target: at most 1.020x (PASS_TARGET); also with
     OUTOFCUDA_DISABLE=1, and with outofcuda's byte-code removed (an install
     with --no-compile or a read-only site-packages);
  2. `import outofcuda` without torch, against `python -c pass` of the same
     environment; target: at most 1.10x;
  3. the finder's cost per import: a start-up that imports about 200 standard
     modules, with the hook on and with OUTOFCUDA_DISABLE=1 in the same venv;
  4. anchors: other hooks measured the same way (setuptools'
     distutils-precedence.pth) so the figures can be compared across machines;
  5. `python -c "import torch"`: instructions; target: at most 1.005x; and
     `torch.cuda.is_initialized()` stays False. --wall-runs adds alternating
     wall-clock medians.
Without valgrind, (1) falls back to alternating wall-clock medians.

Example (builds the wheel and both environments, a few minutes)::

    python benchmarks/startup.py --out benchmarks/results/startup-cpu-py311.json

Another interpreter, without torch (no torch wheel for it here)::

    python benchmarks/startup.py --python python3.13 --skip-torch --out r313.json

Reuse environments you already have (the "with" one must hold outofcuda,
the "without" one must not)::

    python benchmarks/startup.py --with-venv /tmp/a --without-venv /tmp/b

A markdown table from several result files::

    python benchmarks/startup.py --markdown benchmarks/results/startup.md r39.json r311.json
"""
import atexit
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
PASS_TARGET = 1.020        # python -c pass, outofcuda installed / not installed: the goal
# What the shipped hook keeps (the goal is not met: the .pth guard that keeps a
# damaged boot silent costs about 0.006, see results/startup-pth-variants.md,
# and the size check that never maps a partly written boot about 0.003; the
# line's OUTOFCUDA_VERBOSE test, which lets OUTOFCUDA_DISABLE=1 say so, 0.002).
# Measured 1.0311 on 3.11.7 in measured_env(). The exit status, and
# tests/test_bench.py, fail above this.
PASS_CEILING = 1.035
NO_BYTECODE_TARGET = 1.035  # the same without any outofcuda byte-code
IMPORT_OUTOFCUDA_TARGET = 1.10  # import outofcuda / python -c pass, same venv
IMPORT_TARGET = 1.005      # import torch, instructions
# About 200 standard-library modules imported at start-up (counted per run).
MANY = ("import argparse, asyncio, csv, dataclasses, decimal, email.message, email.mime.text, "
        "http.client, inspect, json, logging.handlers, multiprocessing, pydoc, sqlite3, "
        "subprocess, tarfile, typing, unittest, urllib.request, xml.etree.ElementTree, zipfile")


def clean_env(extra=None):
    """The caller's environment minus anything that changes Python or outofcuda;
    PYTHONHASHSEED fixed so instruction counts repeat."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OUTOFCUDA_", "PYTHON", "PYTORCH_"))}
    env["PYTHONHASHSEED"] = "0"
    env.update(extra or {})
    return env


def measured_env(extra=None):
    """The fixed environment of every instruction count: Python reads its
    environment at start-up, so its size moves the base count, and with it the
    ratio, from one machine to the next (1.0299 with a developer's, 1.0311
    with this one, the hook's cost the same)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0"}
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


def make_venv(base_python, path, torch_spec, wheel=None):
    subprocess.run([base_python, "-m", "venv", str(path)], check=True, env=clean_env())
    python = venv_python(path)
    if torch_spec:
        pip(python, "install", "numpy", torch_spec)
    if wheel:
        pip(python, "install", "--no-deps", str(wheel))
    return path


def site_dir(python):
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([python, "-c", code], capture_output=True, text=True,
                               check=True, env=clean_env()).stdout.strip())


def has_outofcuda(python):
    return (site_dir(python) / "outofcuda_hook.pth").is_file()


# Measured commands run in an empty directory: `-c` puts the working directory
# first on sys.path, and a busy one (files appearing while the runs go on)
# makes every import's directory scan differ between runs.
# Made at first use and removed at exit, so importing this module leaves nothing.
_quiet = []


def quiet_cwd():
    if not _quiet:
        _quiet.append(tempfile.mkdtemp(prefix="oc-startup-cwd-"))
        atexit.register(shutil.rmtree, _quiet[0], True)
    return _quiet[0]


def callgrind_instructions(python, code="pass", env=None):
    """Instructions executed by `python -c code` (callgrind's 'Collected')."""
    r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                        python, "-c", code], capture_output=True, text=True,
                       env=measured_env(env), cwd=quiet_cwd())
    m = re.search(r"Collected\s*:\s*(\d+)", r.stderr)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"callgrind failed ({r.returncode}): {r.stderr[-800:]}")
    return int(m.group(1))


def counts(python, repeats, code="pass", env=None):
    # One unmeasured run first: byte-code caches written by it are not counted.
    subprocess.run([python, "-c", code], env=measured_env(env), capture_output=True, cwd=quiet_cwd())
    return [callgrind_instructions(python, code, env) for _ in range(repeats)]


def compare(a_all, b_all, target=None):
    a, b = statistics.median_low(a_all), statistics.median_low(b_all)
    res = {"method": "callgrind instructions", "with": a, "without": b, "with_all": a_all,
           "without_all": b_all, "extra": a - b, "ratio": a / b}
    if target is not None:
        res.update(target=target, ok=a / b <= target)
    return res


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


class Aside:
    """Moves files of a site-packages out of the way (renamed in place, so the
    directory listing site reads keeps its length) and back."""

    def __init__(self, paths):
        self.paths = [Path(p) for p in paths if Path(p).exists()]

    def __enter__(self):
        for p in self.paths:
            p.rename(p.with_name(p.name + ".aside"))
        return self

    def __exit__(self, *exc):
        for p in self.paths:
            p.with_name(p.name + ".aside").rename(p)


def anchor_distutils(py_without, repeats, as_is):
    """setuptools' distutils-precedence.pth (with its _distutils_hack package)
    in the "without" venv, against the same venv without that .pth. as_is:
    that venv's counts as it is (instruction counts repeat exactly)."""
    site = site_dir(py_without)
    pth = site / "distutils-precedence.pth"
    added = []
    if not pth.exists():
        try:
            import _distutils_hack
        except ImportError:
            return {"skipped": "setuptools' _distutils_hack is not available to copy"}
        shutil.copytree(Path(_distutils_hack.__file__).parent, site / "_distutils_hack")
        pth.write_text("import os; var = 'SETUPTOOLS_USE_DISTUTILS'; enabled = os.environ.get(var, "
                       "'local') == 'local'; enabled and __import__('_distutils_hack').add_shim(); \n")
        added = [site / "_distutils_hack", pth]
    try:
        with_ = counts(py_without, repeats) if added else as_is
        with Aside([pth]):
            without = counts(py_without, repeats)
    finally:
        for p in added:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return dict(compare(with_, without), what="setuptools distutils-precedence.pth")


def anchor_floor(py_without, repeats, base):
    """A comment-only .pth in the "without" venv (base: its counts without it):
    what site charges for any .pth file at all (on 3.13 the first one costs
    about 3 %: site decodes it as utf-8-sig, which imports that codec)."""
    pth = site_dir(py_without) / "zz_floor.pth"
    pth.write_text("# comment only\n")
    try:
        with_ = counts(py_without, repeats)
    finally:
        pth.unlink()
    return dict(compare(with_, base), what="a comment-only .pth")


def measure(py_with, py_without, runs, repeats, skip_torch, wall_runs):
    res = {"pass": {}, "import_torch": None}
    if not shutil.which("valgrind"):
        res["pass"] = dict(alternating(py_with, py_without, "pass", runs * 2),
                           method="wall-clock median (valgrind not found)")
        res["pass"]["target"] = PASS_TARGET
        res["pass"]["ok"] = res["pass"]["ratio"] <= PASS_TARGET
        return res
    off = {"OUTOFCUDA_DISABLE": "1"}
    with_pass = counts(py_with, repeats)
    without_pass = counts(py_without, repeats)
    res["pass"] = compare(with_pass, without_pass, PASS_TARGET)
    res["pass"].update(ceiling=PASS_CEILING, within_ceiling=res["pass"]["ratio"] <= PASS_CEILING)
    res["pass_disabled"] = compare(counts(py_with, repeats, env=off), without_pass)
    caches = list((site_dir(py_with) / "outofcuda").glob("__pycache__"))
    with Aside(caches):
        res["pass_no_bytecode"] = compare(
            [callgrind_instructions(py_with) for _ in range(repeats)], without_pass,
            NO_BYTECODE_TARGET)
    res["pass_no_bytecode"]["pycache_dirs_moved"] = len(caches)
    res["import_outofcuda"] = compare(counts(py_with, repeats, "import outofcuda"), with_pass,
                                      IMPORT_OUTOFCUDA_TARGET)
    res["import_outofcuda"]["note"] = "import outofcuda / python -c pass, both in the with-venv"
    # The finder's cost per import: the same venv with the hook on and off.
    probe = MANY + "; import sys; print(len(sys.modules))"
    n_mods = int(subprocess.run([py_with, "-c", probe], capture_output=True, text=True,
                                env=clean_env(), check=True, cwd=quiet_cwd()).stdout)
    n_base = int(subprocess.run([py_with, "-c", "import sys; print(len(sys.modules))"],
                                capture_output=True, text=True, env=clean_env(off),
                                check=True).stdout)
    many_on = statistics.median_low(counts(py_with, repeats, MANY))
    many_off = statistics.median_low(counts(py_with, repeats, MANY, off))
    pass_off = statistics.median_low(res["pass_disabled"]["with_all"])
    finder = (many_on - many_off) - (res["pass"]["with"] - pass_off)
    res["finder_per_import"] = {
        "code": MANY, "modules_imported": n_mods - n_base, "with_hook": many_on,
        "hook_disabled": many_off, "finder_instructions": finder,
        "per_import": finder / max(1, n_mods - n_base), "ratio": many_on / many_off,
        "note": "(with hook - disabled) for the imports, minus the same difference for "
                "`python -c pass` (installing the finder)"}
    res["anchors"] = {"comment-only .pth": anchor_floor(py_without, repeats, without_pass),
                      "distutils-precedence.pth": anchor_distutils(py_without, repeats,
                                                                   without_pass)}
    if not skip_torch:
        t_on = callgrind_instructions(py_with, "import torch")
        t_off = callgrind_instructions(py_with, "import torch", off)
        t_without = callgrind_instructions(py_without, "import torch")
        t = compare([t_on], [t_without], IMPORT_TARGET)
        t["hook_disabled"] = t_off
        t["ratio_hook_disabled"] = t_off / t_without
        t["with_outofcuda"] = check_no_cuda_init(py_with)
        if wall_runs:
            t["wall"] = alternating(py_with, py_without, "import torch", wall_runs)
        res["import_torch"] = t
    return res


def text_report(r):
    p = r["pass"]
    lines = [f"outofcuda start-up tax ({r['date']}, Python {r['python']}, {r['machine']}, "
             f"torch {'installed' if r.get('torch') else 'not installed'})"]
    if "extra" not in p:
        lines.append(f"  python -c pass   {p['with_s'] * 1e3:.1f} ms vs {p['without_s'] * 1e3:.1f} "
                     f"ms: ratio {p['ratio']:.4f} (target <= {p['target']}) "
                     f"{'OK' if p['ok'] else 'OVER'} [{p['method']}]")
        return "\n".join(lines)

    def row(label, d):
        verdict = "" if "target" not in d else (
            f" (target <= {d['target']}) {'OK' if d['ok'] else 'OVER'}")
        return (f"  {label:<28} {d['with']:>14,} vs {d['without']:>14,}: +{d['extra']:,} = "
                f"ratio {d['ratio']:.4f}{verdict}")

    lines.append(row("python -c pass", p) + f", ceiling {p['ceiling']} "
                 + ("kept" if p["within_ceiling"] else "EXCEEDED"))
    lines.append(row("  OUTOFCUDA_DISABLE=1", r["pass_disabled"]))
    lines.append(row("  without byte-code", r["pass_no_bytecode"]))
    lines.append(row("import outofcuda / pass", r["import_outofcuda"]))
    f = r["finder_per_import"]
    lines.append(f"  finder over {f['modules_imported']} imports: {f['finder_instructions']:,} "
                 f"instructions = {f['per_import']:.0f} per import (ratio {f['ratio']:.5f})")
    for name, a in r["anchors"].items():
        lines.append(row(f"anchor {name}", a) if "ratio" in a else f"  anchor {name}: {a}")
    t = r["import_torch"]
    if t:
        lines.append(row("import torch", t))
        w = t["with_outofcuda"]
        lines.append(f"  after import torch: hook fired={w.get('fired')}, "
                     f"torch.cuda.is_initialized()={w.get('cuda_initialized')}"
                     + (f" error={w['error']}" if "error" in w else ""))
    return "\n".join(lines)


def markdown(paths):
    rs = [json.loads(Path(p).read_text()) for p in paths]
    cols = [f"{r['python']}" + ("" if r.get("torch") else " (no torch)") for r in rs]

    def cell(r, key, fmt="{ratio:.4f}"):
        d = r.get(key)
        return fmt.format(**d) if d and "ratio" in d else "-"

    def anchor(name):
        def cell_(r):
            a = r.get("anchors", {}).get(name, {})
            return f"{a['ratio']:.4f}" if "ratio" in a else "-"
        return cell_

    lines = ["# outofcuda start-up tax by CPython version", "",
             "`benchmarks/startup.py`, callgrind instructions of two venvs alike (paths of equal "
             "length), one with outofcuda; \"(no torch)\": torch in neither venv. Runs: "
             + ", ".join(f"{r['python']} {r['date']}" for r in rs) + ".", "",
             "| CPython | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(rs)]
    rows = [
        ("`python -c pass` instructions, without", lambda r: f"{r['pass']['without']:,}"),
        ("with outofcuda", lambda r: f"{r['pass']['with']:,}"),
        ("**ratio** (target <= 1.020)", lambda r: f"**{r['pass']['ratio']:.4f}**"),
        ("ratio over a venv with a comment-only `.pth`", lambda r: (
            f"{r['pass']['with'] / r['anchors']['comment-only .pth']['with']:.4f}"
            if "ratio" in r.get("anchors", {}).get("comment-only .pth", {}) else "-")),
        ("with `OUTOFCUDA_DISABLE=1`", lambda r: cell(r, "pass_disabled")),
        (f"without byte-code (target <= {NO_BYTECODE_TARGET})",
         lambda r: cell(r, "pass_no_bytecode")),
        ("`import outofcuda` / `pass` (target <= 1.10)", lambda r: cell(r, "import_outofcuda")),
        ("finder, instructions per import", lambda r: (
            f"{r['finder_per_import']['per_import']:.0f} over "
            f"{r['finder_per_import']['modules_imported']} imports")),
        ("`import torch` ratio (target <= 1.005)", lambda r: cell(r, "import_torch", "{ratio:.5f}")),
        ("anchor: a comment-only `.pth` (site's own floor)", anchor("comment-only .pth")),
        ("anchor: setuptools `distutils-precedence.pth`", anchor("distutils-precedence.pth")),
    ]
    for label, fn in rows:
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in rs) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter the new venvs are made from (default: this one)")
    ap.add_argument("--with-venv", help="reuse: a venv holding outofcuda, torch, numpy")
    ap.add_argument("--without-venv", help="reuse: the same venv without outofcuda")
    ap.add_argument("--wheel", help="outofcuda wheel to install (default: build this checkout)")
    ap.add_argument("--workdir", help="where to create venvs (default: a temporary folder)")
    ap.add_argument("--torch-spec", default="torch==2.13.0", help="torch to install in new venvs")
    ap.add_argument("--runs", type=int, default=21, help="wall-clock runs without valgrind (>= 3)")
    ap.add_argument("--wall-runs", type=int, default=0,
                    help="also time `import torch` in this many alternating runs")
    ap.add_argument("--repeats", type=int, default=3, help="callgrind runs per side (>= 1)")
    ap.add_argument("--skip-torch", action="store_true", help="venvs without torch")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    ap.add_argument("--markdown", nargs="+", metavar="FILE",
                    help="write a table of the result files (first the output, then inputs)")
    args = ap.parse_args(argv)
    if args.markdown:
        if len(args.markdown) < 2:
            ap.error("--markdown OUT.md RESULT.json [RESULT.json ...]")
        Path(args.markdown[0]).write_text(markdown(args.markdown[1:]))
        print(Path(args.markdown[0]).read_text())
        return 0
    if args.runs < 3:
        ap.error("--runs must be at least 3")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="oc-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    if not args.workdir:
        # Two environments with torch: about 2 GB each, of no use once measured.
        atexit.register(shutil.rmtree, work, True)
    torch_spec = None if args.skip_torch else args.torch_spec
    # Paths of equal length: site's work and the recorded file names cost the same.
    if args.with_venv:
        py_with = venv_python(args.with_venv)
    else:
        wheel = args.wheel or build_wheel(work)
        py_with = venv_python(make_venv(args.python, work / "with", torch_spec, wheel))
    py_without = venv_python(args.without_venv or make_venv(args.python, work / "none",
                                                            torch_spec))
    if len(py_with) != len(py_without):
        print(f"note: venv paths differ in length ({py_with}, {py_without})", file=sys.stderr)
    if not has_outofcuda(py_with):
        ap.error(f"{py_with}: outofcuda_hook.pth not installed there")
    if has_outofcuda(py_without):
        ap.error(f"{py_without}: outofcuda is installed there; it must not be")
    has_torch = (site_dir(py_with) / "torch").is_dir()
    version = subprocess.run([py_with, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": version, "machine": platform.machine() + " " + platform.node(),
        "with_python": py_with, "without_python": py_without, "torch": has_torch,
    }
    result.update(measure(py_with, py_without, args.runs, args.repeats,
                          args.skip_torch or not has_torch, args.wall_runs))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if args.json else text_report(result))
    checks = [result["pass"].get("within_ceiling", result["pass"]["ok"])] + [result[k]["ok"] for k in
                                       ("pass_no_bytecode", "import_outofcuda", "import_torch")
                                       if result.get(k) and "ok" in result[k]]
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
