"""Leak tests: every public function of the extension and of the package, and
the hook's install path, called 10 000 times in one fresh interpreter with
torch imported. Per function: growth of gc-tracked objects, of pymalloc
blocks (sys.getallocatedblocks) and of RSS (these two: the smaller of two such
windows) stays under a small bound, and the reference counts of returned objects and
of arguments are stable. A second copy of the extension loads under another
sys.modules key (multi-phase init).

OUTOFCUDA_GC_COLLECT=0 in the child: otherwise clear_cache() runs a full
gc.collect() per call (10 000 of them with torch loaded take minutes)."""
import json

import pytest

import kit

CALLS = 10_000
# Bounds per function over 10 000 calls (a leak of one object per call shows
# as 10 000; these leave room for caches that fill once and for allocator noise).
MAX_GC_OBJECTS = 20
MAX_BLOCKS = 200
MAX_RSS_BYTES = 1 << 20

CHILD_TEMPLATE = kit.CHILD + r"""
import gc, json, tempfile, warnings
warnings.simplefilter("ignore")          # the no-GPU RuntimeWarning of MemoryMonitor, once
import torch, _outofcuda, outofcuda, outofcuda_hook
watcher = outofcuda_hook._finder()

src = tempfile.NamedTemporaryFile("w", suffix=".mem", delete=False)
src.write("100 1000 10\n"); src.close()

def monitor_cycle():
    h = _outofcuda._testing.monitor_start(0, 0.85, 1.0, 30.0, None, 16, False, src.name)
    _outofcuda._monitor_info(h); _outofcuda._monitor_samples(h); _outofcuda._monitor_events(h)
    _outofcuda._monitor_stop(h)

def autocast_cycle():
    with outofcuda.autocast_context("cpu"):
        pass

def error(fn, *a, **k):
    try:
        fn(*a, **k)
    except (TypeError, ValueError):
        return
    raise AssertionError(f"{fn} accepted {a} {k}")

class NoTruth:
    def __bool__(self):
        raise ValueError("no truth value")

GIB = 1 << 30
OOM = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 " +
                                  "\u00e9" * 200)
REPORT = _outofcuda._oom_record(OOM)

def oom_advice_errors():
    error(_outofcuda._oom_advice, 1)
    error(_outofcuda._oom_advice, others=[("pid", "name", 1)])
    error(_outofcuda._oom_advice, others=5)
    error(_outofcuda._oom_advice, fraction="half")
    error(_outofcuda._oom_advice, autocast=NoTruth())

leaf = torch.ones(3, requires_grad=True)
entry_grad = torch.zeros(3)
# One graph for every call: the walk builds no tensor, so only what the
# walk itself allocates can grow (a new graph per call made torch's own
# allocations show in RSS now and then).
loss = (leaf * 2 + leaf).sum()

def grad_set_aside():
    # A leaf reached twice (two paths) and one with a gradient to set aside.
    leaf.grad = entry_grad
    saved = {}
    _outofcuda._grad_set_aside(loss, saved)
    return saved

env = {"OUTOFCUDA_TF32": "0", "OUTOFCUDA_NUM_WORKERS": "bad", "OUTOFCUDA_ALLOC_CONF": "a:["}
cases = {
    "_outofcuda.install": _outofcuda.install,
    "_outofcuda.status": _outofcuda.status,
    "_outofcuda.config": _outofcuda.config,
    "_outofcuda._parse_config": lambda: _outofcuda._parse_config(env),
    "_outofcuda._parse_config(error)": lambda: error(_outofcuda._parse_config, [1]),
    "_outofcuda._merge_alloc_conf": lambda: _outofcuda._merge_alloc_conf(
        "max_split_size_mb:128,expandable_segments:True", "backend:native", "2.13.0"),
    "_outofcuda._merge_alloc_conf(error)": lambda: error(_outofcuda._merge_alloc_conf, "a:[", "b"),
    "_outofcuda.nvml_devices": _outofcuda.nvml_devices,
    "_outofcuda.nvml_processes": lambda: _outofcuda.nvml_processes(0),
    "_outofcuda.nvml_index": lambda: _outofcuda.nvml_index(0),
    "_outofcuda._api_autocast_dtype": lambda: _outofcuda._api_autocast_dtype("cuda"),
    "_outofcuda._api_loader_plan": lambda: _outofcuda._api_loader_plan(False, num_workers=2),
    "_outofcuda._api_memory_format": lambda: _outofcuda._api_memory_format(True, False),
    "_outofcuda._api_memory_report": _outofcuda._api_memory_report,
    "_outofcuda._api_clear_cache": _outofcuda._api_clear_cache,
    "_outofcuda._oom_observer": lambda: _outofcuda._oom_observer(0, 1 << 30, 8 << 30, 1 << 20),
    # Every branch of the ranking: another process, fragmentation, the fraction,
    # the batch, autocast; a nameless process and a tenth one past the 8 kept.
    "_outofcuda._oom_advice": lambda: _outofcuda._oom_advice(
        request=GIB, total=80 * GIB, allocated=40 * GIB, reserved=60 * GIB,
        inactive_split=5 * GIB, fraction=0.5, expandable=False, autocast=False, exhausted=False,
        others=[(4242, "python", 30 * GIB), (7, None, 2 * GIB)] + [(i, "x", GIB) for i in range(8)]),
    "_outofcuda._oom_advice(error)": oom_advice_errors,
    "_outofcuda._testing.monitor_start..stop": monitor_cycle,
    "_outofcuda._monitor_stop_all": _outofcuda._monitor_stop_all,
    "_outofcuda._find_torch_spec": lambda: (_outofcuda._find_torch_spec(watcher, "json"),
                                            _outofcuda._find_torch_spec(watcher, "torch")),
    "outofcuda_hook.install": outofcuda_hook.install,
    "outofcuda_hook._install": outofcuda_hook._install,
    "outofcuda_hook._finder": outofcuda_hook._finder,
    "outofcuda_hook._incomplete": lambda: outofcuda_hook._incomplete(_outofcuda.__file__),
    "outofcuda_hook finder.find_spec": lambda: (watcher.find_spec("json"),
                                                watcher.find_spec("torch", None, None)),
    "outofcuda.status": outofcuda.status,
    "outofcuda.config": outofcuda.config,
    "outofcuda.memory_report": outofcuda.memory_report,
    "outofcuda.clear_cache": outofcuda.clear_cache,
    "outofcuda.last_oom": outofcuda.last_oom,
    "outofcuda.autocast_context": autocast_cycle,
    # Starts the exit summary once (no NVML here: the thread samples the stack), then
    # sets its interval.
    "_outofcuda._testing.summary_start": lambda: _outofcuda._testing.summary_start([0], 200),
    "_outofcuda._testing.summary_start(error)":
        lambda: error(_outofcuda._testing.summary_start, [0], 1),
    "_outofcuda._monitor_start": lambda: _outofcuda._monitor_stop(
        _outofcuda._monitor_start(0, 0.85, 1.0, 30.0, None, 16, False)),
    "_outofcuda._summary_stats": _outofcuda._summary_stats,
    "_outofcuda._labelled": lambda: _outofcuda._labelled("a\n\nb\u00e9\n"),
    "_outofcuda._microbatch_split": _outofcuda._microbatch_split,
    "_outofcuda._settings": _outofcuda._settings,
    "_outofcuda._oom_record": lambda: (_outofcuda._oom_record(),
                                       _outofcuda._oom_record(OOM, True, True),
                                       _outofcuda._oom_record(OOM)),
    "_outofcuda._oom_record(error)": lambda: error(_outofcuda._oom_record, OOM, True, True, 1),
    "_outofcuda._oom_note": lambda: (_outofcuda._oom_note(OOM), _outofcuda._oom_last(),
                                     _outofcuda._oom_note(None)),
    "_outofcuda._oom_last": _outofcuda._oom_last,
    "_outofcuda._oom_format": lambda: _outofcuda._oom_format(
        dict(REPORT, other_processes=[{"pid": 7, "name": "x", "used_bytes": GIB}],
             memory_fraction=0.5, limit_bytes=GIB, snapshot="/tmp/s.pickle")),
    "_outofcuda._oom_format(error)": lambda: (
        error(_outofcuda._oom_format, 5), error(_outofcuda._oom_format, dict(REPORT, notes=5)),
        error(_outofcuda._oom_format, dict(REPORT, request_bytes="x"))),
    "_outofcuda._testing.oom_reports_built": _outofcuda._testing.oom_reports_built,
    "_outofcuda._disabled_by_env": _outofcuda._disabled_by_env,
    "_outofcuda._tf32_forced_off": _outofcuda._tf32_forced_off,
    "_outofcuda._alloc_var": lambda: _outofcuda._alloc_var("2.14.1"),
    "_outofcuda._alloc_vars": _outofcuda._alloc_vars,
    "_outofcuda._is_oom": lambda: (_outofcuda._is_oom(RuntimeError("CUDA out of memory")),
                                   _outofcuda._is_oom(5)),
    "_outofcuda._status_text": lambda: _outofcuda._status_text(_outofcuda.status()),
    "_outofcuda._status_text(error)": lambda: error(_outofcuda._status_text, 5),
    "_outofcuda._wrap": lambda: _outofcuda._wrap("a path /" + "x" * 90 + " then words " * 9, 40, 6),
    "_outofcuda._wrap(error)": lambda: (error(_outofcuda._wrap, "a", 0, 0),
                                        error(_outofcuda._wrap, "a", 10, 80)),
    "_outofcuda._alloc_items": lambda: _outofcuda._alloc_items(
        "max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4]"),
    "_outofcuda._alloc_items(error)": lambda: error(_outofcuda._alloc_items, "a:[1"),
    "_outofcuda.visible_devices": _outofcuda.visible_devices,
    "_outofcuda._visible_ccs": _outofcuda._visible_ccs,
    "_outofcuda._platform": _outofcuda._platform,
    "_outofcuda._testing.simulate_kernel_release": lambda: (
        _outofcuda._testing.simulate_kernel_release("5.15.153.1-microsoft-standard-WSL2"),
        _outofcuda._platform(), _outofcuda._testing.simulate_kernel_release(None)),
    "_outofcuda._known_bugs_check": lambda: _outofcuda._known_bugs_check(
        "2.14.1", True, 92400, [90, 80], {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "0"}),
    "_outofcuda._known_bugs_check(error)": lambda: (
        error(_outofcuda._known_bugs_check, "2.14.1", True, "x", None, {}),
        error(_outofcuda._known_bugs_check, "2.14.1", True, 1, 5, {})),
    "_outofcuda._grad_set_aside": grad_set_aside,
    "_outofcuda._grad_set_aside(error)": lambda: (error(_outofcuda._grad_set_aside, 1, {}),
                                                  error(_outofcuda._grad_set_aside, leaf, [])),
}
meta_len = len(sys.meta_path)
out = {}
for name, fn in cases.items():
    for _ in range(200):                  # warm caches and lazy imports
        fn()
    gc.collect()
    o0, b0, r0 = len(gc.get_objects()), sys.getallocatedblocks(), rss()
    for _ in range(CALLS):
        fn()
    gc.collect()
    o1, b1, r1 = len(gc.get_objects()), sys.getallocatedblocks(), rss()
    # RSS and pymalloc blocks over a second window too: a leak grows them in
    # both, while a one-time growth lands in one only (glibc extending its
    # heap's top once, seen when a result grows past pymalloc's 512-byte
    # blocks; a dict of the interpreter's resizing once, seen once as 222
    # blocks for status() on a loaded machine).
    for _ in range(CALLS):
        fn()
    gc.collect()
    rss_growth = min(r1 - r0, rss() - r1)
    blocks_growth = min(b1 - b0, sys.getallocatedblocks() - b1)
    res = fn()
    rc_before = sys.getrefcount(res) if res is not None else None
    for _ in range(1000):
        fn()
    rc_after = sys.getrefcount(res) if res is not None else None
    out[name] = {"objects": o1 - o0, "blocks": blocks_growth, "rss": rss_growth,
                 "refcount": [rc_before, rc_after]}
out["_env_refcount"] = sys.getrefcount(env)
out["_meta_path_growth"] = len(sys.meta_path) - meta_len
os.unlink(src.name)
print(json.dumps(out))
"""
CHILD = CHILD_TEMPLATE.replace("CALLS", str(CALLS))


