"""GPU checks for the power-user API (run on an H200 by benchmarks/gpu_check.sh).

Each scenario runs in a fresh interpreter from the built wheel. Skips cleanly
where there is no NVIDIA GPU or torch cannot use CUDA."""
import textwrap

import pytest

from gpu import size
from kit import last_json

GIB = float(1 << 30)


def test_memory_report_matches_torch_and_nvml(gpu, workdir):
    r = gpu.check("""
        import json, torch, outofcuda, _outofcuda
        before = outofcuda.memory_report()
        init_after_report = torch.cuda.is_initialized()
        x = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")   # 3 GiB
        y = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del y                                                         # peak > current
        torch.cuda.synchronize()
        rep = outofcuda.memory_report()["cuda:0"]
        idx = rep["nvml_index"]
        nv = [d for d in _outofcuda.nvml_devices()[0] if d["index"] == idx][0]
        free, total = torch.cuda.mem_get_info(0)
        print(json.dumps({
            "before": before, "init_after_report": init_after_report, "rep": rep,
            "allocated": torch.cuda.memory_allocated(0), "reserved": torch.cuda.memory_reserved(0),
            "peak": torch.cuda.max_memory_allocated(0), "nv_total": nv["total"],
            "nv_free": nv["free"], "cuda_free": free, "cuda_total": total,
            "props_total": torch.cuda.get_device_properties(0).total_memory,
            "name": torch.cuda.get_device_name(0)}))
    """, cwd=workdir)
    d = last_json(r)
    rep = d["rep"]
    # Before CUDA initialised: NVML figures only, and no context created.
    assert d["init_after_report"] is False
    assert d["before"]["cuda:0"]["allocated_gb"] == 0.0
    assert d["before"]["cuda:0"]["total_gb"] == rep["total_gb"]
    assert rep["name"] == d["name"]
    # Rounded to 0.001 GiB.
    assert abs(rep["allocated_gb"] - d["allocated"] / GIB) <= 0.001
    assert abs(rep["reserved_gb"] - d["reserved"] / GIB) <= 0.001
    assert abs(rep["peak_allocated_gb"] - d["peak"] / GIB) <= 0.001
    assert rep["peak_allocated_gb"] >= rep["allocated_gb"] + 0.99
    assert abs(rep["allocated_gb"] - 3.0) <= 0.01
    assert abs(rep["total_gb"] - d["nv_total"] / GIB) <= 0.001
    # NVML counts the whole board; CUDA's total leaves out what the driver
    # keeps (480 MiB of an H100's 81559 MiB, driver 580): never more, and
    # within 1 %.
    assert 0 <= rep["total_gb"] - d["cuda_total"] / GIB <= 0.01 * rep["total_gb"]
    # Free memory moves with other processes: NVML and CUDA within 0.5 GiB.
    assert abs(rep["free_gb"] - d["nv_free"] / GIB) <= 0.5
    assert abs(rep["free_gb"] - d["cuda_free"] / GIB) <= 0.5
    assert rep["total_gb"] > 100       # an H200 has about 140 GB


def test_memory_report_lists_this_process(gpu, workdir):
    """The real driver's process list read through outofcuda's entry-layout
    inference: this process, holding 3 GiB, is listed with its name."""
    r = gpu.check("""
        import json, os, torch, outofcuda, _outofcuda
        x = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        rep = outofcuda.memory_report()["cuda:0"]
        print(json.dumps({"procs": rep["processes"], "pid": os.getpid(),
                          "raw": _outofcuda.nvml_processes(rep["nvml_index"]),
                          "comm": open("/proc/self/comm").read().strip()}))
    """, cwd=workdir)
    d = last_json(r)
    procs = d["procs"]
    assert procs is not None, "NVML could not list the processes of this GPU"
    assert len(procs) == len(d["raw"])
    for p in procs:      # plausible entries: a wrong entry size reads garbage
        assert 0 < p["pid"] <= 4194304 and (p["used_gb"] is None or p["used_gb"] < 1000), p
    mine = [p for p in procs if p["this_process"]]
    if not mine:
        pytest.skip(f"NVML lists {len(procs)} process(es), none with this pid {d['pid']} "
                    "(another pid namespace): this process's entry unverified")
    assert len(mine) == 1 and mine[0]["name"] == d["comm"]
    assert mine[0]["used_gb"] is None or mine[0]["used_gb"] >= 3.0, mine


def test_clear_cache_returns_the_bytes_released(gpu, workdir):
    r = gpu.check("""
        import json, torch, outofcuda
        x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        del x
        held = torch.cuda.memory_reserved()
        released = outofcuda.clear_cache()
        print(json.dumps([held, released, torch.cuda.memory_reserved()]))
    """, cwd=workdir)
    held, released, after = last_json(r)
    assert held >= 2 << 30
    assert released == held - after and released >= 2 << 30


