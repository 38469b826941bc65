"""The power-user API: context managers and wrappers over decisions made in C.

Every choice here (autocast dtype, DataLoader worker count, memory format,
memory figures) comes from the ``_outofcuda`` extension; this module turns
those choices into torch calls. Importing it does not import torch; no
function here initialises CUDA unless the call itself needs the GPU.
"""
import os
import shutil
import sys
import warnings

from ._native import core

__all__ = [
    "autocast_context",
    "compile_model",
    "smart_dataloader",
    "memory_report",
    "clear_cache",
    "CudaOptimizer",
]

_DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
}


def _torch():
    import torch

    return torch


def _resolve_dtype(torch, dtype):
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_ALIASES:
        return getattr(torch, _DTYPE_ALIASES[dtype.lower()])
    raise TypeError(
        f"dtype must be a torch.dtype or one of {sorted(_DTYPE_ALIASES)}, got {dtype!r}"
    )


def autocast_context(device_type=None, dtype=None, enabled=True):
    """A ``torch.autocast`` context with outofcuda's dtype choice.

    ``device_type`` defaults to ``"cuda"`` when CUDA is available, else
    ``"cpu"``. ``dtype`` defaults to ``OUTOFCUDA_AMP_DTYPE`` when set (``off``:
    torch's own default dtype on every device), else the
    start-up hook's choice (bfloat16 on compute capability >= 8.0, float16 on
    older GPUs), bfloat16 on the CPU. The dtype is passed explicitly, so the
    choice also holds in threads other than the one that imported torch
    (torch's autocast dtype is thread-local).

    >>> import torch, outofcuda
    >>> with outofcuda.autocast_context("cpu"):
    ...     y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    >>> y.dtype
    torch.bfloat16
    """
    if device_type is not None and not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cuda' or 'cpu', got {device_type!r}")
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    torch = _torch()
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        name, _reason = core._api_autocast_dtype(device_type)
        dtype = getattr(torch, name) if name is not None else None
    else:
        dtype = _resolve_dtype(torch, dtype)
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _compile_blocker(torch, model):
    """Why torch.compile cannot work here, or None."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile (needs 2.0+)"
    try:
        import torch._dynamo as dynamo
    except Exception as exc:  # a broken install must not break the model
        return f"torch._dynamo does not import ({exc})"
    if not dynamo.is_dynamo_supported():
        return f"torch.compile does not support Python {sys.version.split()[0]} in torch {torch.__version__}"
    on_cuda = any(p.is_cuda for p in model.parameters())
    if on_cuda:
        from torch.utils._triton import has_triton

        if not has_triton():
            return "the model is on CUDA and Triton (needed by the inductor backend) is missing"
    elif not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "clang++", "c++")):
        return "no C++ compiler (g++/clang++) for the inductor CPU backend"
    return None


def _compile_modes():
    """The modes OUTOFCUDA_COMPILE_MODE accepts, in order: the engine's table."""
    return next(s["words"] for s in core._settings() if s["name"] == "OUTOFCUDA_COMPILE_MODE")


_FLAG_VARS = {"channels_last": "OUTOFCUDA_CHANNELS_LAST", "compile": "OUTOFCUDA_COMPILE",
              "fullgraph": "OUTOFCUDA_COMPILE_FULLGRAPH"}


def _check_flag(name, value):
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"compile_model: {name} must be True, False or None (None: "
                        f"{_FLAG_VARS[name]}), got {value!r}")


def _compile_options(compile, mode, fullgraph):
    """(compile, mode, fullgraph, what asked for compiling): each argument
    given wins over its OUTOFCUDA_* variable."""
    _check_flag("compile", compile)
    _check_flag("fullgraph", fullgraph)
    if mode is not None:
        modes = _compile_modes()
        if not isinstance(mode, str) or mode.strip().lower() not in modes:
            raise ValueError(f"compile_model: mode must be one of {', '.join(modes)} "
                             f"or None (None: OUTOFCUDA_COMPILE_MODE), got {mode!r}")
        mode = mode.strip().lower()
    cfg = core.config()
    return (cfg["compile"] if compile is None else compile,
            cfg["compile_mode"] if mode is None else mode,
            cfg["compile_fullgraph"] if fullgraph is None else fullgraph,
            "OUTOFCUDA_COMPILE=1" if compile is None else "compile=True")


