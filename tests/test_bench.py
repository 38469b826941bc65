"""The benchmarks run here as a CPU smoke test and produce well-formed output."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, wait_for_setup

GAIN_KEYS = {"workload", "config", "steps_per_s", "samples_per_s", "rates", "flops_per_step",
             "tflops", "fraction_of_peak", "precision", "peak_allocated_bytes",
             "nvml_used_bytes", "notes", "hook_fired", "device", "cuda", "speedup_vs_defaults"}


def test_bench_cpu_smoke(venv, workdir):
    out = workdir / "res"
    # The timeout only guards against a hang: no test asserts how fast this
    # machine is.
    r = venv.run(None, args=["-m", "outofcuda", "bench", "--benchmarks-dir",
                             str(ROOT / "benchmarks"), "--out", str(out)],
                 cwd=workdir, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "This run measured NO GPU gains" in r.stdout
    # The one GPU run so far is named, not "never measured".
    assert "2f7a4db" in r.stdout and "H100" in r.stdout
    (head,) = [ln for ln in r.stdout.splitlines() if ln.startswith("workload ")]
    assert head.split() == ["workload", "config", "ms/step"], head
    assert max(map(len, r.stdout.splitlines() + r.stderr.splitlines())) <= 80
    assert "vs defaults" not in r.stdout
    assert not re.search(r"\d\.\d\dx", r.stdout), r.stdout
    assert "(no PNG: no ratios to draw)" in r.stdout
    assert not (out / "gain.png").exists()
    d = json.loads((out / "gain.json").read_text())
    assert d["mode"] == "cpu-smoke" and d["gpu_gains_measured"] is False
    assert d["seconds"] > 0
    rows = d["rows"]
    assert len(rows) == 7 * 3
    for row in rows:
        assert set(row) == GAIN_KEYS, row
        assert row["steps_per_s"] > 0 and row["flops_per_step"] > 0
        assert row["device"] == "cpu"
    fired = {row["config"]: row["hook_fired"] for row in rows}
    assert fired == {"defaults": False, "outofcuda": True, "expert": False}
    # One step, one repeat: no ratios (tests/test_bench_cli.py checks where they appear).
    assert all(row["speedup_vs_defaults"] is None for row in rows)
    md = (out / "gain.md").read_text()
    assert "**This run measured no GPU gains**" in md
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    # Smoke sizes: the times only, no ratio and no GPU column.
    assert table[0] == "| workload | config | ms/step |"
    assert len(table) == 1 + 21
    # A progress line per workload run, as each finishes (stderr).
    progress = [ln for ln in r.stderr.splitlines() if ln.startswith("outofcuda bench: [")]
    assert [ln.split("]")[0] for ln in progress] == [f"outofcuda bench: [{i}/21"
                                                      for i in range(1, 22)], r.stderr


def test_bench_unknown_workload_is_an_error(venv, workdir):
    r = venv.run(None, args=[str(ROOT / "benchmarks" / "gain.py"), "--workloads", "nope"],
                 cwd=workdir)
    assert r.returncode == 2 and "unknown workload" in r.stderr


def test_startup_pass_ratio(wheel, workdir):
    """Two fresh venvs alike (paths of equal length), one with the wheel, under
    callgrind: instruction counts are deterministic, so a start-up regression
    past the ceiling fails here (this is not a wall-clock assert)."""
    wait_for_setup("tools")
    if shutil.which("valgrind") is None:
        if os.environ.get("CI"):
            pytest.fail("valgrind is required in CI (apt-get install valgrind)")
        pytest.skip("valgrind is not installed (apt-get install valgrind)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import startup
    finally:
        sys.path.pop(0)
    out = workdir / "startup.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "startup.py"), "--wheel",
                        str(wheel), "--workdir", str(workdir / "v"), "--skip-torch",
                        "--repeats", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    p = d["pass"]
    assert p["method"] == "callgrind instructions" and p["without"] > 10_000_000
    assert len(d["with_python"]) == len(d["without_python"])
    assert p["ratio"] <= startup.PASS_CEILING, p
    assert d["pass_no_bytecode"]["ratio"] <= startup.NO_BYTECODE_TARGET
    assert d["pass_disabled"]["with"] <= p["with"]
    assert d["import_outofcuda"]["ratio"] <= startup.IMPORT_OUTOFCUDA_TARGET
    f = d["finder_per_import"]
    assert f["modules_imported"] > 150 and f["per_import"] < 10_000, f
    assert "python -c pass" in r.stdout and d["import_torch"] is None


def test_microbatch_benchmark_smoke(venv, workdir):
    """benchmarks/microbatch.py measures both loops and writes their ratios
    (the figures themselves are never asserted: the machine is shared)."""
    out = workdir / "mb.json"
    r = venv.run(None, args=[str(ROOT / "benchmarks" / "microbatch.py"), "--rounds", "2",
                             "--steps", "20", "--json", str(out)], cwd=workdir, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    for loop in ("fresh_gradients", "accumulating"):
        row = d[loop]
        assert row["bare_us"] > 0 and row["auto_microbatch_us"] > 0
        assert row["ratio"] == pytest.approx(row["auto_microbatch_us"] / row["bare_us"])
    bad = venv.run(None, args=[str(ROOT / "benchmarks" / "microbatch.py"), "--rounds", "0"],
                   cwd=workdir)
    assert bad.returncode == 2 and "--rounds and --steps must be at least 1" in bad.stderr
