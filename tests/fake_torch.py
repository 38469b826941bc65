"""Builds stand-ins for torch releases this machine cannot install (CUDA
builds of 2.0 ... newest). Each package exposes exactly the `torch._C` names,
allocator variables and warnings that release has, as read from its sources
and wheels; every call is recorded so a test can see what outofcuda did.

RELEASES names the stand-ins. What was recorded from the real wheels
(tests/releases.json: the allocator functions of `torch._C` and the keys its
parser knows, the bundled cuDNN and NCCL, torch.version.cuda, FSDPModule and
the autocast getters of each series) is taken from the record of the
stand-in's series, never written here; the allocator variables, warnings and
the other `_C` names are read from torch's sources.

Where this stand-in and the real CUDA build of torch 2.14.1 disagreed, the real
build was followed (tests/test_cuda_build.py runs the same checks on it):
- `torch.cuda._queued_calls` holds `(callable, formatted stack)` pairs;
- an empty allocator variable counts as set (the first one set wins);
- the allocator reads its variable lazily, at its first use or settings call,
  except `backend`, read while the libraries load; the runtime setters parse
  a string at once (an unknown key raises there) and the configuration keeps it;
- a CPU-only build has no `torch._C._cuda_*` names;
- getters return what was set, starting from torch's defaults;
- `backend:cudaMallocAsync` beside native-allocator keys warns.
- `torch.backends.cudnn.version()` reports the bundled cuDNN (92400 on 2.14.1)
  without initialising CUDA, None on a CPU-only build; `_set_sdp_use_cudnn` is
  read back by `_get_cudnn_sdp_enabled` (True until set);
- `torch.nn.attention.sdpa_kernel()` (releases with cuDNN attention) is a
  generator context manager that saves the flags in `previous_backends`.
"""
import json
import textwrap
from pathlib import Path

BASE_C = {"_set_cublas_allow_tf32", "_get_cublas_allow_tf32", "_set_cudnn_allow_tf32",
          "_get_cudnn_allow_tf32", "_set_cudnn_benchmark", "_get_cudnn_benchmark",
          "_set_cudnn_deterministic", "_get_cudnn_deterministic", "_set_sdp_use_flash",
          "_set_sdp_use_mem_efficient", "_set_sdp_use_math", "_get_flash_sdp_enabled",
          "_get_mem_efficient_sdp_enabled", "_get_math_sdp_enabled",
          "_set_float32_matmul_precision", "_get_float32_matmul_precision",
          # CUDA-build-only names
          "_cuda_setMemoryFraction", "_cuda_getDeviceCount", "_cuda_getDevice",
          "_cuda_attach_out_of_memory_observer"}
LEGACY_SETTER = "_cuda_cudaCachingAllocator_set_allocator_settings"
ACCEL_SETTER = "_accelerator_setAllocatorSettings"
ACCEL_GETTER = "_accelerator_getAllocatorSettings"
CUDA_ONLY_VAR = ("PYTORCH_CUDA_ALLOC_CONF",)
VARS_211 = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

# What was recorded from the real wheels, one record per release series
# (tests/releases.json): the allocator functions and keys, cuDNN, NCCL, CUDA,
# FSDPModule and the autocast getters of each stand-in come from there.
RECORDS = json.loads((Path(__file__).with_name("releases.json")).read_text())


def record_of(release):
    """The record of the series `release` (e.g. "2.9.1") belongs to."""
    return RECORDS["releases"][".".join(release.split(".")[:2])]


# 2.9+: the fp32_precision API beside the legacy one.
FP32_API = {"_get_fp32_precision_getter", "_set_fp32_precision_setter"}
# _cuda_getMemoryFraction (torch.cuda.get_per_process_memory_fraction), 2.8+.
GET_FRACTION = {"_cuda_getMemoryFraction"}


def _release(name, c, env, warns=frozenset()):
    # c: the hand-written names beside the recorded ones; the record gives
    # the allocator functions and keys, cuDNN (what torch.backends.cudnn.version()
    # reports on the CUDA build), NCCL, CUDA, FSDPModule and the autocast
    # getters (2.4+: get_autocast_dtype, set_autocast_dtype, annotated version.py).
    rec = record_of(name)
    if "_set_sdp_use_cudnn" in c:
        c = c | {"_get_cudnn_sdp_enabled"}
    modern = rec["autocast_getter"] == "get_autocast_dtype"
    return dict(c=BASE_C | c | set(rec["allocator"]), keys=set(rec["allocator_keys"]),
                autocast_new=modern, annotated_version=modern, warns=set(warns), env=env,
                cudnn=rec["cudnn"], fsdp=rec["fsdp"], autocast_getter=rec["autocast_getter"],
                nccl=rec["nccl"], cuda=rec["cuda"])


