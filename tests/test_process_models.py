"""The hook under every way Python starts processes and threads: multiprocessing
(fork, spawn, forkserver), DataLoader workers, torchrun with DDP on gloo,
threads importing torch at once, a subinterpreter, and a MemoryMonitor
interrupted by Ctrl-C or left running at interpreter exit.

"The hook is active" is observed twice in each child: _outofcuda.status()
says it fired, and it holds the bridge's decision for cuDNN (on this CPU-only
build: torch's default kept, as there is no CUDA), which only the torch
callback writes."""
import json
import re
import textwrap

import pytest

from kit import CHILD

PROBE = """
import json, os, sys
def probe(tag=None):
    import torch, _outofcuda
    st = _outofcuda.status()
    return {"tag": tag, "pid": os.getpid(), "fired": st["hook"]["fired"],
            "error": st["hook"]["error"],
            "decided": st["optimizations"]["cudnn_benchmark"]["code"] == "no_cuda"}
"""


def _script(workdir, name, body):
    path = workdir / name
    path.write_text(textwrap.dedent(PROBE) + textwrap.dedent(body))
    return path


def _assert_hooked(results, n):
    assert len(results) == n, results
    for r in results:
        assert r["fired"] is True and r["decided"] is True and r["error"] is None, r


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("parent_imported_torch", [False, True], ids=["lazy", "parent-torch"])
def test_multiprocessing_children_see_the_hook(venv, workdir, method, parent_imported_torch):
    path = _script(workdir, "mp_scenario.py", f"""
        import multiprocessing as mp
        if __name__ == "__main__":
            if {parent_imported_torch}:
                import torch
            ctx = mp.get_context("{method}")
            with ctx.Pool(2) as pool:
                res = pool.map(probe, range(4))
            assert len({{r["pid"] for r in res}} - {{os.getpid()}}) >= 1
            print(json.dumps(res))
    """)
    r = venv.check(None, args=[str(path)], cwd=workdir, timeout=180)
    _assert_hooked(json.loads(r.stdout), 4)
    assert "Traceback" not in r.stderr, r.stderr


def test_dataloader_workers(venv, workdir):
    path = _script(workdir, "dl_scenario.py", """
        import torch
        from torch.utils.data import DataLoader, Dataset, get_worker_info
        class D(Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                # The probe as JSON text: default_collate batches strings, so
                # every field, "error" included, comes back as the worker saw it.
                return json.dumps(probe(get_worker_info().id))
        if __name__ == "__main__":
            rows = [json.loads(s) for b in DataLoader(D(), batch_size=2, num_workers=2) for s in b]
            print(json.dumps([dict(r, worker=r["tag"]) for r in rows]))
    """)
    r = venv.check(None, args=[str(path)], cwd=workdir, timeout=180)
    res = json.loads(r.stdout)
    _assert_hooked(res, 8)
    assert {x["worker"] for x in res} == {0, 1}
    assert len({x["pid"] for x in res}) == 2


def test_torchrun_ddp_on_gloo(venv, workdir):
    path = _script(workdir, "ddp_scenario.py", """
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        w = model.module.weight.detach().clone()
        ws = [torch.zeros_like(w) for _ in range(dist.get_world_size())]
        dist.all_gather(ws, w)
        res = probe(rank)
        res["in_sync"] = all(torch.equal(ws[0], x) for x in ws)
        res["local_rank"] = os.environ["LOCAL_RANK"]
        with open(f"rank{rank}.json", "w") as f:
            json.dump(res, f)
        # torch 2.13's gloo teardown (destroy_process_group and exit) aborts
        # now and then with "terminate called without an active exception",
        # with outofcuda disabled too: each rank leaves once its result is
        # written, so the test checks outofcuda, not that teardown.
        dist.barrier()
        os._exit(0)
    """)
    # The verbose table and a warning (a word OUTOFCUDA_SUMMARY does not
    # know) in every process, the launcher's included.
    r = venv.run(None, args=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(path)], cwd=workdir, timeout=240,
                 env={"OUTOFCUDA_VERBOSE": "1", "OUTOFCUDA_SUMMARY": "maybe",
                      "TMPDIR": str(workdir)})  # torchrun's torchelastic_* log folders
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = [json.loads((workdir / f"rank{i}.json").read_text()) for i in range(2)]
    _assert_hooked(res, 2)
    assert [x["local_rank"] for x in res] == ["0", "1"]
    assert all(x["in_sync"] for x in res), "DDP replicas diverged"
    # Every line outofcuda printed says who printed it; the launcher runs no
    # model and prints no table, only its own warning.
    ours = [line for line in r.stderr.splitlines() if "outofcuda" in line]
    labels = [re.search(r"\[(rank \d+|launcher)\] outofcuda", line) for line in ours]
    tables = [line for line in ours if re.search(r"outofcuda \S+: torch \S+ imported", line)]
    warned = [m.group(1) for m, line in zip(labels, ours) if m and "OUTOFCUDA_SUMMARY" in line]
    assert sorted(line.split("]")[0] for line in tables) == ["[rank 0", "[rank 1"], r.stderr
    assert sorted(warned) == ["launcher", "rank 0", "rank 1"], r.stderr
    heads = [line for line in r.stderr.splitlines() if re.search(r"optimisation +applied", line)]
    assert sorted(line.split("]")[0] for line in heads) == ["[rank 0", "[rank 1"], r.stderr


