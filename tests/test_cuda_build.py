"""The hook against the real CUDA build of torch (2.14.1, CUDA 13.0), which
imports without a GPU: everything that needs no device. Each scenario is a
fresh interpreter under `-W error`; none may initialise CUDA.

The `cuda_venv` fixture (tests/conftest.py) installs that build once per
session; OUTOFCUDA_TEST_CUDA_VENV reuses an environment that has it."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import _unavailable
from kit import flags_script

# outofcuda's allocator defaults (OUTOFCUDA_ALLOC_CONF unset): no max_split_size_mb
# beside expandable segments (pytorch issue 123548)
DEFAULTS = "garbage_collection_threshold:0.8,expandable_segments:True"

FLAGS = flags_script("""
    'allocator': torch._C._accelerator_getAllocatorSettings(),
    'backend': torch._C._cuda_getAllocatorBackend(),
    'alloc_env': {k: v for k, v in os.environ.items() if k.startswith('PYTORCH_') and k.endswith('ALLOC_CONF')},
    'queued': [getattr(fn, '__name__', '') for fn, _stack in torch.cuda._queued_calls],
""")

# torch 2.14.1's own values, read with OUTOFCUDA_DISABLE=1 on this build.
TORCH_DEFAULTS = {"matmul_tf32": False, "matmul_precision": "highest", "cudnn_tf32": True,
                  "benchmark": False, "deterministic": False, "flash": True,
                  "mem_efficient": True, "math": True, "cudnn_sdp": True, "allocator": "",
                  "backend": "native", "alloc_env": {}, "cuda_initialized": False}


def report(venv, code, env=None, args=(), prefix="FLAGS="):
    return venv.json(code, prefix, quiet=True, env=env, args=("-W", "error", *args))


def flags(venv, env=None):
    return report(venv, FLAGS, env=env)


def test_hook_fires_without_initialising_cuda(cuda_venv):
    st = report(cuda_venv, """
import json, torch, _outofcuda
st = _outofcuda.status()
st['cuda'] = torch.version.cuda
st['cuda_initialized'] = torch.cuda.is_initialized()
print('ST=' + json.dumps(st))
""", prefix="ST=")
    assert st["hook"] == {"installed": True, "fired": True, "error": None}
    assert st["torch"].startswith("2.14.1") and st["cuda"] is not None
    assert st["cuda_initialized"] is False
    opts = st["optimizations"]
    for name in ("cudnn_benchmark", "allocator"):
        assert opts[name]["applied"], (name, opts[name])
    # What waits for CUDA's start is queued, not applied (here CUDA cannot start).
    for name in ("tf32", "memory_fraction", "oom_handler"):
        assert opts[name]["queued"] is True and opts[name]["applied"] is False, (name, opts[name])
    # TF32 waits for CUDA; SDPA's backends are torch's defaults already.
    assert (opts["tf32"]["state"], opts["tf32"]["code"]) == ("queued", "at_cuda_init")
    assert opts["tf32"]["now"] == {"matmul": False}
    assert not opts["sdpa"]["applied"] and opts["sdpa"]["code"] == "torch_default"


def test_flags_read_back_through_torchs_getters(cuda_venv):
    f = flags(cuda_venv)
    # One callback for everything outofcuda does when CUDA starts.
    assert [q for q in f["queued"] if q.startswith("outofcuda")] == ["outofcuda_at_cuda_init"]
    del f["queued"]
    # The float32 precision is the program's until CUDA starts (test_precision.py).
    assert f == dict(TORCH_DEFAULTS, benchmark=True, allocator=DEFAULTS)


def test_disable_leaves_torchs_defaults(cuda_venv):
    f = flags(cuda_venv, env={"OUTOFCUDA_DISABLE": "1"})
    assert not [q for q in f.pop("queued") if q.startswith("outofcuda")]
    assert f == TORCH_DEFAULTS


def test_every_off_switch(cuda_venv):
    f = flags(cuda_venv, env={
        "OUTOFCUDA_TF32": "0", "OUTOFCUDA_CUDNN_BENCHMARK": "off", "OUTOFCUDA_FLASH_ATTN": "0",
        "OUTOFCUDA_MEM_EFF_ATTN": "no", "OUTOFCUDA_MATH_ATTN": "false"})
    assert (f["matmul_tf32"], f["matmul_precision"], f["cudnn_tf32"]) == (False, "highest", True)
    assert f["benchmark"] is False
    assert (f["flash"], f["mem_efficient"], f["math"], f["cudnn_sdp"]) == (False, False, False, True)


def test_deterministic_forces_benchmark_off(cuda_venv):
    f = flags(cuda_venv, env={"OUTOFCUDA_CUDNN_DETERMINISTIC": "1"})
    assert f["deterministic"] is True and f["benchmark"] is False


def test_nvidia_tf32_override_keeps_tf32_off(cuda_venv):
    f = flags(cuda_venv, env={"NVIDIA_TF32_OVERRIDE": "0"})
    assert f["matmul_tf32"] is False and f["matmul_precision"] == "highest"


def test_frozen_flags_are_respected(cuda_venv):
    # The hook installs after torch (python -S, then install()), the only way
    # disable_global_flags() can come first.
    f = report(cuda_venv, f"""
