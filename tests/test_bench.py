"""The benchmarks run here as a CPU smoke test and produce well-formed output."""
import json
import os
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
    # The timeout only guards against a hang: no test asserts how fast this
    # machine is.
    r = venv.run(None, args=["-m", "outofcuda", "bench", "--benchmarks-dir",
                             str(ROOT / "benchmarks"), "--out", str(out)],
                 cwd=workdir, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPU gains were NOT measured" in r.stdout
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
    assert all(row["speedup_vs_defaults"] == 1.0 for row in rows if row["config"] == "defaults")
    md = (out / "gain.md").read_text()
    assert "**GPU gains were not measured**" in md
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert table[0].startswith("| workload | config | steps/s")
    assert len(table) == 1 + 21


def test_bench_unknown_workload_is_an_error(venv, workdir):
    r = venv.run(None, args=[str(ROOT / "benchmarks" / "gain.py"), "--workloads", "nope"],
                 cwd=workdir)
    assert r.returncode == 2 and "unknown workload" in r.stderr


def test_bench_without_benchmarks_dir(venv, workdir):
    r = venv.run(None, args=["-m", "outofcuda", "bench", "--json", "--benchmarks-dir",
                             str(workdir)], cwd=workdir)
    assert r.returncode == 1
    assert "gain.py not found" in json.loads(r.stdout)["error"]


def test_startup_pass_ratio(venv, workdir):
    if shutil.which("valgrind") is None:
        if os.environ.get("CI"):
            pytest.fail("valgrind is required in CI (apt-get install valgrind)")
        pytest.skip("valgrind is not installed (apt-get install valgrind)")
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
