"""Out of memory explained: :func:`last_oom` and the report printed before the
traceback of an uncaught CUDA OOM. Surviving one is outofcuda.microbatch's.

The figures come from torch's OOM observer, which outofcuda's C core attaches
when CUDA initialises (so they are those of the moment of failure), from
``torch.cuda.memory_stats()`` and from NVML; the C core gathers them and ranks
the actions in one call (``_outofcuda._oom_report``). Nothing here initialises
CUDA.
"""
import gc
import sys
import threading
import traceback

from ._native import core

__all__ = ["last_oom"]

_lock = threading.Lock()
# pending: the text of an OOM a retry may survive (see _note), reported only
# if last_oom() is called.
_last = {"report": None, "seq": 0, "pending": None}


# ---- recognising an OOM ----------------------------------------------------

def is_oom(exc):
    """True when ``exc`` means the GPU ran out of memory: a
    ``torch.cuda.OutOfMemoryError``, or the RuntimeError texts older code paths
    (cuBLAS workspace, pre-1.13 torch) raise instead.

    >>> is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    """
    return core._is_oom(exc)


# ---- the report ------------------------------------------------------------

def _build_report(text=None, *, exhausted=False):
    """The report of the OOM whose message is `text` (None: the observer's
    last), and the observer's sequence number it used. Every figure and the
    ranked actions come from the C core in one call; this layer keeps the
    bookkeeping (last_oom) and the text."""
    import torch  # noqa: F401 - the C core reads it from sys.modules

    return core._oom_report(text, exhausted)


def _gib(b):
    return "unknown" if b is None else core._fmt_bytes(b)


def format_report(report):
    """The report as printed before the traceback of an uncaught OOM.

    >>> print(format_report(outofcuda.last_oom()))  # needs a CUDA OOM first  # doctest: +SKIP
    """
    if not isinstance(report, dict) or "advice" not in report:
        raise TypeError("format_report expects the dict that outofcuda.last_oom() returns")
    r = report
    dev = "cuda:?" if r["device"] is None else f"cuda:{r['device']}"
    if r["device_name"]:
        dev += f" ({r['device_name']})"
    lines = [f"outofcuda: CUDA out of memory on {dev}"]
    if r["message"]:
        lines.append(f"  error              {r['message'][:160]}")
    lines.append(f"  requested          {_gib(r['request_bytes'])}")
    if r["total_bytes"] is not None:
        lines.append(f"  device             {_gib(r['total_bytes'])} total, "
                     f"{_gib(r['free_bytes'])} free (NVML)")
    elif r["free_bytes"] is not None:
        lines.append(f"  device             {_gib(r['free_bytes'])} free (CUDA)")
    else:
        lines.append("  device             unknown")
    lines.append(f"  this process       allocated {_gib(r['allocated_bytes'])}, reserved "
                 f"{_gib(r['reserved_bytes'])}, peak allocated {_gib(r['peak_allocated_bytes'])}")
    lines.append(f"  fragmentation      {_gib(r['fragmentation_bytes'])} reserved but unallocated, "
                 f"{_gib(r['inactive_split_bytes'])} in inactive split blocks")
    if r["other_processes"]:
        procs = ", ".join(f"pid {p['pid']} ({p['name'] or '?'}) {_gib(p['used_bytes'])}"
                          for p in r["other_processes"][:6])
        lines.append(f"  other processes    {procs}")
    elif r["total_bytes"] is not None:
        lines.append("  other processes    none")
    lines.append(f"  allocator          {r['allocator_config'] or 'PyTorch defaults'}")
    fraction = r["memory_fraction"]
    lines.append(f"  memory fraction    {'none' if fraction is None else f'{fraction:.2f}'}"
                 + (f" (cap {_gib(r['limit_bytes'])})" if r["limit_bytes"] else ""))
    if r["snapshot"]:
        lines.append(f"  snapshot           {r['snapshot']} (open it at https://pytorch.org/memory_viz)")
    for note in r["notes"]:
        lines.append(f"  note               {note}")
    lines.append("  what to try, most useful first:")
    for i, action in enumerate(r["advice"], 1):
        lines.append(f"    {i}. {action}")
    return "\n".join(lines)


def _record(exc=None, *, exhausted=False, refresh=False):
    """Builds the report for `exc`, keeps it for last_oom() and attaches it to
    the exception as ``exc.outofcuda_report``. Returns the report."""
    existing = getattr(exc, "outofcuda_report", None) if exc is not None else None
    if isinstance(existing, dict) and not refresh:
        return existing
    report, seq = _build_report(_text(exc), exhausted=exhausted)
    with _lock:
        _last["report"], _last["seq"] = report, max(seq, _last["seq"])
        _last["pending"] = None
    if exc is not None:
        try:
            exc.outofcuda_report = report
        except AttributeError:
            pass
    return report


def _text(exc):
    if exc is None:
        return None
    text = str(exc)
    return text if text.strip() else type(exc).__name__


def _note(exc):
    """An OOM that a retry may survive: only its text is kept, and its report
    is built if last_oom() asks (a retry that succeeds builds none)."""
    with _lock:
        _last["pending"] = _text(exc)


def last_oom():
    """The report of the last CUDA out-of-memory error in this process, as a
    dict (docs/out-of-memory.md lists its keys), or None before any.

    >>> import outofcuda
    >>> outofcuda.last_oom() is None   # no OOM yet
    True
    """
    observed = core._oom_observed()
    with _lock:
        pending = _last["pending"]
        stale = observed is None or observed["seq"] <= _last["seq"]
        if stale and pending is None:
            return _last["report"]
    # An OOM a retry survived, or one the program caught itself: built now,
    # from the observer's figures of the moment of failure.
    report, seq = _build_report(pending)
    with _lock:
        _last["report"], _last["seq"] = report, max(seq, _last["seq"])
        if _last["pending"] is pending:
            _last["pending"] = None
    return report


def _on_uncaught(exc):
    """Called by the C exception hook before the traceback: prints the report.
    Returns True when it printed."""
    report = _record(exc)
    sys.stderr.write(core._labelled(format_report(report) + "\n\n"))
    sys.stderr.flush()
    return True


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
