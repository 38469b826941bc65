"""MemoryMonitor: the native watchdog thread's lifecycle, on a machine
without a GPU. The watchdog's memory source is NVML; where no GPU exists the
tests feed it from a file (`_source`, "used total process") so the real C
thread, its threshold logic, its GIL hand-off and its joins all run."""
import json
import textwrap

import pytest

PRELUDE = """
import json, os, sys, threading, time
import outofcuda
from outofcuda import MemoryMonitor
SRC = sys.argv[1] if len(sys.argv) > 1 else "src.txt"
def feed(used, total=1000, process=100):
    tmp = SRC + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{used} {total} {process}")
    os.replace(tmp, SRC)
def tasks():
    return len(os.listdir("/proc/self/task"))
def wait_for(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False
feed(100)
"""


def _script(body):
    return PRELUDE + textwrap.dedent(body)


def _run(venv, workdir, body, **kw):
    r = venv.check(_script(body), cwd=workdir, **kw)
    return r, json.loads(r.stdout.strip().splitlines()[-1])


def test_arguments_are_validated(venv, workdir):
    _, errs = _run(venv, workdir, """
        cases = [dict(threshold=0), dict(threshold=1.5), dict(threshold=-0.1),
                 dict(threshold=float("nan")), dict(interval=0), dict(interval=-1),
                 dict(device="cpu"), dict(device=-1), dict(cooldown=-1), dict(capacity=0),
                 dict(threshold="high"), dict(on_high=42), dict(allocator_stats=1)]
        out = []
        for kw in cases:
            try:
                MemoryMonitor(**kw)
                out.append(None)
            except (ValueError, TypeError) as e:
                out.append([type(e).__name__, str(e)])
        ok = MemoryMonitor(threshold=1.0, interval=0.5, device="cuda:1")
        out.append([ok.threshold, ok.interval, ok.device])
        print(json.dumps(out))
    """)
    kinds = [e[0] if e else None for e in errs[:-1]]
    assert kinds[:10] == ["ValueError"] * 10
    assert kinds[10:] == ["TypeError"] * 3
    assert "threshold must be in (0, 1]" in errs[0][1]
    assert "interval must be > 0" in errs[4][1]
    assert errs[-1] == [1.0, 0.5, 1]


def test_without_a_gpu_it_starts_records_nothing_says_why_once(venv, workdir):
    r, res = _run(venv, workdir, """
        import torch
        base = tasks()
        a = MemoryMonitor(interval=0.01)
        with a:
            time.sleep(0.1)
            inside = [a.running, tasks() - base]
        b = MemoryMonitor().start()
        b.stop()
        print(json.dumps([inside, a.reason, a.samples(), a.events, tasks() - base,
                          torch.cuda.is_initialized()]))
    """)
    inside, reason, samples, events, leaked, initialised = res
    assert inside == [False, 0]
    assert reason.startswith("no GPU to watch")
    assert samples == [] and events == [] and leaked == 0 and initialised is False
    assert r.stderr.count("MemoryMonitor: no GPU to watch") == 1


def test_crossing_the_threshold_clears_calls_on_high_and_records(venv, workdir):
    _, res = _run(venv, workdir, """
        calls = []
        main = threading.get_ident()
        def on_high(ev):
            calls.append([ev["kind"], ev["used"], threading.get_ident() != main])
        m = MemoryMonitor(threshold=0.8, interval=0.01, cooldown=3600, on_high=on_high,
                          capacity=100000, _source=SRC)
        with m:
            wait_for(lambda: len(m.samples()) >= 3)
            feed(900)                                    # crossing 1
            wait_for(lambda: len(m.events) >= 1)
            time.sleep(0.1)                              # still high: cooldown, no action
            feed(500)                                    # back below: re-armed
            wait_for(lambda: m.samples()[-1].used == 500)
            feed(850)                                    # crossing 2
            wait_for(lambda: len(m.events) >= 2)
            time.sleep(0.05)
        ev = m.events
        s = m.samples()
        n = m.to_csv("timeline.csv")
        lines = open("timeline.csv").read().splitlines()
        print(json.dumps([calls, [[e["kind"], e["used"], e["total"], e["fraction"], e["released"]]
                                  for e in ev], ev[0]["message"],
                          [s[0].used, s[0].total, s[0].process, s[0].reserved],
                          all(b.time > a.time for a, b in zip(s, s[1:])),
                          n == len(s), lines[0], lines[1]]))
    """)
    calls, events, message, first, increasing, csv_ok, header, row = res
    assert calls == [["high", 900, True], ["high", 850, True]]
    assert events == [["high", 900, 1000, 0.9, 0], ["high", 850, 1000, 0.85, 0]]
    assert "90.0% >= threshold 80.0%" in message
    assert first == [100, 1000, 100, None] and increasing and csv_ok
    assert header == "time,used,total,process,reserved,allocated"
    assert row.endswith(",100,1000,100,,")


def test_on_high_errors_are_reported_and_the_watchdog_survives(venv, workdir):
    r, res = _run(venv, workdir, """
        def boom(ev):
            raise RuntimeError("callback exploded")
        m = MemoryMonitor(threshold=0.5, interval=0.01, cooldown=0, on_high=boom, _source=SRC)
        with m:
            feed(900)
            wait_for(lambda: sum(e["kind"] == "on_high_error" for e in m.events) >= 2)
            alive = m.running
        print(json.dumps([alive, [e["kind"] for e in m.events][:2], m.events[1]["message"]]))
    """)
    alive, kinds, message = res
    assert alive is True
    assert kinds == ["high", "on_high_error"]
    assert "callback exploded" in message
    assert "callback exploded" in r.stderr      # reported, not swallowed