def test_monitor_crosses_a_provoked_threshold_clears_and_records(gpu, workdir):
    r = gpu.check("""
        import json, time, torch, outofcuda, _outofcuda
        from outofcuda import MemoryMonitor
        torch.cuda.init()
        torch.empty(1, device="cuda")                 # context exists before measuring
        idx = outofcuda.memory_report()["cuda:0"]["nvml_index"]
        nv = [d for d in _outofcuda.nvml_devices()[0] if d["index"] == idx][0]
        threshold = (nv["used"] + (2 << 30)) / nv["total"]   # 2 GiB above now
        x = torch.empty(HELD, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        del x                                         # 4 GiB stays reserved in the cache
        calls = []
        mon = MemoryMonitor(threshold=threshold, interval=0.05, on_high=calls.append,
                            allocator_stats=True)
        with mon:
            end = time.monotonic() + WAIT             # a dry run has no threshold to cross
            while not mon.events and time.monotonic() < end:
                time.sleep(0.05)
            time.sleep(0.3)
        samples = mon.samples()
        ev = mon.events
        print(json.dumps({"threshold": threshold, "events": ev, "calls": len(calls),
                          "reserved_after": torch.cuda.memory_reserved(),
                          "max_sample_reserved": max((s.reserved or 0) for s in samples),
                          "n": len(samples), "csv_rows": mon.to_csv("vram.csv")}))
    """.replace("HELD", str(size(4 << 30, 4 << 20))).replace("WAIT", str(size(10, 1))),
        cwd=workdir, timeout=180)
    d = last_json(r)
    assert d["n"] > 5
    assert d["events"], "the watchdog never saw the threshold crossed"
    e = d["events"][0]
    assert e["kind"] == "high" and e["fraction"] >= d["threshold"]
    assert e["released"] >= 3.5 * GIB                 # the 4 GiB went back to the driver
    assert 0 <= e["used_after"] < e["used"]
    assert d["calls"] == len([x for x in d["events"] if x["kind"] == "high"])
    assert d["reserved_after"] < 0.5 * GIB
    assert d["max_sample_reserved"] >= 4 * GIB        # allocator_stats=True
    assert d["csv_rows"] == d["n"]


def test_monitor_plot_of_a_gpu_timeline_is_a_png(gpu, workdir):
    """Its own test, so a missing matplotlib skips only this check."""
    # No PYTHONPATH: finding matplotlib needs no torch, which the dry run's
    # stand-ins would import.
    if gpu.run("import importlib.util, sys; "
               "sys.exit(importlib.util.find_spec('matplotlib') is None)",
               env={"PYTHONPATH": ""}).returncode != 0:
        pytest.skip("matplotlib is not installed: the PNG check did not run "
                    "(pip install matplotlib in the test environment)")
    r = gpu.check("""
        import json, time, torch
        from outofcuda import MemoryMonitor
        torch.empty(1, device="cuda")
        mon = MemoryMonitor(interval=0.02, allocator_stats=True).start()
        x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        end = time.monotonic() + 10
        while len(mon.samples()) < 5 and time.monotonic() < end:
            time.sleep(0.02)
        mon.stop()
        mon.plot("vram.png")
        print(json.dumps({"n": len(mon.samples()),
                          "png": open("vram.png", "rb").read(8).hex()}))
    """, cwd=workdir, timeout=120)
    d = last_json(r)
    assert d["n"] >= 5
    assert d["png"] == "89504e470d0a1a0a"          # PNG signature


AUTOCAST = textwrap.dedent("""
    import json, threading, torch, outofcuda, _outofcuda
    lin = torch.nn.Linear(64, 64, device="cuda")
    x = torch.randn(8, 64, device="cuda")
    with outofcuda.autocast_context() as ctx:
        main = str(lin(x).dtype)
    seen = []
    def worker():        # torch's autocast dtype is thread-local
        with outofcuda.autocast_context():
            seen.append(str(lin(x).dtype))
    t = threading.Thread(target=worker)
    t.start(); t.join()
    print(json.dumps([main, seen[0], _outofcuda.status()["optimizations"]["amp_dtype"],
                      list(_outofcuda._api_autocast_dtype("cuda"))]))
""")


def test_autocast_context_picks_bfloat16_on_an_h200(gpu, workdir):
    main, thread, hook, decision = last_json(gpu.check(AUTOCAST, cwd=workdir))
    assert main == "torch.bfloat16" and thread == "torch.bfloat16"
    assert hook["applied"] is True and hook["value"] == "bfloat16"
    assert decision[0] == "bfloat16"


def test_autocast_without_the_hook_decides_from_nvml(gpu, workdir):
    # OUTOFCUDA_DISABLE: the hook does nothing; the API still reads the
    # compute capability from NVML (9.0 on an H200).
    main, thread, hook, decision = last_json(gpu.check(AUTOCAST, cwd=workdir,
                                                   env={"OUTOFCUDA_DISABLE": "1"}))
    assert main == "torch.bfloat16" and thread == "torch.bfloat16"
    assert hook["applied"] is False
    assert decision[0] == "bfloat16" and "9.0" in decision[1]


def test_autocast_follows_outofcuda_amp_dtype(gpu, workdir):
    main, thread, _, decision = last_json(gpu.check(AUTOCAST, cwd=workdir,
                                                env={"OUTOFCUDA_AMP_DTYPE": "float16"}))
    assert main == thread == "torch.float16"
    assert decision == ["float16", "OUTOFCUDA_AMP_DTYPE=float16"]
