"""The GPU checks' dry run on a machine without a GPU (benchmarks/gpu_check.sh
--dry-run): loaded by every scenario interpreter of tests/gpu through
PYTHONPATH, it makes the device "cuda" the CPU and answers torch.cuda's calls
with CPU figures, so each scenario's code runs from its first line to its
last. Nothing here measures a GPU: a dry run proves the scripts, imports and
paths, not a figure. The stand-in NVIDIA library (tests/stub_nvml) answers
outofcuda's NVML calls beside it."""
import time
import types

import torch
from torch.overrides import TorchFunctionMode

GIB = 1 << 30
MIB = 1 << 20
# Room above 0.9 of it for the fraction checks (tests/gpu/test_hook.py); the
# CPU maps what they allocate without touching it.
TOTAL = 16 * GIB
_state = {"initialised": False, "peak": 0}


def _cpu(value):
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


class CudaIsTheCpu(TorchFunctionMode):
    """Every device argument naming CUDA names the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_cpu(kwargs["device"]))
        _state["initialised"] = True
        return func(*(_cpu(a) for a in args), **kwargs)


class Event:
    def __init__(self, enable_timing=False, **_):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0


def _init():
    _state["initialised"] = True


def _props(device=None):
    return types.SimpleNamespace(name="NVIDIA H200 (dry run: the CPU)", total_memory=TOTAL,
                                 major=9, minor=0, multi_processor_count=132)


def _stats(device=None):
    return {"allocated_bytes.all.current": 0, "reserved_bytes.all.current": 0,
            "allocated_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
            "num_ooms": 0, "num_alloc_retries": 0}


cuda = torch.cuda
for name, value in {
        "is_available": lambda: True, "is_initialized": lambda: _state["initialised"],
        "init": _init, "device_count": lambda: 1, "current_device": lambda: 0,
        "set_device": lambda device: None, "synchronize": lambda device=None: None,
        "empty_cache": lambda: None, "get_device_name": lambda device=None: _props().name,
        "get_device_capability": lambda device=None: (9, 0),
        "get_device_properties": _props, "mem_get_info": lambda device=None: (TOTAL - 64 * MIB, TOTAL),
        # A MiB held, as any process that used CUDA holds some.
        "memory_allocated": lambda device=None: MIB, "memory_reserved": lambda device=None: MIB,
        "max_memory_allocated": lambda device=None: MIB,
        "max_memory_reserved": lambda device=None: MIB, "memory_stats": _stats,
        "reset_peak_memory_stats": lambda device=None: None, "Event": Event}.items():
    setattr(cuda, name, value)
cuda.memory._snapshot = lambda device=None: {"segments": [], "allocator_settings": {}}
CudaIsTheCpu().__enter__()