SDPA_CUDNN = {"_set_sdp_use_cudnn"}
RELEASES = {
    "2.0.1": _release("2.0.1", set(), CUDA_ONLY_VAR),
    "2.1.0": _release("2.1.0", set(), CUDA_ONLY_VAR),
    "2.4.1": _release("2.4.1", SDPA_CUDNN, CUDA_ONLY_VAR),
    # 2.9.0 alone warns on the cuDNN TF32 setter, setFloat32MatmulPrecision
    # and the legacy getters (PR 158209).
    "2.9.0": _release("2.9.0", SDPA_CUDNN | FP32_API | GET_FRACTION, CUDA_ONLY_VAR,
                      {"_set_cudnn_allow_tf32", "_get_cublas_allow_tf32", "_get_cudnn_allow_tf32",
                       "_set_float32_matmul_precision", "_get_float32_matmul_precision"}),
    "2.9.1": _release("2.9.1", SDPA_CUDNN | FP32_API | GET_FRACTION, CUDA_ONLY_VAR),
    "2.10.0": _release("2.10.0", SDPA_CUDNN | FP32_API | GET_FRACTION, CUDA_ONLY_VAR),
    "2.11.0": _release("2.11.0", SDPA_CUDNN | FP32_API | GET_FRACTION, VARS_211),
    "2.12.1": _release("2.12.1", SDPA_CUDNN | FP32_API | GET_FRACTION, VARS_211),
    "2.14.1": _release("2.14.1", SDPA_CUDNN | FP32_API | GET_FRACTION, VARS_211),
    "2.15.0": _release("2.15.0", SDPA_CUDNN | FP32_API | GET_FRACTION, VARS_211),
}

_INIT = '''
import os, warnings
from torch import version
from torch import _C
__version__ = version.__version__
# What the allocator reads when torch's libraries load (`backend` only).
_C.ENV_AT_LOAD = {{k: os.environ.get(k) for k in
                   ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}}
ALLOC_ENV_ORDER = {env!r}
ALLOC_KEYS = {keys!r}

def _alloc_conf():
    """The string this release's CUDA allocator parses at its first use: the
    one given to a runtime setter, else the first variable set (an empty one
    counts), read now."""
    if _C.allocator_settings is None:
        value = ""
        for name in ALLOC_ENV_ORDER:
            if os.environ.get(name) is not None:
                value = os.environ[name]
                break
        _C._parse_alloc_conf(value)
    return _C.allocator_settings

float16, bfloat16, float32 = "torch.float16", "torch.bfloat16", "torch.float32"

def _record(name, *args):
    _C.calls.append((name,) + args)

{autocast}
from torch import backends, cuda
'''

# torch's autocast dtypes (its defaults until a setter runs).
_AUTOCAST = '''
_autocast = {"cuda": float16, "cpu": bfloat16}
'''
_AUTOCAST_NEW = _AUTOCAST + '''
def set_autocast_dtype(device, dtype):
    _record("set_autocast_dtype", device, dtype)
    _autocast[device] = dtype

def get_autocast_dtype(device):
    return _autocast[device]

def set_autocast_gpu_dtype(dtype):
    warnings.warn("torch.set_autocast_gpu_dtype is deprecated", DeprecationWarning)
    _record("set_autocast_gpu_dtype", dtype)
    _autocast["cuda"] = dtype

def get_autocast_gpu_dtype():
    warnings.warn("torch.get_autocast_gpu_dtype is deprecated", DeprecationWarning)
    return _autocast["cuda"]
'''
# Before 2.4: a getter and a setter per device type.
_AUTOCAST_OLD = _AUTOCAST + '''
def set_autocast_gpu_dtype(dtype):
    _record("set_autocast_gpu_dtype", dtype)
    _autocast["cuda"] = dtype

def get_autocast_gpu_dtype():
    return _autocast["cuda"]

def get_autocast_cpu_dtype():
    return _autocast["cpu"]
'''