def compile_model(model, channels_last=None, compile=None, mode=None, fullgraph=None):
    """Prepare a model: channels-last layout, and ``torch.compile`` when asked.

    With ``OUTOFCUDA_CHANNELS_LAST=1`` (default) a model with 4-D weights
    (Conv2d) is converted to ``channels_last``, one with 5-D weights (Conv3d) to
    ``channels_last_3d``, each weight by its rank when it has both. With
    ``OUTOFCUDA_COMPILE=1`` the model is wrapped with ``torch.compile(mode=
    OUTOFCUDA_COMPILE_MODE, fullgraph=OUTOFCUDA_COMPILE_FULLGRAPH)``; where
    compiling cannot work here one warning says why and the model is returned
    uncompiled. The layout change is made in place; outputs equal the
    original model's.

    Each argument overrides its variable for this call; None (the default)
    keeps the environment's value. ``channels_last``, ``compile`` and
    ``fullgraph`` take True or False; ``mode`` one of ``"default"``,
    ``"reduce-overhead"``, ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``.
    Other values raise TypeError or ValueError before the model is touched.

    >>> import torch, outofcuda
    >>> net = outofcuda.compile_model(torch.nn.Conv2d(3, 8, 3))
    >>> net.weight.is_contiguous(memory_format=torch.channels_last)
    True
    >>> net = outofcuda.compile_model(torch.nn.Conv2d(3, 8, 3), channels_last=False)
    >>> net.weight.is_contiguous(memory_format=torch.channels_last)
    False
    """
    torch = _torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compile_model expects a torch.nn.Module, got {type(model).__name__}")
    _check_flag("channels_last", channels_last)
    compile, mode, fullgraph, asked_by = _compile_options(compile, mode, fullgraph)
    ranks = {p.dim() for p in model.parameters()}
    fmt, _reason = core._api_memory_format(4 in ranks, 5 in ranks, channels_last)
    if fmt == "mixed":
        by_rank = {4: torch.channels_last, 5: torch.channels_last_3d}
        model._apply(lambda t: t.contiguous(memory_format=by_rank[t.dim()]) if t.dim() in by_rank else t)
    elif fmt is not None:
        model = model.to(memory_format=getattr(torch, fmt))
    if not compile:
        return model
    blocker = _compile_blocker(torch, model)
    if blocker is not None:
        warnings.warn(core._labelled(f"outofcuda: {asked_by} but {blocker}; the model runs "
                                     "uncompiled"),
                      RuntimeWarning, stacklevel=2)
        return model
    return torch.compile(model, mode=mode, fullgraph=fullgraph)


# The most workers one DataLoader may be asked for: each is a process, and
# the engine takes the count as a C long.
_WORKERS_MAX = 2**31 - 1


