"""outofcuda: faster, safer PyTorch CUDA defaults, applied when torch is imported.

Installing the package is enough: a start-up hook notices ``import torch`` and
applies the optimisations. This module is for people who want to look
(:func:`status`) or to do more (the API below). Importing it changes nothing the
hook did, imports no torch and never initialises CUDA.
"""
try:
    from ._native import core as _core
except ImportError as _exc:  # the extension is missing or damaged
    if type(_exc).__name__ == "ShadowedError":
        raise  # another module took the extension's name: say so at import
    # `import outofcuda` still works so that the command line can explain;
    # every function that needs the core raises this error.
    _core = None
    _core_error = _exc

__version__ = _core.__version__ if _core is not None else "unknown"


def _need_core():
    if _core is None:
        raise ImportError(str(_core_error)) from _core_error
    return _core

__all__ = [
    "status",
    "apply",
    "config",
    "autocast_context",
    "compile_model",
    "smart_dataloader",
    "memory_report",
    "clear_cache",
    "MemoryMonitor",
    "CudaOptimizer",
    "last_oom",
    "auto_microbatch",
    "find_batch_size",
]

# Public name -> submodule that defines it; loaded on first use so that
# `import outofcuda` stays cheap and does not import torch.
_LAZY = {
    "autocast_context": "outofcuda.api",
    "compile_model": "outofcuda.api",
    "smart_dataloader": "outofcuda.api",
    "memory_report": "outofcuda.api",
    "clear_cache": "outofcuda.api",
    "CudaOptimizer": "outofcuda.api",
    "MemoryMonitor": "outofcuda.monitor",
    "last_oom": "outofcuda.oom",
    "auto_microbatch": "outofcuda.microbatch",
    "find_batch_size": "outofcuda.microbatch",
}


class Status(dict):
    """status()'s dict: ``repr()`` is the dict's, ``str()`` (what ``print``
    shows) the table ``OUTOFCUDA_VERBOSE=1`` prints."""

    __slots__ = ()

    def __str__(self):
        return _need_core()._status_text(self).rstrip("\n")


def status():
    """What outofcuda did in this process, as a JSON-serialisable dict
    (a :class:`Status`: ``print(outofcuda.status())`` shows it as a table).

    Each optimisation says whether it was ``applied``, its ``state``, a
    stable ``code`` for why (docs/python-api.md lists them), its ``value``,
    the ``reason`` in words, ``off_by`` (the ``OUTOFCUDA_*`` variable that turned it off,
    else None) and ``now`` (what torch has now). A step that waits for CUDA's
    start (TF32, the memory fraction, the OOM handler) says ``queued`` and
    ``applied`` False until then; a CPU-only build of torch applies neither.

    >>> import torch, outofcuda
    >>> st = outofcuda.status()
    >>> st["hook"]["fired"]
    True
    >>> st["optimizations"]["tf32"]["applied"]   # no CUDA started here
    False
    """
    return Status(_need_core().status())


def apply():
    """Applies outofcuda where the start-up hook cannot run (``python -S``,
    an embedded interpreter, a frozen application); returns :func:`status`.

    Called before ``import torch`` it arms the same import watcher the hook
    installs, so everything, the allocator variable included, is applied as
    torch loads. Called after, it applies at once what can still be applied
    and ``status()`` says what could not and why (the allocator variable is
    read when torch's libraries load). Calling it again, or where the hook
    already ran, changes nothing: every optimisation is applied once per
    process. ``OUTOFCUDA_DISABLE=1`` still wins.

    >>> import outofcuda
    >>> outofcuda.apply()["hook"]["installed"]   # the hook had installed it already
    True
    """
    _need_core().install()
    return status()


def config():
    """The ``OUTOFCUDA_*`` settings as read from the environment (a dict)."""
    return _need_core().config()


def __getattr__(name):
    modname = _LAZY.get(name)
    if modname is None:
        raise AttributeError(f"module 'outofcuda' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(modname), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
