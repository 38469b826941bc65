"""The benchmarks run here as a CPU smoke test and produce well-formed output."""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

GAIN_KEYS = {"workload", "config", "steps_per_s", "samples_per_s", "rates", "flops_per_step",
             "tflops", "fraction_of_peak", "precision", "peak_allocated_bytes",
             "nvml_used_bytes", "notes", "hook_fired", "device", "cuda", "speedup_vs_defaults"}


def test_bench_cpu_smoke(venv, workdir):
    out = workdir / "res"
    r = venv.run(None, args=["-m", "outofcuda", "bench", "--benchmarks-dir",
                             str(ROOT / "benchmarks"), "--out", str(out)],
                 cwd=workdir, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPU gains were NOT measured" in r.stdout
    d = json.loads((out / "gain.json").read_text())
    assert d["mode"] == "cpu-smoke" and d["gpu_gains_measured"] is False
    assert d["seconds"] < 120
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
    assert "**GPU gains were not measured**" in md
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert table[0].startswith("| workload | config | steps/s")
    assert len(table) == 1 + 21


def test_bench_unknown_workload_is_an_error(venv, workdir):
    r = venv.run(None, args=[str(ROOT / "benchmarks" / "gain.py"), "--workloads", "nope"],
                 cwd=workdir)
    assert r.returncode == 2 and "unknown workload" in r.stderr


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind not installed")
def test_startup_pass_ratio(venv, workdir):
    bare = workdir / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    out = workdir / "startup.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "startup.py"), "--with-venv",
                        str(venv.path), "--without-venv", str(bare), "--skip-torch",
                        "--repeats", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 1), r.stderr
    d = json.loads(out.read_text())
    p = d["pass"]
    assert p["method"] == "callgrind instructions"
    assert p["with"] > p["without"] > 10_000_000
    assert p["ratio"] == p["with"] / p["without"]
    assert p["ok"] == (p["ratio"] <= 1.015)
    assert "python -c pass" in r.stdout and d["import_torch"] is None