import sys
sys.path.append({str(cuda_venv.site)!r})
import torch
torch.backends.disable_global_flags()
import _outofcuda
_outofcuda.install()
""" + FLAGS, args=("-S",))
    assert f["matmul_tf32"] is False and f["benchmark"] is False
    assert f["cuda_initialized"] is False


# ---- the allocator ----

def test_allocator_holds_the_merge_and_the_variable_is_given_back(cuda_venv):
    f = flags(cuda_venv, env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
    # no expandable segments beside the user's max_split_size_mb
    assert f["allocator"] == "max_split_size_mb:512,garbage_collection_threshold:0.8"
    assert f["alloc_env"] == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert f["cuda_initialized"] is False


def test_the_variable_is_set_while_torchs_libraries_load(cuda_venv):
    # `backend` is parsed only while torch's libraries load: seeing it in
    # effect proves the variable held outofcuda's string then.
    f = flags(cuda_venv, env={"OUTOFCUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert f["backend"] == "cudaMallocAsync" and f["allocator"] == "backend:cudaMallocAsync"
    assert f["alloc_env"] == {}


def test_an_empty_variable_counts_as_set(cuda_venv):
    f = flags(cuda_venv, env={"PYTORCH_CUDA_ALLOC_CONF": "",
                              "PYTORCH_ALLOC_CONF": "max_split_size_mb:999"})
    # torch stops at the empty PYTORCH_CUDA_ALLOC_CONF; outofcuda follows it.
    assert f["allocator"] == DEFAULTS
    assert f["alloc_env"] == {"PYTORCH_CUDA_ALLOC_CONF": "",
                              "PYTORCH_ALLOC_CONF": "max_split_size_mb:999"}


def test_torchs_own_empty_variable_rule(cuda_venv):
    # The fact the test above relies on, read from torch itself.
    f = flags(cuda_venv, env={"OUTOFCUDA_DISABLE": "1", "PYTORCH_CUDA_ALLOC_CONF": "",
                              "PYTORCH_ALLOC_CONF": "max_split_size_mb:999"})
    assert f["allocator"] == ""


def test_cuda_malloc_async_gets_no_native_keys(cuda_venv):
    # torch warns about native-allocator keys beside this backend (-W error).
    f = flags(cuda_venv, env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert f["allocator"] == "backend:cudaMallocAsync" and f["backend"] == "cudaMallocAsync"


CHILDREN = """
import json, os, subprocess, sys, torch
out = {}
for name, extra in [("plain", {}), ("disabled", {"OUTOFCUDA_DISABLE": "1"}),
                    ("own", {"OUTOFCUDA_ALLOC_CONF": "max_split_size_mb:256"})]:
    child = subprocess.run([sys.executable, "-W", "error", "-c",
                            "import json, os, torch; print(json.dumps(["
                            "torch._C._accelerator_getAllocatorSettings(), "
                            "{k: v for k, v in os.environ.items() if k.startswith('PYTORCH_') and k.endswith('ALLOC_CONF')}]))"],
                           env=dict(os.environ, **extra), capture_output=True, text=True)
    out[name] = json.loads(child.stdout) if child.returncode == 0 else child.stderr[-500:]