def smart_dataloader(dataset, **kwargs):
    """A ``torch.utils.data.DataLoader`` with the settings people forget.

    ``num_workers`` is ``OUTOFCUDA_NUM_WORKERS`` capped at the CPUs this
    process may use (affinity mask and cgroup quota); ``prefetch_factor``
    (``OUTOFCUDA_PREFETCH_FACTOR``; ``off``: torch's own) and
    ``persistent_workers=True`` are added only when there are workers; ``pin_memory`` (``OUTOFCUDA_PIN_MEMORY``) only
    when CUDA is available. Every keyword you pass wins over these. When
    workers meet a ``/dev/shm`` under 512 MiB (a container's 64 MB default),
    one warning per process says so.

    >>> import torch, outofcuda
    >>> ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    >>> [b[0].tolist() for b in outofcuda.smart_dataloader(ds, batch_size=4, num_workers=0)]
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    """
    if dataset is None:
        raise TypeError("smart_dataloader needs a dataset (a torch Dataset or any sized indexable)")
    if "dataset" in kwargs:
        raise TypeError("smart_dataloader got the dataset twice (positionally and as dataset=)")
    requested = kwargs.get("num_workers", -1)
    if "num_workers" in kwargs and (
        not isinstance(requested, int) or isinstance(requested, bool)
        or not 0 <= requested <= _WORKERS_MAX
    ):
        raise ValueError(f"num_workers must be a whole number from 0 to {_WORKERS_MAX}, "
                         f"got {requested!r}")
    torch = _torch()
    plan = core._api_loader_plan(torch.cuda.is_available(), requested)
    args = {"num_workers": plan["num_workers"], "pin_memory": plan["pin_memory"]}
    if plan["num_workers"] > 0:
        if plan["prefetch_factor"] is not None:
            args["prefetch_factor"] = plan["prefetch_factor"]
        args["persistent_workers"] = True
    if plan["shm_warning"]:
        warnings.warn(core._labelled(plan["shm_warning"]), RuntimeWarning, stacklevel=2)
    args.update(kwargs)
    return torch.utils.data.DataLoader(dataset, **args)


def memory_report():
    """GPU memory per device, keyed ``"cuda:0"``, ``"cuda:1"``, ...

    Each entry holds ``name``, ``total_gb``, ``allocated_gb``, ``reserved_gb``,
    ``free_gb``, ``peak_allocated_gb`` (plus ``used_gb``, all processes, and
    ``nvml_index``), in GiB, and ``processes``: who holds memory on that GPU,
    largest first, as dicts ``pid``, ``name`` (None if unreadable), ``used_gb``
    (None where the driver cannot tell) and ``this_process``; None where NVML
    cannot list them. Device figures come from NVML, which needs no
    CUDA context; the allocator figures are torch's and stay 0.0 until this
    process has initialised CUDA. Never initialises CUDA; ``{}`` without a GPU.

    >>> import outofcuda
    >>> outofcuda.memory_report()  # on a machine without a GPU
    {}
    """
    return core._api_memory_report()


def clear_cache():
    """Hand torch's cached GPU memory back to the driver; returns the bytes released.

    Runs ``gc.collect()`` first when ``OUTOFCUDA_GC_COLLECT=1`` (default), then
    ``torch.cuda.empty_cache()`` if CUDA is initialised. Safe without CUDA
    (returns 0). It never gives torch more memory than it could already
    reuse: call it to give memory to other processes, not in a training loop.

    >>> import outofcuda
    >>> outofcuda.clear_cache() >= 0
    True
    """
    return core._api_clear_cache()


class CudaOptimizer:
    """The API in one object, for code that prefers a handle.

    >>> import torch, outofcuda
    >>> opt = outofcuda.CudaOptimizer()
    >>> model = opt.prepare(torch.nn.Linear(4, 2))
    >>> loader = opt.dataloader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    >>> with opt.autocast("cpu"):
    ...     out = model(next(iter(loader))[0])
    >>> opt.clear() >= 0, isinstance(opt.report(), dict)
    (True, True)
    """

    def prepare(self, model, channels_last=None, compile=None, mode=None, fullgraph=None):
        """:func:`compile_model` (channels-last, optional torch.compile)."""
        return compile_model(model, channels_last, compile, mode, fullgraph)

    def dataloader(self, dataset, **kwargs):
        """:func:`smart_dataloader`."""
        return smart_dataloader(dataset, **kwargs)

    def autocast(self, device_type=None, dtype=None, enabled=True):
        """:func:`autocast_context`."""
        return autocast_context(device_type, dtype, enabled)

    def clear(self):
        """:func:`clear_cache`; returns the bytes released."""
        return clear_cache()

    def report(self):
        """:func:`memory_report`."""
        return memory_report()

    def __repr__(self):
        return "CudaOptimizer()"
