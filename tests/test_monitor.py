"""MemoryMonitor: the native watchdog thread's lifecycle, on a machine
without a GPU. The watchdog's memory source is NVML; where no GPU exists the
tests feed it from a file (`_source`, "used total process") so the real C
thread, its threshold logic, its GIL hand-off and its joins all run."""
import json
import os
import random
import selectors
import signal
import subprocess
import textwrap
import time

import pytest

from conftest import SANITIZE, _clean_env, _sanitizer_env
from kit import CHILD, last_json

PRELUDE = CHILD + """
import json, threading
guard(GUARD_S)
import outofcuda
from outofcuda import MemoryMonitor
SRC = sys.argv[1] if len(sys.argv) > 1 else "src.txt"
def feed(used, total=1000, process=100):
    tmp = SRC + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{used} {total} {process}")
    os.replace(tmp, SRC)
feed(100)
"""
GUARD_S = 40


def _script(body, guard=GUARD_S):
    return PRELUDE.replace("GUARD_S", str(guard)) + textwrap.dedent(body)


def _run(venv, workdir, body, **kw):
    r = venv.check(_script(body), cwd=workdir, **kw)
    return r, last_json(r)


def test_arguments_are_validated(venv, workdir):
    _, errs = _run(venv, workdir, """
        nan, inf = float("nan"), float("inf")
        cases = [dict(threshold=0), dict(threshold=1.5), dict(threshold=-0.1),
                 dict(threshold=nan), dict(interval=0), dict(interval=-1),
                 dict(device="cpu"), dict(device=-1), dict(cooldown=-1), dict(capacity=0),
                 dict(threshold=inf), dict(interval=nan), dict(interval=inf),
                 dict(interval=-inf), dict(interval=1e19), dict(cooldown=nan),
                 dict(cooldown=inf), dict(capacity=10**12), dict(capacity=-5),
                 dict(capacity=2.5),
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
    assert kinds[:20] == ["ValueError"] * 20, errs
    assert kinds[20:] == ["TypeError"] * 3
    assert "threshold must be in (0, 1]" in errs[0][1]
    assert "interval must be > 0" in errs[4][1]
    assert "finite" in errs[11][1] and "finite" in errs[12][1]
    assert "interval must be > 0 and <= 86400" in errs[14][1]
    assert "capacity must be a whole number from 1 to 10000000" in errs[17][1]
    assert errs[-1] == [1.0, 0.5, 1]


def test_without_a_gpu_it_starts_records_nothing_says_why_once(venv, workdir):
    r, res = _run(venv, workdir, """
        import torch
        base = threads()
        a = MemoryMonitor(interval=0.01)
        with a:
            time.sleep(0.1)
            inside = [a.running, threads() - base]
        b = MemoryMonitor().start()
        b.stop()
        print(json.dumps([inside, a.reason, a.samples(), a.events, threads() - base,
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
            need(lambda: len(m.samples()) >= 3, "len(m.samples()) >= 3")
            feed(900)                                    # crossing 1
            need(lambda: len(m.events) >= 1, "len(m.events) >= 1")
            # Still high, within the cooldown: five more samples of 900 taken
            # (the watchdog looked five times) and no second action.
            seen = len(m.samples())
            need(lambda: len(m.samples()) >= seen + 5, "five samples during the cooldown")
            in_cooldown = len(m.events)
            feed(500)                                    # back below: re-armed
            need(lambda: m.samples()[-1].used == 500, "m.samples()[-1].used == 500")
            feed(850)                                    # crossing 2
            need(lambda: len(m.events) >= 2, "len(m.events) >= 2")
            time.sleep(0.05)
        ev = m.events
        s = m.samples()
        n = m.to_csv("timeline.csv")
        lines = open("timeline.csv").read().splitlines()
        print(json.dumps([calls, [[e["kind"], e["used"], e["total"], e["fraction"], e["released"]]
                                  for e in ev], ev[0]["message"],
                          [s[0].used, s[0].total, s[0].process, s[0].reserved],
                          all(b.time > a.time for a, b in zip(s, s[1:])),
                          n == len(s), lines[0], lines[1], in_cooldown]))
    """)
    calls, events, message, first, increasing, csv_ok, header, row, in_cooldown = res
    assert in_cooldown == 1
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
            need(lambda: sum(e["kind"] == "on_high_error" for e in m.events) >= 2,
                 "two on_high_error events")
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
            need(lambda: outofcuda.monitor.core._monitor_info(m._handle)["dropped"] > 20,
                 "more than 20 dropped samples")
        info = outofcuda.monitor.core._monitor_info(m._handle)
        print(json.dumps([len(m.samples()), info["count"], info["dropped"] > 20]))
    """)
    assert res == [5, 5, True]


def test_repeated_start_stop_leaks_no_threads_and_joins_promptly(venv, workdir):
    _, res = _run(venv, workdir, """
        import gc
        base_py, base_native = threading.active_count(), threads()
        m = MemoryMonitor(interval=60, _source=SRC)
        peak, slowest = 0, 0.0
        for i in range(40):
            m.start()
            peak = max(peak, threads() - base_native)
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
                          threads() - base_native, double]))
    """)
    peak, slowest, py_leak, native_leak, double = res
    assert peak == 1
    # interval is 60 s: without stop() waking the thread each stop would take
    # about 60 s (a bound far from both, not a speed figure).
    assert slowest < 30.0
    assert py_leak == 0 and native_leak == 0
    assert "already running" in double


def _run_sigint_ignored(venv, workdir, body, timeout=60):
    """Runs a scenario the way a background job without job control starts:
    SIGINT inherited as ignored (`nohup cmd &`, `trap "" INT`)."""
    env = dict(_sanitizer_env()) if SANITIZE else {}
    return subprocess.run([str(venv.python), "-c", _script(body)], cwd=workdir,
                          env=_clean_env(env), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_keyboard_interrupt_stops_the_watchdog(venv, workdir, inherited):
    body = """
        base = threads()
        m = MemoryMonitor(interval=0.01, _source=SRC)
        caught = False
        try:
            with m:
                need(lambda: len(m.samples()) > 2, "three samples from the watchdog")
                os.kill(os.getpid(), signal.SIGINT)   # the watchdog blocks signals:
                need(lambda: False, "SIGINT to arrive as KeyboardInterrupt")  # main gets it
        except KeyboardInterrupt:
            caught = True
        need(lambda: threads() == base, "the watchdog thread to end")
        print(json.dumps([caught, m.running, threads() - base]))
    """
    if inherited == "default":
        _, res = _run(venv, workdir, body)
    else:
        r = _run_sigint_ignored(venv, workdir, body)
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        res = last_json(r)
    assert res == [True, False, 0]


def test_on_high_may_stop_its_own_monitor(venv, workdir):
    """stop() from the watchdog's own thread cannot join that thread: it asks
    it to end, and the thread is joined later by another thread."""
    _, res = _run(venv, workdir, """
        base = threads()
        seen = []
        def on_high(ev):
            seen.append(threading.get_ident())
            m.stop()                      # from the watchdog's own thread
            seen.append(m.running)
        m = MemoryMonitor(threshold=0.5, interval=0.005, cooldown=0, on_high=on_high,
                          _source=SRC).start()
        feed(900)
        need(lambda: len(seen) == 2, "on_high to run and return")
        need(lambda: threads() == base, "the self-stopped watchdog thread to end")
        t = time.monotonic()
        m.stop()                          # idempotent; joins what is left
        again = MemoryMonitor(interval=0.01, _source=SRC).start()
        need(lambda: len(again.samples()) > 1, "a new monitor to poll")
        again.stop()
        print(json.dumps([seen[1], seen[0] != threading.get_ident(), m.running,
                          [e["kind"] for e in m.events], threads() - base]))
    """)
    assert res == [False, True, False, ["high"], 0]


def test_monitors_that_stop_each_other_from_on_high_do_not_deadlock(venv, workdir):
    """Two watchdogs each stopping the other from on_high: a watchdog never
    waits for another thread, so neither can wait on the other."""
    _, res = _run(venv, workdir, """
        base = threads()
        mons = {}
        calls = []
        def stopper(other):
            def on_high(ev):
                calls.append(other)
                mons[other].stop()
            return on_high
        for rounds in range(20):
            mons["a"] = MemoryMonitor(threshold=0.5, interval=0.001, cooldown=0,
                                      on_high=stopper("b"), _source=SRC)
            mons["b"] = MemoryMonitor(threshold=0.5, interval=0.001, cooldown=0,
                                      on_high=stopper("a"), _source=SRC)
            feed(900)
            mons["a"].start(); mons["b"].start()
            need(lambda: not (mons["a"].running and mons["b"].running),
                 "one watchdog to stop the other")
            mons["a"].stop(); mons["b"].stop()
            feed(100)
        need(lambda: threads() == base, "every watchdog thread to end")
        print(json.dumps([len(calls) >= 20, threads() - base]))
    """)
    assert res == [True, 0]


# The watchdog drops the last reference to its own monitor: from on_high, and
# through its gc.collect() when the monitor sits in a reference cycle that
# nothing else collects. The thread must not touch the freed monitor (the
# sanitizer build checks that) and must not be left behind.
DROPPED_IN_OWN_THREAD = """
    import gc
    gc.disable()                      # only the watchdog's gc.collect() collects
    base = threads()
    done = []
    holder = []
    def drop(ev):
        holder.clear()                # the last reference, dropped in the watchdog
        done.append("dropped")
    holder.append(MemoryMonitor(threshold=0.5, interval=0.002, cooldown=0, on_high=drop,
                                _source=SRC).start())
    feed(900)
    need(lambda: done, "on_high to drop its monitor")
    need(lambda: threads() == base, "the watchdog of the dropped monitor to end")
    for i in range(5):
        def count(ev, i=i):
            done.append(i)
        m = MemoryMonitor(threshold=0.5, interval=0.002, cooldown=0, on_high=count, _source=SRC)
        m.start()
        m.cycle = [m]                 # garbage only the cycle collector frees
        need(lambda: len(m.events) > 1, "the watchdog to act")
        del m
        # Its own watchdog's gc.collect() frees it, in that watchdog's thread.
        need(lambda: threads() == base, "the watchdog of the collected monitor to end")
        junk = [bytearray(4096) for _ in range(200)]   # reuse freed memory
    feed(100)
    gc.enable()
    gc.collect()
    outofcuda.monitor.core._monitor_stop_all()
    need(lambda: threads() == base, "every watchdog thread to end")
    print(json.dumps([done[0], threads() - base]))
"""


def test_a_monitor_dropped_by_its_own_watchdog_is_freed_safely(venv, workdir):
    _, res = _run(venv, workdir, DROPPED_IN_OWN_THREAD)
    assert res == ["dropped", 0]


def test_an_absurd_interval_is_refused_and_bounded_in_c(venv, workdir):
    _, res = _run(venv, workdir, """
        refused = []
        for interval in (1e19, float("inf"), 86400.001):
            try:
                MemoryMonitor(interval=interval)
                refused.append(None)
            except ValueError as e:
                refused.append(str(e))
        ok = MemoryMonitor(interval=86400).interval
        core = outofcuda.monitor.core
        stopped = []
        for interval in (1e19, float("inf"), 1e300, 9.3e18):
            # The C layer clamps what the Python layer would refuse: no
            # overflowed deadline, no spinning wait holding the lock.
            h = core._testing.monitor_start(0, 0.5, interval, 0.0, None, 10, False, SRC)
            need(lambda: core._monitor_info(h)["count"] >= 1, f"a first sample at {interval}")
            core._monitor_stop(h)
            stopped.append(core._monitor_info(h)["running"])
        nan, inf = float("nan"), float("inf")
        c_refused = []
        for args in [(nan, 1.0, 0.0, 10), (inf, 1.0, 0.0, 10), (0.5, nan, 0.0, 10),
                     (0.5, -inf, 0.0, 10), (0.5, -1.0, 0.0, 10), (0.5, 1.0, nan, 10),
                     (0.5, 1.0, -1.0, 10), (0.5, 1.0, 0.0, 0), (0.5, 1.0, 0.0, -5)]:
            threshold, interval, cooldown, capacity = args
            try:
                core._testing.monitor_start(0, threshold, interval, cooldown, None, capacity,
                                            False, SRC)
                c_refused.append(None)
            except ValueError as e:
                c_refused.append(str(e))
        print(json.dumps([refused, ok, stopped, c_refused]))
    """)
    refused, ok, stopped, c_refused = res
    assert all(e and "out of range" in e for e in c_refused), c_refused
    assert "interval must be > 0 and <= 86400" in refused[0], refused
    assert "interval must be a finite number" in refused[1], refused
    assert "interval must be > 0 and <= 86400" in refused[2], refused
    assert ok == 86400.0 and stopped == [False] * 4


def test_interpreter_exit_joins_a_running_monitor(venv, workdir):
    r = venv.run(_script("""
        m = MemoryMonitor(interval=60, _source=SRC).start()
        keep = [MemoryMonitor(interval=0.01, on_high=print, threshold=0.01, _source=SRC).start()]
        need(lambda: keep[0].events, "the running monitor's first event")
        print("exiting", m.running, keep[0].running, flush=True)
    """), cwd=workdir, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "exiting True True" in r.stdout
    assert "Fatal" not in r.stderr and "Traceback" not in r.stderr


def test_no_watchdog_starts_once_shutdown_began(venv, workdir):
    """After the atexit handler has joined every watchdog, a monitor started
    later (another atexit handler, a daemon thread) runs no thread, so none
    can take the GIL while the interpreter finalises."""
    r = venv.run(_script("""
        import atexit, warnings
        warnings.simplefilter("ignore")
        def late():
            m = MemoryMonitor(interval=0.01, threshold=0.01, on_high=print, _source=SRC).start()
            print("late", m.running, m.reason, threads() - base, flush=True)
            keep.append(m)
        keep = []
        run_last.append(late)          # registered before outofcuda's handler: runs after it
        base = threads()
        running = MemoryMonitor(interval=0.01, threshold=0.01, on_high=lambda e: None,
                                _source=SRC).start()
        feed(900)
        need(lambda: len(running.events) > 0, "the watchdog to act")
        print("exiting", running.running, flush=True)
    """).replace("import outofcuda\n", "import atexit\nrun_last = []\n"
                 "atexit.register(lambda: [f() for f in run_last])\nimport outofcuda\n", 1),
        cwd=workdir, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "exiting True" in r.stdout
    assert "late False the interpreter is shutting down 0" in r.stdout, r.stdout + r.stderr
    assert "Fatal" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_exit_without_the_atexit_handler_does_not_hang(venv, workdir):
    """If the atexit handler never runs (cleared by the program), the
    monitors are still freed during finalisation without a hang or crash."""
    r = venv.run(_script("""
        import atexit
        busy = MemoryMonitor(interval=0.001, threshold=0.01, cooldown=0,
                             on_high=lambda e: None, _source=SRC).start()
        idle = MemoryMonitor(interval=60, _source=SRC).start()
        feed(900)
        need(lambda: len(busy.events) > 2, "the watchdog to act")
        atexit._clear()
        faulthandler.dump_traceback_later(20, exit=True)
        print("exiting", busy.running, idle.running, flush=True)
    """), cwd=workdir, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "exiting True True" in r.stdout
    assert "Fatal" not in r.stderr and "Timeout" not in r.stderr, r.stderr


def test_a_forked_child_does_not_inherit_a_running_monitor(venv, workdir):
    _, res = _run(venv, workdir, """
        m = MemoryMonitor(threshold=0.5, interval=0.005, cooldown=0, on_high=lambda e: None,
                          _source=SRC).start()
        feed(900)          # the parent's watchdog keeps taking the GIL and its lock
        need(lambda: len(m.events) > 3, "len(m.events) > 3")
        results = []
        for i in range(5):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                state = [m.running, m.reason, threads(), len(m.samples()) > 0]
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
            need(lambda: len(m.samples()) > 1, "len(m.samples()) > 1")
        try:
            m.plot("out.png")
            err = None
        except ImportError as e:
            err = str(e)
        print(json.dumps([err, os.path.exists("out.png")]))
    """)
    err, exists = res
    # The command names this Python's pip and matplotlib, never the name
    # `outofcuda` on the package index (another project).
    assert f"{venv.python} -m pip install matplotlib" in err and "outofcuda[" not in err
    assert exists is False


def test_plot_axes_start_at_zero_and_have_a_span(venv, workdir, matplotlib_dir):
    """An empty timeline gets 0..1 s by 0..1 GiB (matplotlib alone would
    centre it on 0, -0.04 to 0.04); a timeline with samples gets 0 to its
    last second by 0 to the device's total. Real matplotlib (Agg)."""
    _, res = _run(venv, workdir, """
        import matplotlib.pyplot as plt
        axes, subplots = [], plt.subplots
        def spy(*a, **k):
            fig, ax = subplots(*a, **k)
            axes.append(ax)
            return fig, ax
        plt.subplots = spy
        empty = MemoryMonitor(_source=SRC)
        empty.plot("empty.png")
        feed(300, total=2 << 30)
        m = MemoryMonitor(interval=0.01, _source=SRC)
        with m:
            need(lambda: len(m.samples()) > 1, "len(m.samples()) > 1")
        m.plot("full.png")
        last = m.samples()[-1].time
        print(json.dumps([[list(ax.get_xlim()), list(ax.get_ylim())] for ax in axes]
                         + [last, os.path.getsize("empty.png") > 0]))
    """, env={"PYTHONPATH": matplotlib_dir, "MPLBACKEND": "Agg"})
    (empty_x, empty_y), (x, y), last, png = res
    assert empty_x == [0, 1] and empty_y == [0, 1] and png
    assert x == [0, max(1, last)] and y == [0, 2.0]


def test_allocator_stats_do_not_initialise_cuda(venv, workdir):
    _, res = _run(venv, workdir, """
        import torch
        m = MemoryMonitor(interval=0.01, allocator_stats=True, _source=SRC)
        with m:
            need(lambda: len(m.samples()) > 3, "len(m.samples()) > 3")
        s = m.samples()
        print(json.dumps([s[-1].reserved, s[-1].allocated, torch.cuda.is_initialized()]))
    """)
    assert res == [None, None, False]


STRESS_CHILD = """
    import gc, random
    feed(900)            # above the threshold: each poll takes the GIL and calls on_high
    base = threads()
    rng = random.Random(os.getpid())
    stop_file = sys.argv[2]
    def make():
        state = {"n": 0}
        def on_high(ev):
            state["n"] += 1
            if state["n"] % 5 == 0 and "mon" in state:
                state["mon"].stop()    # now and then from the watchdog's own thread
        m = MemoryMonitor(threshold=0.5, interval=0.002, cooldown=0, on_high=on_high,
                          _source=SRC)
        if rng.random() < 0.5:
            state["mon"] = m
        m.cycle = [m]                  # freed by whichever gc.collect() comes first
        return m
    caught = 0
    print("ready", flush=True)
    while not os.path.exists(stop_file):
        try:
            while not os.path.exists(stop_file):
                if rng.random() < 0.3:
                    # Dropped while running: garbage that a gc.collect() frees,
                    # in the main thread or in some watchdog's own thread.
                    make().start()
                    time.sleep(rng.random() * 0.01)
                    continue
                with make() as m:
                    for _ in range(rng.randint(0, 30)):
                        m.samples(); m.events; m.running
                        time.sleep(rng.random() * 0.002)
                if rng.random() < 0.2:
                    gc.collect()
        except KeyboardInterrupt:
            caught += 1
            print("caught", caught, flush=True)
    gc.collect()
    outofcuda.monitor.core._monitor_stop_all()
    need(lambda: threads() == base, "every watchdog thread to end")
    print(json.dumps({"caught": caught, "leaked": threads() - base}), flush=True)
"""


def _read_line(proc, sel, deadline, what):
    """The child's next stdout line, or a clear failure naming what was awaited."""
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            pytest.fail(f"child {proc.pid}: nothing within the bound while waiting for {what}")
        chunk = os.read(proc.stdout.fileno(), 1)
        if not chunk:
            proc.wait(10)
            pytest.fail(f"child {proc.pid} ended (exit {proc.returncode}) while waiting for "
                        f"{what}:\n{proc.stderr.read().decode()[-4000:]}")
        line += chunk
    return line.decode().strip()


def test_many_interrupts_under_load_never_hang(venv, workdir):
    """Ctrl-C at random moments (inside start, stop, the with-body, gc) while
    watchdogs take the GIL, stop themselves and are collected, and two
    busy processes load the cores: every interrupt arrives, every child ends
    cleanly, and no watchdog thread is left."""
    rng = random.Random(1234)
    env = _clean_env(_sanitizer_env() if SANITIZE else None)
    busy = [subprocess.Popen([str(venv.python), "-S", "-c",
                              "import time\nend = time.monotonic() + 120\n"
                              "while time.monotonic() < end: pass"], env=env)
            for _ in range(2)]
    kids = []
    try:
        for i in range(3):
            d = workdir / f"kid{i}"
            d.mkdir()
            p = subprocess.Popen([str(venv.python), "-c", _script(STRESS_CHILD, guard=150),
                                  str(d / "src.txt"), str(d / "stop")], cwd=d, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            sel = selectors.DefaultSelector()
            sel.register(p.stdout, selectors.EVENT_READ)
            kids.append([p, sel, d, 0])
        for p, sel, _, _ in kids:
            assert _read_line(p, sel, time.monotonic() + 60, "ready") == "ready"
        for n in range(40):
            kid = rng.choice(kids)
            p, sel = kid[0], kid[1]
            time.sleep(rng.random() * 0.05)     # a random moment, not a synchronisation
            p.send_signal(signal.SIGINT)
            kid[3] += 1
            got = _read_line(p, sel, time.monotonic() + 30, f"interrupt {kid[3]} to be caught")
            assert got == f"caught {kid[3]}", got
        for p, sel, d, sent in kids:
            (d / "stop").write_text("")
            res = json.loads(_read_line(p, sel, time.monotonic() + 60, "the final report"))
            assert p.wait(30) == 0, p.stderr.read().decode()[-4000:]
            assert res == {"caught": sent, "leaked": 0}
            err = p.stderr.read().decode()
            assert "Traceback" not in err and "Fatal" not in err, err[-4000:]
    finally:
        for p in busy + [k[0] for k in kids]:
            if p.poll() is None:
                p.kill()
            p.wait(30)
        for k in kids:
            k[1].close()
            k[0].stdout.close()
            k[0].stderr.close()


def test_huge_arguments_are_a_clear_error_and_a_tiny_interval_has_a_floor(venv, workdir):
    """Numbers past what the C thread takes are a ValueError with a message,
    never a raw OverflowError; an interval under 0.01 s polls every 0.01 s, in
    the Python layer and in the C thread (what it was told to poll at)."""
    _, res = _run(venv, workdir, """
        errs = []
        for kw in (dict(device=2**31), dict(device="cuda:99999999999999999999"),
                   dict(device="cuda:" + "9" * 5000), dict(device=10**400),
                   dict(interval=10**400), dict(threshold=-10**400), dict(cooldown=10**400)):
            try:
                MemoryMonitor(**kw)
                errs.append(None)
            except Exception as e:
                errs.append([type(e).__name__, str(e)])
        core = outofcuda.monitor.core
        tiny = MemoryMonitor(interval=1e-9, _source=SRC)
        tiny.start()
        python_side = [tiny.interval, core._monitor_info(tiny._handle)["interval"]]
        tiny.stop()
        h = core._testing.monitor_start(0, 0.5, 1e-9, 0.0, None, 10, False, SRC)
        c_side = core._monitor_info(h)["interval"]
        core._monitor_stop(h)
        print(json.dumps({"errs": errs, "python": python_side, "c": c_side,
                          "floor": outofcuda.monitor.INTERVAL_MIN}))
    """)
    errs = res["errs"]
    assert [e[0] for e in errs] == ["ValueError"] * 7, errs
    for e in errs[:4]:
        assert "device index must be from 0 to 2147483647" in e[1], errs
    assert all("must be a finite number" in e[1] for e in errs[4:]), errs
    assert res["floor"] == 0.01 and res["python"] == [0.01, 0.01] and res["c"] == 0.01