print('CHILDREN=' + json.dumps(out))
"""


def test_children_see_the_users_environment(cuda_venv):
    c = report(cuda_venv, CHILDREN, prefix="CHILDREN=")
    assert c["plain"] == [DEFAULTS, {}]                     # the child's own outofcuda
    assert c["disabled"] == ["", {}]                        # OUTOFCUDA_DISABLE=1 wins
    assert c["own"] == ["max_split_size_mb:256", {}]        # the child's own settings win


def test_no_child_spawned_while_torch_imports_sees_outofcuda_s_string(cuda_venv):
    # Every import inside `import torch` passes the audit hook on the importing
    # thread: the environment it sees is what a child spawned then inherits.
    from test_gating import WATCH_ENV
    f = report(cuda_venv, WATCH_ENV + FLAGS.replace("'queued':",
                                                    "'seen': sorted(SEEN_WHILE_IMPORTING), 'queued':"))
    assert f["seen"] == [] and f["alloc_env"] == {}
    assert f["allocator"] == DEFAULTS and f["backend"] == "native"


# ---- work deferred to CUDA initialisation ----

FRACTION = """
import json, torch, _outofcuda
C = torch._C
calls = []
queued = {getattr(fn, '__name__', ''): fn for fn, _stack in torch.cuda._queued_calls}
# Stand-ins for the device calls the callback makes (no GPU here).
C._cuda_getDeviceCount = lambda: 4
C._cuda_getDevice = lambda: 1
C._cuda_setMemoryFraction = lambda fraction, device: calls.append([fraction, device])
C._cuda_getMemoryFraction = lambda device: 1.0  # torch's: no limit held
C._cuda_attach_out_of_memory_observer = lambda fn: calls.append(['observer'])
queued['outofcuda_at_cuda_init']()
print('FRACTION=' + json.dumps({
    'calls': calls, 'status': _outofcuda.status()['optimizations']['memory_fraction'],
    'oom_queued': calls[-1:] == [['observer']],
    'cuda_initialized': torch.cuda.is_initialized()}))
"""


@pytest.mark.parametrize("local_rank,device", [("2", 2), (None, 1), ("7", 1), ("x", 1)])
def test_queued_memory_fraction_takes_local_rank(cuda_venv, local_rank, device):
    f = report(cuda_venv, FRACTION, env={"LOCAL_RANK": local_rank}, prefix="FRACTION=")
    assert f["calls"] == [[0.95, device], ["observer"]]  # in the stated order
    assert f["status"]["applied"] and f["status"]["value"] == {"fraction": 0.95, "device": device}
    assert (f["status"]["state"], f["status"]["code"]) == ("applied", "at_cuda_init")
    assert ("local_rank" in f["status"]["notes"]) == (local_rank == "2")
    assert f["oom_queued"] and f["cuda_initialized"] is False


def test_a_fraction_torch_refuses_at_cudas_start_reads_failed(cuda_venv):
    """A setter that raises at CUDA's start: the record says failed, with the
    error in status()["hook"]["error"], never queued for ever."""
    code = FRACTION.replace(
        "C._cuda_setMemoryFraction = lambda fraction, device: calls.append([fraction, device])",
        "def refuse(fraction, device):\n    raise RuntimeError('no fraction here')\n"
        "C._cuda_setMemoryFraction = refuse").replace(
        "'oom_queued':", "'error': _outofcuda.status()['hook']['error'], 'oom_queued':")
    # One warning names the failure (quiet=False: stderr holds it).
    f = cuda_venv.json(code, "FRACTION=", quiet=False, args=("-W", "error"))
    assert (f["status"]["state"], f["status"]["code"]) == ("failed", "error"), f["status"]
    assert not f["status"].get("queued") and "no fraction here" in f["error"], f
    assert f["calls"] == [["observer"]]  # the steps after it still ran


# ---- frameworks that own GPU memory (src/frameworks.c) ----

# torch's live expandable_segments setting: no getter reads it without CUDA
# (_accelerator_getAllocatorSettings() returns the last string given), so it is
# read from AcceleratorAllocatorConfig::instance(): the byte that follows
# expandable_segments True/False, found by setting both after the state was
# read (the configuration is left changed).
EXPANDABLE = """
def expandable_flag():
    import ctypes, os, torch
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    instance = lib._ZN3c1016CachingAllocator26AcceleratorAllocatorConfig8instanceEv
    instance.restype = ctypes.c_void_p
    p, n = instance(), 512
    now = ctypes.string_at(p, n)
    seen = []
    for value in ("True", "False", "True"):
        torch._C._accelerator_setAllocatorSettings("expandable_segments:" + value)
        seen.append(ctypes.string_at(p, n))
    (i,) = [i for i in range(n) if (seen[0][i], seen[1][i], seen[2][i]) == (1, 0, 1)]
    return bool(now[i])
