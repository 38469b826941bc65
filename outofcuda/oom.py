"""Out of memory explained: :func:`last_oom` and the report printed before the
traceback of an uncaught CUDA OOM. Surviving one is outofcuda.microbatch's.

The figures come from torch's OOM observer, which outofcuda's C core attaches
when CUDA initialises (so they are those of the moment of failure), from
``torch.cuda.memory_stats()`` and from NVML. The C core gathers them, ranks the
actions, keeps the last report and writes its text (src/oom.c): the exception
hooks print it without this module, and each function here that reads or
writes a report is one call into the core. Nothing here initialises CUDA.
"""
import gc
import traceback

from ._native import core

__all__ = ["last_oom"]


def is_oom(exc):
    """True when ``exc`` means the GPU ran out of memory: a
    ``torch.cuda.OutOfMemoryError``, or the RuntimeError texts older code paths
    (cuBLAS workspace, pre-1.13 torch) raise instead.

    >>> is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    """
    return core._is_oom(exc)


def format_report(report):
    """The report as printed before the traceback of an uncaught OOM.

    >>> print(format_report(outofcuda.last_oom()))  # needs a CUDA OOM first  # doctest: +SKIP
    """
    return core._oom_format(report)


def last_oom():
    """The report of the last CUDA out-of-memory error in this process, as a
    dict (docs/out-of-memory.md lists its keys), or None before any.

    >>> import outofcuda
    >>> outofcuda.last_oom() is None   # no OOM yet
    True
    """
    return core._oom_last()


def _record(exc=None, *, exhausted=False, refresh=False):
    """Builds the report for `exc` (unless it carries one and not `refresh`),
    keeps it for last_oom() and attaches it to the exception as
    ``exc.outofcuda_report``. Returns the report."""
    return core._oom_record(exc, exhausted, refresh)


def _note(exc):
    """An OOM that a retry may survive: only its text is kept, and its report
    is built if last_oom() asks (a retry that succeeds builds none)."""
    core._oom_note(exc)


# ---- freeing memory after an OOM -------------------------------------------

def _release(exc):
    """Drops what the failed attempt still holds: the locals of the frames in
    the traceback (activations live there), then the allocator's cache."""
    import torch

    tb = exc.__traceback__
    if tb is not None:
        traceback.clear_frames(tb)
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