_C_MODULE = '''
import warnings
calls = []
allocator_settings = None
# The caching allocator's memory fraction (1.0: no limit), as
# _cuda_getMemoryFraction reads it.
fraction = [1.0]
ALLOC_KEYS = {keys!r}
_WARNS = {warns!r}
# torch's defaults, what the getters return until a setter runs.
_state = {{"cublas_allow_tf32": False, "cudnn_allow_tf32": True, "cudnn_benchmark": False,
          "cudnn_deterministic": False, "float32_matmul_precision": "highest",
          "flash_sdp_enabled": True, "mem_efficient_sdp_enabled": True,
          "math_sdp_enabled": True, "cudnn_sdp_enabled": True}}
_SDP = {{"_set_sdp_use_flash": "flash_sdp_enabled",
        "_set_sdp_use_mem_efficient": "mem_efficient_sdp_enabled",
        "_set_sdp_use_math": "math_sdp_enabled", "_set_sdp_use_cudnn": "cudnn_sdp_enabled"}}
# 2.9+'s fp32_precision levels, as measured on the CUDA build of 2.14.1: a
# level left at "none" inherits from the one above it; the legacy setters
# write the new state too, the new setters only it; a legacy getter raises
# when the new state disagrees with its own ("mix of the legacy and new APIs").
_fp32 = {{("generic", "all"): "none", ("cuda", "all"): "none", ("cuda", "matmul"): "none",
         ("cuda", "conv"): "none", ("cuda", "rnn"): "none"}}
_MIX = "you have used mix of the legacy and new APIs to set the TF32 status"

def _effective(op):
    for key in (("cuda", op), ("cuda", "all"), ("generic", "all")):
        if _fp32[key] != "none":
            return _fp32[key]
    return "none"

def _get_fp32_precision_getter(backend, op):
    calls.append(("_get_fp32_precision_getter", backend, op))
    return _effective(op) if backend == "cuda" else _fp32[(backend, op)]

def _set_fp32_precision_setter(backend, op, precision):
    calls.append(("_set_fp32_precision_setter", backend, op, precision))
    _fp32[(backend, op)] = precision

_PRECISION = ("cublas_allow_tf32", "cudnn_allow_tf32", "float32_matmul_precision")

def _legacy_get(name):
    eff = _effective("conv" if name == "cudnn_allow_tf32" else "matmul")
    if "_get_fp32_precision_getter" in globals() and eff != "none" and name in _PRECISION:
        if name == "float32_matmul_precision":
            if eff == "tf32" and _state[name] == "highest":
                raise RuntimeError(_MIX)
        elif (eff == "tf32") != bool(_state[name]):
            raise RuntimeError(_MIX)
    return _state[name]

def _legacy_set(name, value):
    if name == "float32_matmul_precision":
        _state[name] = value
        _state["cublas_allow_tf32"] = value != "highest"
    elif name == "cublas_allow_tf32":
        _state[name] = value
        _state["float32_matmul_precision"] = "high" if value else "highest"
    else:
        _state[name] = value
    if "_get_fp32_precision_getter" in globals() and name in _PRECISION:
        tf32 = _state["cublas_allow_tf32"] if name != "cudnn_allow_tf32" else value
        _fp32[("cuda", "conv" if name == "cudnn_allow_tf32" else "matmul")] = \
            "tf32" if tf32 else "ieee"
_NATIVE_ONLY = {{"max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions",
                "expandable_segments", "max_non_split_rounding_mb"}}

def _parse_alloc_conf(value):
    """Like the real parser: an unknown key raises; the string is kept."""
    global allocator_settings
    keys = set()
    for item in filter(None, value.split(",")):
        key = item.split(":")[0]
        if ":" in item and not item.startswith(("[", ">")) and not key.isdigit() \\
                and not key.endswith("]"):
            if key not in ALLOC_KEYS:
                raise RuntimeError("Unrecognized CachingAllocator option: " + key)
            keys.add(key)
    if "backend:cudaMallocAsync" in value and keys & _NATIVE_ONLY:
        warnings.warn("backend:cudaMallocAsync ignores max_split_size_mb, "
                      "roundup_power2_divisions, and garbage_collect_threshold.", UserWarning)
    allocator_settings = value

def _make(name):
    def fn(*args):
        if name in _WARNS:
            warnings.warn(name + " is deprecated in this release", UserWarning)
        calls.append((name,) + args)
        if name == "_cuda_getDeviceCount":
            return 4
        if name == "_cuda_getDevice":
            return 0
        if name in ("_accelerator_setAllocatorSettings",
                    "_cuda_cudaCachingAllocator_set_allocator_settings"):
            _parse_alloc_conf(args[0])
        if name == "_accelerator_getAllocatorSettings":
            import torch
            return torch._alloc_conf()
        if name == "_cuda_setMemoryFraction":
            fraction[0] = args[0]
        if name == "_cuda_getMemoryFraction":
            return fraction[0]
        if name in _SDP:
            _state[_SDP[name]] = args[0]
        elif name.startswith("_set_"):
            _legacy_set(name[5:], args[0])
        if name.startswith("_get_"):
            return _legacy_get(name[5:]) if name[5:] in _state else True
        return None
    fn.__name__ = name
    return fn
for _name in {names!r}:
    if _name not in ("_get_fp32_precision_getter", "_set_fp32_precision_setter"):
        globals()[_name] = _make(_name)
for _name in ("_get_fp32_precision_getter", "_set_fp32_precision_setter"):
    if _name not in {names!r}:
        del globals()[_name]
'''

