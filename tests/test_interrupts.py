"""The user's Ctrl-C (KeyboardInterrupt) and exit() (SystemExit) where
outofcuda runs code: they always reach the program, and they cost nothing of
what outofcuda does. A step of the CUDA-init callback that an interrupt cut
short stays armed and runs again when torch runs its lazy-init queue again
(src/bridge.c); interrupts set aside wait in their own thread's state, any
number of threads at once (src/common.c); one that arrives after torch's
__init__ leaves torch imported (src/watcher.c); one during start-up stops
the interpreter as it would without outofcuda (the .pth line).

The stand-in releases (tests/fake_torch.py) keep torch's queue after a
raising callback, as torch's _lazy_init does: `torch.cuda._fake_cuda_init()`
runs the whole queue again each time."""
import json
import random
import shutil
import subprocess
import textwrap

import pytest

from conftest import stub_nvml_config, stub_nvml_device
from fake_frameworks import make_fake_framework
from fake_torch import make_fake_torch
from kit import last_json, oc_h_table

BUG = "cudnn-sdpa-nan-grad-sm90"
# What waits for CUDA's start on the stand-in 2.14.1 with an sm90 GPU: the
# framework check, TF32, the memory fraction, the cuDNN-attention guard, the
# OOM observer and hooks (the exit summary is off).
ARMED = {step: "off" if step == "summary" else "queued" for step in oc_h_table("OC_CUDA_STEPS")}
DONE = dict(ARMED, **{k: "done" for k in ARMED if k != "summary"})


@pytest.fixture
def sm90(stub_nvml, tmp_path):
    """The stand-in 2.14.1 beside the stand-in NVML showing one sm90 GPU: the
    environment a scenario runs in."""
    cfg = stub_nvml_config(tmp_path / "nvml.cfg", [stub_nvml_device(cc="9.0")])
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    return {"LD_LIBRARY_PATH": str(stub_nvml), "STUB_NVML_CONFIG": str(cfg),
            "PYTHONPATH": str(root)}


# What the program sees of every step once CUDA is up, as typed values.
OUTCOME = """
def outcome():
    st = _outofcuda.status()
    (bug,) = [b for b in st["known_bugs"] if b["id"] == %r]
    opts = st["optimizations"]
    C = torch._C
    return {"steps": st.get("cuda_init"),
            "records": {k: {f: opts[k].get(f) for f in ("applied", "state", "code", "queued",
                                                         "interrupted")}
                        for k in ("tf32", "memory_fraction", "oom_handler")},
            "guard": [bug["applies"], bug["done"]],
            "cudnn_sdp": C._get_cudnn_sdp_enabled(),
            "calls": {n: [[a if isinstance(a, (bool, int, float)) else "fn" for a in c[1:]]
                          for c in C.calls if c[0] == n]
                      for n in ("_set_cublas_allow_tf32", "_cuda_setMemoryFraction",
                                "_set_sdp_use_cudnn", "_cuda_attach_out_of_memory_observer")},
            "excepthook": getattr(sys.excepthook, "__name__", ""),
            "error": st["hook"]["error"]}
""" % BUG


# 0.98: the cap's headroom on the stand-in's 80 GiB board (1.6 GiB, 2 % of it).
WANT_CALLS = {"_set_cublas_allow_tf32": [True], "_cuda_setMemoryFraction": [0.98, 0],
              "_set_sdp_use_cudnn": [False], "_cuda_attach_out_of_memory_observer": ["fn"]}


def check_all_applied(o, once=True):
    """Every step ran to the end: applied, and each torch call made with what
    the step sets; once: made once (a call a stand-in refused at its start),
    else at least once (a Ctrl-C that lands inside a stand-in's function
    after its work raises from it, and the step sets it again)."""
    assert o["steps"] == DONE, o["steps"]
    for name, rec in o["records"].items():
        assert rec == {"applied": True, "state": "applied", "code": "at_cuda_init",
                       "queued": None, "interrupted": None}, (name, rec)
    assert o["guard"] == [True, True] and o["cudnn_sdp"] is False
    for name, args in WANT_CALLS.items():
        made = o["calls"][name]
        assert made == [args] if once else made and made == [args] * len(made), (name, made)
    assert o["excepthook"] == "outofcuda_excepthook", o["excepthook"]
    assert o["error"] is None