"""

# {imports} runs first: a framework imported before torch imports torch itself.
CUDA_INIT = EXPANDABLE + """
{imports}
import json, os, torch, _outofcuda
C = torch._C
calls = []
C._cuda_getDeviceCount = lambda: 4
C._cuda_getDevice = lambda: 0
C._cuda_setMemoryFraction = lambda fraction, device: calls.append([fraction, device])
C._cuda_attach_out_of_memory_observer = lambda fn: None
for fn, _stack in torch.cuda._queued_calls:
    if getattr(fn, '__name__', '').startswith('outofcuda'):
        fn()
opts = _outofcuda.status()['optimizations']
print('INIT=' + json.dumps({{
    'allocator': C._accelerator_getAllocatorSettings(), 'fractions': calls,
    'alloc_env': {{k: v for k, v in os.environ.items() if k.endswith('ALLOC_CONF')}},
    'status': {{k: opts[k] for k in ('allocator', 'memory_fraction')}},
    'framework': _outofcuda.status()['framework'],
    'error': _outofcuda.status()['hook']['error'],
    'expandable': expandable_flag(), 'cuda_initialized': torch.cuda.is_initialized()}}))
"""


def cuda_init(venv, imports, env=None):
    return report(venv, CUDA_INIT.format(imports=imports), env=env, prefix="INIT=")


def test_torchs_setter_keeps_expandable_segments(cuda_venv):
    # The fact the hand-back relies on, read from torch itself: its runtime
    # parser resets max_split_size, roundup_power2_divisions and
    # garbage_collection_threshold when a string leaves them out, but not
    # expandable_segments.
    f = report(cuda_venv, EXPANDABLE + """
import json, torch
S = torch._C._accelerator_setAllocatorSettings
S("garbage_collection_threshold:0.8,expandable_segments:True")
S("max_split_size_mb:256")
print('KEPT=' + json.dumps([torch._C._accelerator_getAllocatorSettings(), expandable_flag()]))
""", env={"OUTOFCUDA_DISABLE": "1"}, prefix="KEPT=")
    assert f == ["max_split_size_mb:256", True]


# expandable-ipc-2.13 on the real 2.14.1 (an affected release): a real DataLoader
# worker, forked from a parent that never started CUDA, runs outofcuda's CUDA-start
# callback as CUDA's start would (the device calls stood in), then the parent does.
WORKER = EXPANDABLE + """
import json, torch, _outofcuda
from torch.utils.data import DataLoader, Dataset
C = torch._C
C._cuda_getDeviceCount = lambda: 1
C._cuda_getDevice = lambda: 0
C._cuda_setMemoryFraction = lambda fraction, device: None
C._cuda_attach_out_of_memory_observer = lambda fn: None
def start_cuda():
    for fn, _stack in torch.cuda._queued_calls:
        if getattr(fn, '__name__', '').startswith('outofcuda'):
            fn()
    st = _outofcuda.status()
    (e,) = [b for b in st['known_bugs'] if b['id'] == 'expandable-ipc-2.13']
    return json.dumps([e['code'], st['optimizations']['allocator']['code'],
                       C._accelerator_getAllocatorSettings(), expandable_flag()])