_BACKENDS = '''
from torch.backends import cudnn
_frozen = False
def flags_frozen():
    return _frozen
def disable_global_flags():
    global _frozen
    _frozen = True
'''

_CUDNN = '''
import torch
_VERSION = {cudnn!r}
def version():
    """Loads cuDNN on the real build (recorded: a test can see when it ran)."""
    torch._C.calls.append(("cudnn.version",))
    return _VERSION
'''

# torch.cuda imports threading (its _initialization_lock), so a real torch
# has it imported before CUDA starts: outofcuda's CUDA-init step only looks it
# up. Importing it there for the first time would open a window no real
# process has, in which CPython drops a Ctrl-C (raised inside importlib's
# module-lock weakref callback, which can only report it as unraisable).
_CUDA = '''
import threading
import torch
_queued_calls = []
class OutOfMemoryError(RuntimeError):
    pass
def _lazy_call(callable, **kwargs):
    _queued_calls.append((callable, ["(stack where it was queued)"]))
def _fake_cuda_init():
    """What torch.cuda._lazy_init does once CUDA is up: the caching
    allocator starts, with per_process_memory_fraction from its settings
    (c10's DeviceCachingAllocator constructor), then the queue runs."""
    if "per_process_memory_fraction" in torch._C.ALLOC_KEYS:
        for item in torch._alloc_conf().split(","):
            if item.startswith("per_process_memory_fraction:"):
                torch._C.fraction[0] = float(item.split(":")[1])
    for fn, _stack in _queued_calls:
        fn()
def is_initialized():
    return False
# torch.cuda.memory_stats(device) is Python (it flattens the nested dict of
# torch._C._cuda_memoryStats(device)), so another thread can run while it
# does. A test puts a device's figures in _fake_memory_stats.
_fake_memory_stats = {}
def memory_stats(device=None):
    return dict(_fake_memory_stats.get(device, {}))
def _format_size(n):
    """c10's format_size, as the OOM message writes sizes."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1 << 20:
        return f"{n / (1 << 10):.2f} KiB"
    if n <= 1 << 30:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / (1 << 30):.2f} GiB"
def _fake_oom(device, request, total, free):
    """What the caching allocator does when a request fails: in the
    allocating thread, with its lock dropped, each attached observer gets
    (device, request, memory-fraction limit or total, free); then torch
    raises its OOM with this message."""
    for call in torch._C.calls:
        if call[0] == "_cuda_attach_out_of_memory_observer":
            call[1](device, request, total, free)
    raise OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {_format_size(request)}. GPU {device} has a "
        f"total capacity of {_format_size(total)} of which {_format_size(free)} is free.")
'''


# torch.nn.attention's sdpa_kernel() as torch 2.14.1 writes it (a generator
# context manager: the flags saved on entry in `previous_backends`, set
# again on exit); for releases with cuDNN attention.
_NN_ATTENTION = '''
import contextlib, enum
import torch
class SDPBackend(enum.IntEnum):
    ERROR = -1
    MATH = 0
    FLASH_ATTENTION = 1
    EFFICIENT_ATTENTION = 2
    CUDNN_ATTENTION = 3
_backend_names = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                  "mem_efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
def _cur_sdpa_kernel_backends():
    return [getattr(SDPBackend, val) for name, val in _backend_names.items()
            if getattr(torch._C, f"_get_{name}_sdp_enabled")()]
def _sdpa_kernel(backends):
    for name, val in _backend_names.items():
        getattr(torch._C, f"_set_sdp_use_{name}")(getattr(SDPBackend, val) in backends)
@contextlib.contextmanager
def sdpa_kernel(backends):
    if isinstance(backends, SDPBackend):
        backends = [backends]
    backends = list(dict.fromkeys(backends))
    previous_backends = _cur_sdpa_kernel_backends()
    try:
        _sdpa_kernel(backends)
        yield {}
    finally:
        _sdpa_kernel(previous_backends)
'''