# A torch function of each step raises on its first call, in turn a Ctrl-C
# and an exit(); the program catches each, and uses CUDA again.
ONE_STEP_AT_A_TIME = """
import json, sys, torch, _outofcuda
""" + OUTCOME + """
C = torch._C
RAISES = {"_set_cublas_allow_tf32": KeyboardInterrupt, "_cuda_setMemoryFraction": SystemExit,
          "_set_sdp_use_cudnn": KeyboardInterrupt,
          "_cuda_attach_out_of_memory_observer": SystemExit}
def raising_once(name, real):
    def fn(*args):
        exc = RAISES.pop(name, None)
        if exc is not None:
            raise exc
        return real(*args)
    return fn
for name in RAISES:
    setattr(C, name, raising_once(name, getattr(C, name)))
runs = []
while True:
    try:
        torch.cuda._fake_cuda_init()
    except (KeyboardInterrupt, SystemExit) as e:
        o = outcome()
        runs.append({"reached": type(e).__name__, "steps": o["steps"], "records": o["records"],
                     "guard": o["guard"]})
        if len(runs) < 8:
            continue
    break
print(json.dumps({"runs": runs, "end": outcome()}))
"""


def test_a_step_cut_short_runs_again_when_torch_runs_its_queue_again(venv, tmp_path, sm90):
    d = last_json(venv.run(ONE_STEP_AT_A_TIME, env=sm90, cwd=tmp_path, args=("-W", "error")))
    runs = d["runs"]
    # Each interrupt reached the program, as what it was, once per step.
    assert [r["reached"] for r in runs] == ["KeyboardInterrupt", "SystemExit",
                                            "KeyboardInterrupt", "SystemExit"], runs
    # the steps a stand-in setter interrupts, in the order they run (oc.h)
    order = [s for s in oc_h_table("OC_CUDA_STEPS") if s not in ("framework", "summary")]
    for i, r in enumerate(runs):
        # the steps before it done, it interrupted, the ones after it still queued
        want = dict(ARMED, framework="done")
        want.update({s: "done" for s in order[:i]})
        want[order[i]] = "interrupted"
        assert r["steps"] == want, (i, r["steps"])
        if order[i] in r["records"]:
            assert r["records"][order[i]] == {"applied": False, "state": "interrupted",
                                              "code": "at_cuda_init", "queued": True,
                                              "interrupted": True}, r
    # The guard cut short is not left half done: decided from the facts, its
    # action not taken, it acts when the step runs again.
    assert runs[2]["guard"] == [True, False]
    check_all_applied(d["end"])


# A Ctrl-C that lands inside a torch setter of a step after its write (the
# stand-in's setter does its work, then raises): the step's next run finds
# outofcuda's own write, not a choice of the program's (TF32) or a flag
# already off (the cuDNN-attention guard), and says what outofcuda did.
AFTER_THE_WRITE = """
import json, sys, torch, _outofcuda
""" + OUTCOME + """
C = torch._C
real = getattr(C, %r)
def set_then_interrupt(*args):
    setattr(C, %r, real)
    real(*args)
    raise KeyboardInterrupt
setattr(C, %r, set_then_interrupt)
first = None
try:
    torch.cuda._fake_cuda_init()
except KeyboardInterrupt:
    first = outcome()["steps"]
torch.cuda._fake_cuda_init()
print(json.dumps({"first": first, "end": outcome(),
                  "sdpa": _outofcuda.status()["optimizations"]["sdpa"]}))
"""


@pytest.mark.parametrize("setter,step", [("_set_cublas_allow_tf32", "tf32"),
                                         ("_set_sdp_use_cudnn", "known_bugs")])
def test_a_ctrl_c_after_torchs_write_leaves_the_step_applied(venv, tmp_path, sm90, setter, step):
    d = last_json(venv.run(AFTER_THE_WRITE % (setter, setter, setter), env=sm90, cwd=tmp_path,
                           args=("-W", "error")))
    assert d["first"] is not None and d["first"][step] == "interrupted", d["first"]
    check_all_applied(d["end"], once=False)
    # The guard's note on the sdpa row, with the known bug it acts on.
    assert "cudnn_attention_off" in d["sdpa"]["notes"] and d["sdpa"]["known_bug"] == BUG, d