class D(Dataset):
    def __len__(self):
        return 1
    def __getitem__(self, i):
        return start_cuda()
(w,) = DataLoader(D(), batch_size=None, num_workers=1, multiprocessing_context='fork')
print('IPC=' + json.dumps([json.loads(w), json.loads(start_cuda())]))
"""


def test_a_dataloader_worker_starts_cuda_without_outofcudas_expandable_segments(cuda_venv):
    worker, main = report(cuda_venv, WORKER, prefix="IPC=")
    assert worker == ["avoided", "at_cuda_init",
                      "expandable_segments:False,garbage_collection_threshold:0.8", False], worker
    assert main == ["applies", "runtime_setter", DEFAULTS, True], main


@pytest.fixture
def frameworks_path(tmp_path):
    from fake_frameworks import FILES, make_fake_framework
    for name in FILES:
        make_fake_framework(tmp_path / "fw", name)
    return str(tmp_path / "fw")


@pytest.mark.parametrize("framework", ["vllm", "sglang", "torch_memory_saver"])
def test_framework_importing_torch_on_the_cuda_build(cuda_venv, frameworks_path, framework):
    user = "garbage_collection_threshold:0.6"
    f = cuda_init(cuda_venv, f"import {framework}", env={
        "PYTHONPATH": frameworks_path, "PYTORCH_CUDA_ALLOC_CONF": user})
    # torch read the user's variable as it was: outofcuda never wrote it.
    assert f["allocator"] == user and f["alloc_env"] == {"PYTORCH_CUDA_ALLOC_CONF": user}
    assert f["expandable"] is False and f["fractions"] == []
    for entry in f["status"].values():
        # Found at torch's import already: left to it, not handed back.
        assert not entry["applied"] and entry["code"] == "framework", entry
    assert f["error"] is None and f["cuda_initialized"] is False


@pytest.mark.parametrize("user", [None, "garbage_collection_threshold:0.6"])
def test_framework_imported_after_torch_gets_the_users_allocator(cuda_venv, frameworks_path,
                                                                 user):
    env = {"PYTHONPATH": frameworks_path, "PYTORCH_ALLOC_CONF": user}
    f = cuda_init(cuda_venv, "import torch; import vllm", env=env)
    assert f["allocator"] == (user or "")        # exactly the user's own string
    assert f["expandable"] is False              # turned off again before the user's string
    assert f["fractions"] == []
    assert f["status"]["allocator"]["code"] == "handed_back"
    assert f["status"]["memory_fraction"]["code"] == "framework"
    assert f["framework"]["left_to"] == "vLLM"  # which framework, by name
    assert f["error"] is None and f["cuda_initialized"] is False


def test_plain_process_beside_installed_frameworks_keeps_everything(cuda_venv, frameworks_path):
    f = cuda_init(cuda_venv, "", env={"PYTHONPATH": frameworks_path})
    assert f["allocator"] == DEFAULTS and f["expandable"] is True
    assert f["fractions"] == [[0.95, 0]]
    assert all(entry["applied"] for entry in f["status"].values())


@pytest.fixture(scope="session")
def vllm_dir(cuda_base_venv, tmp_path_factory):
    """The real vllm 0.33.0 wheel (no dependencies but `packaging`, enough to
    import it beside torch 2.14.1), installed once into a folder of its own
    that a scenario puts on PYTHONPATH: the CUDA environment stays as it is.
    OUTOFCUDA_TEST_VLLM_DIR reuses one across runs."""
    from conftest import _pip
    reuse = os.environ.get("OUTOFCUDA_TEST_VLLM_DIR")
    path = Path(reuse) if reuse else tmp_path_factory.mktemp("vllm") / "site"
    if not (path / ".ready").exists():
        try:
            _pip(cuda_base_venv / "bin" / "python", "install", "--no-deps", "--target",
                 str(path), "vllm==0.33.0", "packaging")
        except subprocess.CalledProcessError as e:
            _unavailable(f"pip install vllm==0.33.0 failed (exit {e.returncode})")
        (path / ".ready").write_text("ok")
    return str(path)


@pytest.mark.parametrize("imports", ["import vllm", "import torch; import vllm"])
def test_the_real_vllm_wheel_keeps_its_allocator(cuda_venv, vllm_dir, imports):
    f = cuda_init(cuda_venv, imports, env={"PYTHONPATH": vllm_dir})
    # What vLLM's own checks read (the variable) and what torch's allocator
    # holds agree: nothing of outofcuda's in either, and no fraction.
    assert f["allocator"] == "" and f["alloc_env"] == {}
    assert f["expandable"] is False and f["fractions"] == []
    alloc = f["status"]["allocator"]
    assert f["framework"]["left_to"] == "vLLM"  # which framework, by name
    # Found at torch's import when vllm imported torch, else at CUDA initialisation.
    assert alloc["code"] == ("handed_back" if imports.startswith("import torch") else "framework")
    assert f["error"] is None and f["cuda_initialized"] is False


def test_excepthooks_untouched_on_cuda_build(cuda_venv):
    """The excepthooks stay Python's own until CUDA initialises."""
    r = cuda_venv.check("""
import sys, threading, torch
assert sys.excepthook is sys.__excepthook__, sys.excepthook
assert threading.excepthook is threading.__excepthook__, threading.excepthook
""")
    assert r.stderr == ""