def test_timeline_is_bounded(venv, workdir):
    _, res = _run(venv, workdir, """
        m = MemoryMonitor(interval=0.001, capacity=5, _source=SRC)
        with m:
            wait_for(lambda: outofcuda.monitor.core._monitor_info(m._handle)["dropped"] > 20)
        info = outofcuda.monitor.core._monitor_info(m._handle)
        print(json.dumps([len(m.samples()), info["count"], info["dropped"] > 20]))
    """)
    assert res == [5, 5, True]


def test_repeated_start_stop_leaks_no_threads_and_joins_promptly(venv, workdir):
    _, res = _run(venv, workdir, """
        import gc
        base_py, base_native = threading.active_count(), tasks()
        m = MemoryMonitor(interval=60, _source=SRC)
        peak, slowest = 0, 0.0
        for i in range(40):
            m.start()
            peak = max(peak, tasks() - base_native)
            t = time.monotonic()
            m.stop()
            slowest = max(slowest, time.monotonic() - t)
        for i in range(20):     # dropped while running: the handle's destructor joins
            MemoryMonitor(interval=60, _source=SRC).start()
            gc.collect()
        again = MemoryMonitor(interval=60, _source=SRC).start()
        try:
            again.start()
            double = None
        except RuntimeError as e:
            double = str(e)
        again.stop()
        print(json.dumps([peak, slowest, threading.active_count() - base_py,
                          tasks() - base_native, double]))
    """)
    peak, slowest, py_leak, native_leak, double = res
    assert peak == 1
    assert slowest < 1.0           # interval is 60 s: stop() wakes the thread
    assert py_leak == 0 and native_leak == 0
    assert "already running" in double


def test_keyboard_interrupt_stops_the_watchdog(venv, workdir):
    _, res = _run(venv, workdir, """
        import signal
        base = tasks()
        m = MemoryMonitor(interval=0.01, _source=SRC)
        caught = False
        try:
            with m:
                wait_for(lambda: len(m.samples()) > 2)
                os.kill(os.getpid(), signal.SIGINT)   # the watchdog blocks signals:
                time.sleep(5)                         # Python's main thread gets it
        except KeyboardInterrupt:
            caught = True
        print(json.dumps([caught, m.running, tasks() - base]))
    """)
    assert res == [True, False, 0]


def test_interpreter_exit_joins_a_running_monitor(venv, workdir):
    r = venv.run(_script("""
        m = MemoryMonitor(interval=60, _source=SRC).start()
        keep = [MemoryMonitor(interval=0.01, on_high=print, threshold=0.01, _source=SRC).start()]
        time.sleep(0.1)
        print("exiting", m.running, keep[0].running, flush=True)
    """), cwd=workdir, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "exiting True True" in r.stdout
    assert "Fatal" not in r.stderr and "Traceback" not in r.stderr


def test_a_forked_child_does_not_inherit_a_running_monitor(venv, workdir):
    _, res = _run(venv, workdir, """
        m = MemoryMonitor(threshold=0.5, interval=0.005, cooldown=0, on_high=lambda e: None,
                          _source=SRC).start()
        feed(900)          # the parent's watchdog keeps taking the GIL and its lock
        wait_for(lambda: len(m.events) > 3)
        results = []
        for i in range(5):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                state = [m.running, m.reason, tasks(), len(m.samples()) > 0]
                m.stop()
                outofcuda.monitor.core._monitor_stop_all()
                os.write(w, json.dumps(state).encode())
                os._exit(0)
            os.close(w)
            data = os.read(r, 4096)
            os.close(r)
            _, status = os.waitpid(pid, 0)
            results.append([json.loads(data), status])
        parent = m.running
        m.stop()
        print(json.dumps([results, parent]))
    """, timeout=60)
    results, parent_running = res
    for state, status in results:
        running, reason, child_tasks, has_samples = state
        assert running is False and "fork" in reason
        assert child_tasks == 1 and has_samples is True and status == 0
    assert parent_running is True


def test_plot_without_matplotlib_says_how_to_get_it(venv, workdir):
    r = venv.run("import matplotlib", cwd=workdir)
    if r.returncode == 0:
        pytest.skip("matplotlib is installed in the test environment")
    _, res = _run(venv, workdir, """
        m = MemoryMonitor(interval=0.01, _source=SRC)
        with m:
            wait_for(lambda: len(m.samples()) > 1)
        try:
            m.plot("out.png")
            err = None
        except ImportError as e:
            err = str(e)
        print(json.dumps([err, os.path.exists("out.png")]))
    """)
    err, exists = res
    assert "outofcuda[plot]" in err and "matplotlib" in err
    assert exists is False


def test_allocator_stats_do_not_initialise_cuda(venv, workdir):
    _, res = _run(venv, workdir, """
        import torch
        m = MemoryMonitor(interval=0.01, allocator_stats=True, _source=SRC)
        with m:
            wait_for(lambda: len(m.samples()) > 3)
        s = m.samples()
        print(json.dumps([s[-1].reserved, s[-1].allocated, torch.cuda.is_initialized()]))
    """)
    assert res == [None, None, False]