@pytest.fixture(scope="module")
def leak_figures(venv, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("leaks")
    return venv.json(CHILD, env={"OUTOFCUDA_GC_COLLECT": "0"}, cwd=cwd, timeout=600)


CASES = [
    "_outofcuda._find_torch_spec", "outofcuda_hook.install", "outofcuda_hook._install",
    "outofcuda_hook._finder", "outofcuda_hook._incomplete", "outofcuda_hook finder.find_spec",
    "_outofcuda.install", "_outofcuda.status", "_outofcuda.config", "_outofcuda._parse_config",
    "_outofcuda._parse_config(error)", "_outofcuda._merge_alloc_conf",
    "_outofcuda._merge_alloc_conf(error)", "_outofcuda.nvml_devices", "_outofcuda.nvml_processes",
    "_outofcuda.nvml_index",
    "_outofcuda._api_autocast_dtype", "_outofcuda._api_loader_plan",
    "_outofcuda._api_memory_format", "_outofcuda._api_memory_report",
    "_outofcuda._api_clear_cache", "_outofcuda._oom_observer",
    "_outofcuda._oom_advice", "_outofcuda._oom_advice(error)",
    "_outofcuda._testing.monitor_start..stop", "_outofcuda._monitor_stop_all", "outofcuda.status",
    "outofcuda.config", "outofcuda.memory_report", "outofcuda.clear_cache", "outofcuda.last_oom",
    "outofcuda.autocast_context", "_outofcuda._testing.summary_start",
    "_outofcuda._testing.summary_start(error)", "_outofcuda._monitor_start",
    "_outofcuda._summary_stats", "_outofcuda._labelled",
    "_outofcuda._microbatch_split", "_outofcuda._grad_set_aside", "_outofcuda._settings", "_outofcuda._oom_record",
    "_outofcuda._oom_record(error)", "_outofcuda._oom_note", "_outofcuda._oom_last",
    "_outofcuda._oom_format", "_outofcuda._oom_format(error)",
    "_outofcuda._testing.oom_reports_built",
    "_outofcuda._disabled_by_env", "_outofcuda._tf32_forced_off",
    "_outofcuda._alloc_var", "_outofcuda._alloc_vars", "_outofcuda._is_oom",
    "_outofcuda._status_text", "_outofcuda._status_text(error)", "_outofcuda._wrap",
    "_outofcuda._wrap(error)", "_outofcuda._alloc_items",
    "_outofcuda._alloc_items(error)", "_outofcuda.visible_devices",
    "_outofcuda._visible_ccs", "_outofcuda._platform", "_outofcuda._testing.simulate_kernel_release",
    "_outofcuda._known_bugs_check", "_outofcuda._known_bugs_check(error)",
    "_outofcuda._grad_set_aside(error)",
]


@pytest.mark.parametrize("name", CASES)
def test_no_growth_over_10000_calls(leak_figures, name):
    f = leak_figures[name]
    print(name, f)
    assert f["objects"] <= MAX_GC_OBJECTS, f"{name}: {f['objects']} more gc objects"
    assert f["blocks"] <= MAX_BLOCKS, f"{name}: {f['blocks']} more pymalloc blocks"
    assert f["rss"] <= MAX_RSS_BYTES, f"{name}: RSS grew by {f['rss']} bytes"
    before, after = f["refcount"]
    assert before == after, f"{name}: the returned object's refcount went {before} -> {after}"


def test_arguments_and_meta_path_stable(leak_figures):
    # env dict: the module global, getrefcount's argument; nothing else keeps it.
    assert leak_figures["_env_refcount"] <= 3
    assert leak_figures["_meta_path_growth"] == 0


def test_every_public_function_is_covered(venv):
    """A function added to the extension without a leak case fails here."""
    r = venv.check("import json, _outofcuda; print(json.dumps(sorted("
                   "[n for n in dir(_outofcuda) if callable(getattr(_outofcuda, n))] + "
                   "['_testing.' + n for n in dir(_outofcuda._testing) "
                   "if callable(getattr(_outofcuda._testing, n))])))")
    names = json.loads(r.stdout)
    covered = {c.split("(")[0].split("..")[0].removeprefix("_outofcuda.") for c in CASES}
    covered |= {"_monitor_stop", "_monitor_info", "_monitor_samples", "_monitor_events"}
    missing = [n for n in names if n not in covered]
    assert not missing, f"no leak case for {missing}"


def test_reimport_as_second_module(venv):
    """Multi-phase init: the extension executes again into a fresh module
    object (under another sys.modules key, and after removal from
    sys.modules); both copies work and share the process-wide hook state."""
    venv.check("""
        import sys, importlib, importlib.util, torch
        import _outofcuda as first
        spec = importlib.util.find_spec("_outofcuda")
        second = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(second)
        sys.modules["_outofcuda_copy"] = second
        assert second is not first and second.status is not first.status
        assert second.status()["hook"] == first.status()["hook"]
        assert second.status()["hook"]["fired"] is True
        before = len(sys.meta_path)
        second.install()                       # idempotent across copies
        assert len(sys.meta_path) == before
        del sys.modules["_outofcuda"]
        third = importlib.import_module("_outofcuda")
        assert third is not first and third.config() == first.config()
        import gc, weakref
        refs = []
        for _ in range(1000):                  # module objects are freed, not leaked
            m = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(m)
            refs.append(weakref.ref(m))
        del m
        gc.collect()
        alive = sum(r() is not None for r in refs)
        assert alive == 0, f"{alive} of 1000 extension module copies still alive"
        import outofcuda
        assert outofcuda.status()["hook"]["installed"] is True
    """)