def test_a_missing_cuda_build_skips_here_and_fails_in_ci(monkeypatch):
    from conftest import _unavailable
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="unavailable in CI: no disk"):
        _unavailable("no disk")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="unavailable: no disk"):
        _unavailable("no disk")


@pytest.mark.parametrize("how", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "setter"])
def test_the_users_own_memory_fraction_wins(cuda_venv, how):
    # torch applies per_process_memory_fraction when CUDA initialises, before
    # the lazy-init queue: outofcuda's fraction would overwrite it.
    code, env = FRACTION, {"OUTOFCUDA_MEMORY_FRACTION": "1"}
    if how == "setter":
        code = code.replace("queued['outofcuda_at_cuda_init']()",
                            "C._accelerator_setAllocatorSettings('per_process_memory_fraction:0.5')"
                            "\nqueued['outofcuda_at_cuda_init']()")
    else:
        env[how] = "per_process_memory_fraction:0.5"
    f = report(cuda_venv, code, env=env, prefix="FRACTION=")
    assert f["calls"] == [["observer"]]
    assert not f["status"]["applied"] and f["status"]["code"] == "program_chose", f["status"]
    assert f["status"]["chosen"] == 0.5, f["status"]
    assert f["status"]["variable"] == (None if how == "setter" else how), f["status"]


def test_what_waits_for_cuda_shows_as_queued(cuda_venv, tmp_path):
    # No driver here: CUDA never starts, so nothing queued is ever applied.
    r = cuda_venv.run("import torch", env={"OUTOFCUDA_VERBOSE": "1"}, args=("-W", "error"))
    rows = {ln.split()[0]: ln.split()[1] for ln in r.stderr.splitlines()
            if ln.startswith("  ") and len(ln.split()) > 1 and not ln.startswith("      ")}
    assert rows["tf32"] == rows["memory_fraction"] == rows["oom_handler"] == "queued", r.stderr
    assert rows["cudnn_benchmark"] == "yes"
    r = cuda_venv.run(None, args=("-m", "outofcuda", "status"), cwd=tmp_path, timeout=300)
    assert re.search(r"^  tf32 +queued ", r.stdout, re.M), r.stdout
    assert re.search(r"^  memory_fraction +queued ", r.stdout, re.M), r.stdout


def test_doctor_says_what_outofcuda_can_do_without_a_driver(cuda_venv, tmp_path):
    r = cuda_venv.run(None, args=("-m", "outofcuda", "doctor", "--json"), cwd=tmp_path,
                      timeout=300)
    d = json.loads(r.stdout)
    assert d["scope"].startswith("no NVIDIA GPU is usable here"), d["scope"]
    r = cuda_venv.run(None, args=("-m", "outofcuda", "doctor"), cwd=tmp_path, timeout=300)
    assert "\nhealthy" not in r.stdout
    assert "outofcuda can do little here: no NVIDIA GPU" in " ".join(r.stdout.split()), r.stdout