# torch.distributed.fsdp's FSDPModule (2.4+); its divide-factor setter (2.5+).
_FSDP = '''
class FSDPModule:
    def reshard(self):
        pass
'''
_FSDP_DIVIDE = '''
    def set_reduce_scatter_divide_factor(self, factor):
        self._divide_factor = factor
'''


def make_fake_torch(root: Path, release: str, cuda: bool = True, cudnn=None,
                    version: str = None, cuda_version: str = None, wheels: bool = False,
                    nccl: str = None) -> Path:
    """Writes a fake torch `release` under root and returns the directory to
    put first on PYTHONPATH. cudnn: the version torch.backends.cudnn.version()
    reports (default: the release's). version: the __version__ it reports
    (default: release), for a release between two of RELEASES that behaves as
    `release` does (a range's edge); cuda_version: torch.version.cuda of a
    CUDA build (default: the release's); wheels: the nvidia-cudnn and nvidia-nccl distributions' folders
    beside torch, as pip installs the CUDA wheel's dependencies (cuDNN's
    version as torch reports it, NCCL's the record's or nccl)."""
    spec = RELEASES[release]
    version = version or release
    cuda_version = cuda_version or spec["cuda"]
    cudnn = (cudnn if cudnn is not None else spec["cudnn"]) if cuda else None
    pkg = root / "torch"
    (pkg / "backends").mkdir(parents=True)
    (pkg / "cuda").mkdir()
    cuda_value = repr(cuda_version) if cuda else "None"
    if spec["annotated_version"]:
        text = (f"from typing import Optional\n__version__ = '{version}'\n"
                f"cuda: Optional[str] = {cuda_value}\nhip: Optional[str] = None\n")
    else:
        text = f"__version__ = '{version}'\ncuda = {cuda_value}\nhip = None\n"
    (pkg / "version.py").write_text(text)
    (pkg / "__init__.py").write_text(_INIT.format(
        env=spec["env"], keys=sorted(spec["keys"]),
        autocast=_AUTOCAST_NEW if spec["autocast_new"] else _AUTOCAST_OLD))
    c_names = sorted(n for n in spec["c"] if cuda or not n.startswith("_cuda"))
    (pkg / "_C.py").write_text(textwrap.dedent(_C_MODULE.format(
        warns=sorted(spec["warns"]), names=c_names, keys=sorted(spec["keys"]))))
    (pkg / "backends" / "__init__.py").write_text(_BACKENDS)
    (pkg / "backends" / "cudnn.py").write_text(_CUDNN.format(cudnn=cudnn))
    (pkg / "cuda" / "__init__.py").write_text(_CUDA)
    if spec["fsdp"]:
        (pkg / "distributed" / "fsdp").mkdir(parents=True)
        (pkg / "distributed" / "__init__.py").write_text("")
        (pkg / "distributed" / "fsdp" / "__init__.py").write_text(
            _FSDP + (_FSDP_DIVIDE if spec["fsdp"] == "divide_factor" else ""))
    nccl = nccl or spec["nccl"]
    major = cuda_version.split(".")[0]
    if wheels and cuda and cudnn:
        big = 1000 if cudnn < 9000 else 10000
        ver = f"{cudnn // big}.{cudnn % big // 100}.{cudnn % 100}.1"
        (root / f"nvidia_cudnn_cu{major}-{ver}.dist-info").mkdir()
    if wheels and cuda and nccl:
        (root / f"nvidia_nccl_cu{major}-{nccl}.dist-info").mkdir()
    if "_set_sdp_use_cudnn" in spec["c"]:
        (pkg / "nn" / "attention").mkdir(parents=True)
        (pkg / "nn" / "__init__.py").write_text("")
        (pkg / "nn" / "attention" / "__init__.py").write_text(_NN_ATTENTION)
    return root
