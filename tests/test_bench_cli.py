"""`outofcuda bench` from an installed copy: the console script of the test
environment, run from a folder outside the checkout, with no benchmarks/
folder anywhere it could look."""
import json
import subprocess

from conftest import ROOT, _clean_env

WORKLOADS = "mlp,cnn_fp32"


def _outofcuda(venv):
    return str(venv.path / "bin" / "outofcuda")


def test_bench_smoke_runs_from_an_installed_copy(venv, workdir):
    out = workdir / "res"
    # The workers run where the user stands; a torch.py there must not be imported.
    (workdir / "torch.py").write_text("raise SystemExit('the stray torch.py was imported')\n")

    def bench(*extra):
        return subprocess.run([_outofcuda(venv), "bench", "--smoke", "--workloads", WORKLOADS,
                               *extra], cwd=workdir, env=_clean_env(), capture_output=True,
                              text=True, timeout=300)

    r = bench("--json", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    d = json.loads(r.stdout)
    assert d["mode"] == "cpu-smoke" and d["gpu_gains_measured"] is False
    assert d["sizes"]["repeats"] == 1
    rows = d["rows"]
    assert [(row["workload"], row["config"]) for row in rows] == [
        (w, c) for w in WORKLOADS.split(",") for c in ("defaults", "outofcuda", "expert")]
    for row in rows:
        assert row["steps_per_s"] > 0 and row["device"] == "cpu"
        # One step, one repeat: a ratio would be noise, so there is none.
        assert row["speedup_vs_defaults"] is None, row
    assert {row["config"]: row["hook_fired"] for row in rows} == {
        "defaults": False, "outofcuda": True, "expert": False}
    assert json.loads((out / "gain.json").read_text())["rows"] == rows
    # The text form is tests/test_bench.py's test_bench_cpu_smoke.


def test_bench_table_keeps_to_80_columns_with_ratios_only_on_gpu_sizes(venv, workdir):
    r = venv.check("""
        import json
        from outofcuda import bench
        rows = [{"workload": w, "config": c, "steps_per_s": 1234.5, "samples_per_s": 1e9,
                 "rates": [1.0] * 3, "tflops": 987.6, "fraction_of_peak": 0.99,
                 "precision": "bf16", "peak_allocated_bytes": 140 << 30,
                 "nvml_used_bytes": 141 << 30} for w in bench.WORKLOADS for c in bench.CONFIGS]
        rows[1] = {"workload": "gpt_fp32", "config": "outofcuda", "error": "E" * 500}
        bench._ratios(rows)
        out = {}
        for mode in ("gpu", "cpu-smoke"):
            res = {"mode": mode, "gpu_gains_measured": False, "gpu": "NVIDIA H200",
                   "torch": "2.11.0", "cuda": "13.0", "rows": rows}
            lines = bench.text(res).splitlines()
            out[mode] = {"width": max(map(len, lines)),
                         "head": next(ln for ln in lines if ln.startswith("workload")).split()}
        print(json.dumps(out))
    """, cwd=workdir)
    d = json.loads(r.stdout)
    assert d["gpu"]["width"] <= 80 and d["cpu-smoke"]["width"] <= 80, d
    assert "vs" in d["gpu"]["head"] and "TFLOP/s" in d["gpu"]["head"], d
    assert d["cpu-smoke"]["head"] == ["workload", "config", "ms/step"], d


def test_bench_ratios_only_where_repeats_make_them_mean_something(venv, workdir):
    r = venv.check("""
        import json
        from outofcuda import bench
        def row(config, sps, repeats, workload="mlp"):
            return {"workload": workload, "config": config, "steps_per_s": sps,
                    "rates": [sps] * repeats}
        rows = [row("defaults", 10.0, 3), row("outofcuda", 15.0, 3), row("expert", 12.0, 2),
                row("defaults", 4.0, 1, "cnn"), row("outofcuda", 8.0, 5, "cnn")]
        bench._ratios(rows)
        print(json.dumps([r["speedup_vs_defaults"] for r in rows]))
    """, cwd=workdir)
    assert json.loads(r.stdout) == [1.0, 1.5, None, None, None]


def test_bench_startup_without_a_checkout_fails_fast(venv, workdir):
    r = venv.run(None, args=["-m", "outofcuda", "bench", "--startup", "--json",
                             "--benchmarks-dir", str(workdir)], cwd=workdir, timeout=60)
    assert r.returncode == 1
    err = json.loads(r.stdout)["error"]
    assert "startup.py not found" in err
    assert not (workdir / "bench-results").exists()   # the gain benchmark did not start
    assert "startup.py not found" in r.stderr
    text = venv.run(None, args=["-m", "outofcuda", "bench", "--startup", "--benchmarks-dir",
                                str(workdir)], cwd=workdir, timeout=60)
    assert text.returncode == 1 and text.stdout == ""   # an error goes to stderr
    assert text.stderr.startswith("outofcuda bench: --startup: benchmarks/startup.py not found")


def test_gain_script_in_the_checkout_is_the_packaged_benchmark(venv, workdir):
    r = venv.run(None, args=[str(ROOT / "benchmarks" / "gain.py"), "--workloads", "nope"],
                 cwd=workdir)
    assert r.returncode == 2 and "unknown workload" in r.stderr
    assert "mlp" in r.stderr   # the package's workload list
    r = venv.check("import outofcuda.bench as b, pathlib; print(pathlib.Path(b.__file__).parent)",
                   cwd=workdir)
    assert r.stdout.strip() == str(venv.site / "outofcuda")


def test_one_usage_line_for_help_and_for_a_bad_argument(venv, workdir):
    """--help and a bad workload (or timeout) show the same usage line: the
    one of `outofcuda bench`, naming --startup and --benchmarks-dir."""
    def usage(*args):
        r = subprocess.run([_outofcuda(venv), "bench", *args], cwd=workdir, env=_clean_env(),
                           capture_output=True, text=True, timeout=120)
        text = r.stdout if "--help" in args else r.stderr
        # the usage block, however it wraps (argparse's error follows it)
        block = text.split("\n\n")[0].split("outofcuda bench: error:")[0]
        return r.returncode, " ".join(block.split())

    rc_help, shown = usage("--help")
    assert rc_help == 0 and "--startup" in shown and "--benchmarks-dir" in shown, shown
    for bad in (("--workloads", "nope"), ("--timeout", "0")):
        rc, after = usage(*bad)
        assert rc == 2 and after == shown, (bad, after)