# The framework step cut short inside torch's allocator setter (a Ctrl-C the
# stand-in's setter raises once, before its work), the program catches it and
# uses CUDA again: the step runs again from its start, from what import found
# and what is in use now, and says once what it decided when CUDA started.
# gone: vLLM, in use when torch imported, failed its own import; after: SGLang
# imported after torch.
FRAMEWORK_STEP = """
import json
%s
import torch, _outofcuda
C = torch._C
name = next(n for n in ("_cuda_cudaCachingAllocator_set_allocator_settings",
                        "_accelerator_setAllocatorSettings") if hasattr(C, n))
real = getattr(C, name)
def interrupt_once(*args):
    setattr(C, name, real)
    raise KeyboardInterrupt
setattr(C, name, interrupt_once)
first = None
try:
    torch.cuda._fake_cuda_init()
except KeyboardInterrupt:
    first = _outofcuda.status()["cuda_init"]["framework"]
torch.cuda._fake_cuda_init()
st = _outofcuda.status()
print(json.dumps({"first": first, "step": st["cuda_init"]["framework"],
                  "framework": st["framework"], "error": st["hook"]["error"],
                  "codes": {k: st["optimizations"][k]["code"]
                            for k in ("allocator", "memory_fraction")}}))
"""


@pytest.mark.parametrize("case,code,codes,left_to", [
    ("gone", "try:\n    import vllm\nexcept ImportError:\n    pass",
     {"allocator": "framework_left", "memory_fraction": "at_cuda_init"}, None),
    ("after", "import torch, sglang", {"allocator": "handed_back", "memory_fraction": "framework"},
     "SGLang")])
def test_the_framework_step_cut_short_decides_again_from_the_start(venv, tmp_path, case, code,
                                                                    codes, left_to):
    fw = tmp_path / "fw"
    for name in ("vllm", "sglang"):
        make_fake_framework(fw, name)
    init = fw / "vllm" / "__init__.py"
    init.write_text(init.read_text() + "raise ImportError('vllm built for torch 2.14.0')\n")
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    d = last_json(venv.run(FRAMEWORK_STEP % code, env={"PYTHONPATH": f"{root}:{fw}"},
                           cwd=tmp_path, args=("-W", "error")))
    assert (d["first"], d["step"], d["error"]) == ("interrupted", "done", None), d
    assert d["codes"] == codes and d["framework"]["left_to"] == left_to, d
    # Decided once more from the start: the CUDA-start code, typed, not appended.
    assert d["framework"]["at_cuda_init"] == ("left_to" if left_to else "gone_at_cuda_init"), d
    assert d["framework"]["code"] == d["framework"]["at_cuda_init"], d


# Real SIGINTs at random moments of CUDA's start. One interpreter imports
# torch; each trial is a child forked from it (the engine's state as it was
# before CUDA started), to which the parent sends one SIGINT at a random
# moment of the child's CUDA start or just after it. The child catches the
# KeyboardInterrupt wherever it lands, notes where the steps stood, uses CUDA
# again and reports every step. A first child, sent no signal, times one
# CUDA start.
RANDOM_SIGINTS = """
import json, os, random, signal, sys, time, torch, _outofcuda
""" + OUTCOME + """
signal.signal(signal.SIGINT, signal.default_int_handler)

def child(w, wait):
    where, took = "never", None
    try:
        os.write(w, b"g")
        t0 = time.perf_counter()
        torch.cuda._fake_cuda_init()
        took = time.perf_counter() - t0
        if wait:
            time.sleep(10)
    except KeyboardInterrupt:
        states = set((_outofcuda.status().get("cuda_init") or {}).values())
        where = ("after" if states <= {"done", "off"} else
                 "inside" if "interrupted" in states else "between")
    torch.cuda._fake_cuda_init()   # CUDA used again
    os.write(w, json.dumps(dict(outcome(), where=where, took=took)).encode())

def trial(delay):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child(w, delay is not None)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"g"
    if delay is not None:
        time.sleep(delay)
        os.kill(pid, signal.SIGINT)
    out = b""
    while True:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(out)

rng = random.Random(int(os.environ["TRIAL_SEED"]))
took = trial(None)["took"]
print(json.dumps({"took": took,
                  "trials": [trial(rng.uniform(0, 1.2 * took)) for _ in range(%d)]}))
"""
TRIALS = 40


def test_random_sigints_during_cudas_start_lose_no_step(venv, tmp_path, sm90):
    seed = random.randrange(1 << 30)
    d = last_json(venv.run(RANDOM_SIGINTS % TRIALS, env=dict(sm90, TRIAL_SEED=str(seed)),
                           cwd=tmp_path, args=("-W", "error"), timeout=300))
    trials = d["trials"]
    where = [t["where"] for t in trials]
    context = f"seed {seed}, one CUDA start {d['took'] * 1e3:.2f} ms, landed: {where}"
    assert "never" not in where, context       # every Ctrl-C reached the program
    for i, t in enumerate(trials):
        try:
            check_all_applied(t, once=False)
        except AssertionError as e:
            raise AssertionError(f"trial {i} ({t['where']}): {e}; {context}") from None