def test_threads_import_torch_concurrently_fire_once(venv, workdir):
    r = venv.check("""
        import threading, json
        barrier = threading.Barrier(8)
        seen, errors = [], []
        def worker():
            try:
                barrier.wait()
                import torch, _outofcuda
                seen.append(_outofcuda.status()["hook"]["fired"])
            except BaseException as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join(120)
        import _outofcuda
        print(json.dumps({"seen": seen, "errors": errors, "hook": _outofcuda.status()["hook"]}))
    """, env={"OUTOFCUDA_VERBOSE": "1"}, cwd=workdir, timeout=180)
    out = json.loads(r.stdout)
    assert out["errors"] == [] and out["seen"] == [True] * 8
    assert out["hook"] == {"installed": True, "fired": True, "error": None}
    # The verbose report prints once per firing of the callback.
    assert r.stderr.count("outofcuda 0.3.0: torch") == 1, r.stderr


def test_subinterpreter_refused_cleanly(venv, workdir):
    r = venv.check("""
        import json, os, sys, tempfile
        try:
            import _interpreters as interpreters            # 3.13+
        except ImportError:
            import _xxsubinterpreters as interpreters       # 3.9 - 3.12
        out = tempfile.mktemp(dir=".")
        code = f'''
        try:
            import _outofcuda
            result = "imported"
        except ImportError as e:
            result = "ImportError: " + str(e)
        except BaseException as e:
            result = "other: " + repr(e)
        with open({out!r}, "w") as f:
            f.write(result)
        '''
        import textwrap
        interp = interpreters.create()
        run = getattr(interpreters, "run_string", None) or interpreters.exec
        run(interp, textwrap.dedent(code))
        interpreters.destroy(interp)
        with open(out) as f:
            result = f.read()
        import torch, _outofcuda
        print(json.dumps({"sub": result, "hook": _outofcuda.status()["hook"],
                          "decided": _outofcuda.status()["optimizations"]["sdpa"]["code"]
                          == "no_cuda"}))
    """, cwd=workdir, timeout=120)
    out = json.loads(r.stdout)
    assert out["sub"].startswith("ImportError: ") and "main interpreter" in out["sub"], out
    assert out["hook"]["fired"] is True and out["decided"] is True
    assert "Traceback" not in r.stderr and "Error processing line" not in r.stderr, r.stderr


MONITOR_PRELUDE = CHILD + """
import json, threading
guard(40)
import torch, outofcuda
src = os.path.abspath("mem.txt")
with open(src, "w") as f:
    f.write("900 1000 10\\n")                 # 90 % used: above the threshold
events = []
# _source feeds the watchdog a file instead of NVML, so on a machine without
# a GPU its thread really polls and calls on_high.
kw = {"_source": src}
base = threads()
"""


def _monitor_run(venv, workdir, body):
    return venv.run(MONITOR_PRELUDE + textwrap.dedent(body), cwd=workdir,
                    env={"PYTHONWARNINGS": "ignore::RuntimeWarning"}, timeout=60)


def test_keyboard_interrupt_while_monitor_runs(venv, workdir):
    r = _monitor_run(venv, workdir, """
        try:
            with outofcuda.MemoryMonitor(threshold=0.85, interval=0.05,
                                         on_high=events.append, cooldown=0, **kw) as mon:
                need(lambda: len(events) >= 1, "the watchdog to act")
                os.kill(os.getpid(), signal.SIGINT)
                need(lambda: False, "SIGINT to arrive as KeyboardInterrupt")
        except KeyboardInterrupt:
            need(lambda: threads() == base, "the watchdog thread to end")
            print(json.dumps({"interrupted": True, "running": mon.running,
                              "extra_threads": threads() - base, "events": len(events)}))
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["interrupted"] and out["running"] is False
    assert out["extra_threads"] == 0, "the watchdog thread was not joined"
    assert out["events"] >= 1, "the watchdog never acted before the interrupt"
    assert "Fatal Python error" not in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("how", ["end_of_script", "sys_exit", "uncaught_error"])
def test_shutdown_with_monitor_running(venv, workdir, how):
    ending = {"end_of_script": "pass", "sys_exit": "raise SystemExit(3)",
              "uncaught_error": "raise ValueError('boom')"}[how]
    r = _monitor_run(venv, workdir, f"""
        mon = outofcuda.MemoryMonitor(threshold=0.85, interval=0.05, on_high=events.append,
                                      cooldown=0, **kw)
        mon.start()
        need(lambda: len(events) >= 1, "the watchdog to act")
        assert mon.running
        print(json.dumps({{"events": len(events)}}), flush=True)
        {ending}
    """)
    expected = {"end_of_script": 0, "sys_exit": 3, "uncaught_error": 1}[how]
    assert r.returncode == expected, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.splitlines()[0])
    assert out["events"] >= 1
    assert "Fatal Python error" not in r.stderr and "Segmentation" not in r.stderr, r.stderr
    if how == "uncaught_error":
        assert r.stderr.rstrip().endswith("ValueError: boom"), r.stderr
    else:
        assert r.stderr == "", r.stderr