# ---- interrupts stay with their thread, any number at once ----

# Twelve threads, each inside outofcuda.clear_cache() at the same time, each
# with its own interrupt set aside (raised by torch's device_count on its
# first call in that thread) while all wait in empty_cache.
THREADS = """
import json, threading, torch, _outofcuda
N = 12
cuda = torch.cuda
local = threading.local()
barrier = threading.Barrier(N, timeout=60)
def device_count():
    if not getattr(local, "raised", False):
        local.raised = True
        raise local.exc
    return 0
cuda.is_initialized = lambda: True
cuda.device_count = device_count
cuda.empty_cache = lambda: barrier.wait()
seen = {}
def worker(i):
    local.exc = KeyboardInterrupt if i % 2 else SystemExit
    try:
        _outofcuda._api_clear_cache()
        seen[i] = "returned"
    except (KeyboardInterrupt, SystemExit) as e:
        seen[i] = type(e).__name__
threads = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps([seen[i] for i in range(N)]))
"""


def test_twelve_threads_each_get_their_own_interrupt_back(venv, tmp_path):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    seen = last_json(venv.run(THREADS, env={"PYTHONPATH": str(root)}, cwd=tmp_path,
                              args=("-W", "error")))
    assert seen == ["SystemExit", "KeyboardInterrupt"] * 6, seen


# ---- after torch's __init__: torch stays imported ----

# torch's cuDNN setter, which outofcuda calls once torch's __init__ has run,
# raises; the stand-in counts how often its __init__ runs.
AFTER_INIT = """
def _set_cudnn_benchmark(value):
    raise {exc}
"""
IMPORT_TWICE = """
import builtins, json, sys, threading
out = {{}}
def first_import():
    try:
        import torch
        out["first"] = "returned"
    except (KeyboardInterrupt, SystemExit) as e:
        out["first"] = type(e).__name__
    out["kept"] = "torch" in sys.modules
{how}
import torch, _outofcuda
out["inits"] = builtins.TORCH_INITS
out["fired"] = _outofcuda.status()["hook"]["fired"]
out["usable"] = torch.__version__
out["proxy_left"] = "proxy" in repr(torch.__loader__) + repr(torch.__spec__.loader)
print(json.dumps(out))
"""
HOW = {"main thread": "first_import()",
       "another thread": "t = threading.Thread(target=first_import)\nt.start()\nt.join()"}


@pytest.mark.parametrize("exc", ["KeyboardInterrupt", "SystemExit(3)"])
@pytest.mark.parametrize("thread", sorted(HOW))
def test_an_interrupt_after_torchs_init_leaves_torch_imported(venv, tmp_path, exc, thread):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    with open(root / "torch" / "_C.py", "a") as f:
        f.write(AFTER_INIT.format(exc=exc))
    with open(root / "torch" / "__init__.py", "a") as f:
        f.write("import builtins\nbuiltins.TORCH_INITS = getattr(builtins, 'TORCH_INITS', 0) + 1\n")
    d = last_json(venv.run(IMPORT_TWICE.format(how=HOW[thread]), env={"PYTHONPATH": str(root)},
                           cwd=tmp_path, args=("-W", "error")))
    # The interrupt reached the import it arrived in, in its own thread.
    assert d["first"] == exc.split("(")[0], d
    # torch's __init__ ran once: the second import got the same torch.
    assert d["inits"] == 1 and d["fired"] is True and d["usable"] == "2.14.1", d
    assert d["proxy_left"] is False
    if thread == "main thread":
        # raised once the import had returned: torch never left sys.modules
        assert d["kept"] is True, d


# ---- start-up ----

# An audit module of the dynamic loader (LD_AUDIT) that raises SIGINT in the
# process when the boot is mapped: a Ctrl-C that lands while the .pth line
# loads the boot.
AUDIT = r"""
#define _GNU_SOURCE
#include <link.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

unsigned int la_version(unsigned int version)
{
    /* Before Python starts: a test run started in the background hands its
     * children SIGINT ignored, and Python then installs no handler and a
     * Ctrl-C means nothing. Put it back at its default, as at a terminal. */
    (void)version;
    signal(SIGINT, SIG_DFL);
    return LAV_CURRENT;
}

unsigned int la_objopen(struct link_map *map, Lmid_t lmid, uintptr_t *cookie)
{
    static const char boot[] = "/outofcuda_hook.abi3.so";
    size_t n = map->l_name ? strlen(map->l_name) : 0;
    (void)lmid;
    (void)cookie;
    if (n >= sizeof boot - 1 && strcmp(map->l_name + n - (sizeof boot - 1), boot) == 0)
        raise(SIGINT);
    return 0;
}
"""


def test_a_ctrl_c_while_the_boot_loads_stops_start_up(venv, tmp_path):
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc to build the audit module")
    (tmp_path / "audit.c").write_text(AUDIT)
    so = tmp_path / "audit.so"
    subprocess.run([gcc, "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror", "-o", str(so),
                    str(tmp_path / "audit.c")], check=True)
    code = "print('the program ran')"
    r = venv.run(code, env={"LD_AUDIT": str(so)}, cwd=tmp_path)
    # As without outofcuda: the interpreter stops at start-up, on the Ctrl-C.
    assert "the program ran" not in r.stdout, (r.stdout, r.stderr)
    assert r.returncode != 0 and "KeyboardInterrupt" in r.stderr, (r.returncode, r.stderr)
    # The audit module itself changes nothing when the boot is not mapped.
    r = venv.run(code, env={"LD_AUDIT": str(so)}, cwd=tmp_path, args=("-S",))
    assert r.returncode == 0 and r.stdout == "the program ran\n", (r.stdout, r.stderr)


# A Ctrl-C while the OOM observer writes OUTOFCUDA_OOM_SNAPSHOT's file (a
# long dump): it reaches the program from the observer, not kept as the
# snapshot's error text.
IN_THE_SNAPSHOT = """
import json, types, torch, _outofcuda
def dump(path):
    raise KeyboardInterrupt
torch.cuda.memory = types.SimpleNamespace(_record_memory_history=lambda *a, **k: None,
                                          _dump_snapshot=dump)
torch.cuda._fake_cuda_init()
try:
    _outofcuda._oom_observer(0, 2 << 30, 80 << 30, 1 << 29)
    reached = None
except KeyboardInterrupt:
    reached = "KeyboardInterrupt"
print(json.dumps({"reached": reached, "error": _outofcuda.status()["hook"]["error"]}))
"""


def test_a_ctrl_c_while_the_snapshot_is_written_reaches_the_program(venv, tmp_path, sm90):
    env = dict(sm90, OUTOFCUDA_OOM_SNAPSHOT=str(tmp_path / "oom.pickle"))
    d = last_json(venv.run(IN_THE_SNAPSHOT, env=env, cwd=tmp_path, args=("-W", "error")))
    assert d == {"reached": "KeyboardInterrupt", "error": None}, d


# ---- two interrupts in one call ----

# A Ctrl-C, then the exit a SIGTERM handler makes (docker stop, a scheduler's
# preemption), both real signals, land in one memory_report() over two GPUs:
# each device's figures come from torch's memory_stats (a stand-in here),
# the first raising the Ctrl-C, the second the exit.
TWO_SIGNALS = """
import json, signal, sys, torch, _outofcuda
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
torch.cuda._fake_cuda_init()
torch.cuda.is_initialized = lambda: True
def memory_stats(device=None):
    signal.raise_signal(signal.SIGINT if device == 0 else signal.SIGTERM)
    return {}
torch.cuda.memory_stats = memory_stats
try:
    _outofcuda._api_memory_report()
    seen = ["returned"]
except BaseException as e:
    seen = [type(e).__name__, getattr(e, "code", None), type(e.__context__).__name__]
print(json.dumps(seen))
"""


def test_an_exit_outranks_a_ctrl_c_and_neither_is_lost(venv, tmp_path, stub_nvml):
    cfg = stub_nvml_config(tmp_path / "nvml.cfg", [stub_nvml_device(), stub_nvml_device(
        uuid="GPU-0a1b2c3d-0000-4000-8000-000000000001")])
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    env = {"LD_LIBRARY_PATH": str(stub_nvml), "STUB_NVML_CONFIG": str(cfg),
           "PYTHONPATH": str(root)}
    seen = last_json(venv.run(TWO_SIGNALS, env=env, cwd=tmp_path, args=("-W", "error")))
    # The exit is raised; the Ctrl-C that came first is its context.
    assert seen == ["SystemExit", 143, "KeyboardInterrupt"], seen
