"""Out of memory explained: :func:`last_oom` and the report printed before the
traceback of an uncaught CUDA OOM. Surviving one is outofcuda.microbatch's.

The figures come from torch's OOM observer, which outofcuda's C core attaches
when CUDA initialises (so they are those of the moment of failure), from
``torch.cuda.memory_stats()`` and from NVML; the ranked actions are chosen in C
(``_outofcuda._oom_advice``). Nothing here initialises CUDA.
"""
import gc
import os
import re
import sys
import threading
import time
import traceback
from ._native import core

__all__ = ["last_oom"]

_GIB = 1024.0 ** 3
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3, "TiB": 1024 ** 4}
# How long after the observer fired an exception may still use its figures.
_OBSERVER_WINDOW_S = 30.0

_lock = threading.Lock()
# pending: the text of an OOM a retry may survive (see _note), reported only
# if last_oom() is called.
_last = {"report": None, "seq": 0, "pending": None}


# ---- recognising an OOM ----------------------------------------------------

def _oom_types():
    import torch

    types = [torch.cuda.OutOfMemoryError]
    other = getattr(torch, "OutOfMemoryError", None)
    if other is not None and other not in types:
        types.append(other)
    return tuple(types)


def is_oom(exc):
    """True when ``exc`` means the GPU ran out of memory: a
    ``torch.cuda.OutOfMemoryError``, or the RuntimeError texts older code paths
    (cuBLAS workspace, pre-1.13 torch) raise instead.

    >>> is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    """
    if isinstance(exc, _oom_types()):
        return True
    if type(exc) is RuntimeError:
        text = str(exc)
        return "CUDA out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text
    return False


# ---- the report ------------------------------------------------------------

def _parse_size(number, unit):
    return int(float(number) * _UNITS.get(unit, 1))


def _from_message(text):
    """Request size and device index from torch's OOM message."""
    out = {}
    m = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", text)
    if m:
        out["request"] = _parse_size(*m.groups())
    m = re.search(r"GPU (\d+)", text)
    if m:
        out["device"] = int(m.group(1))
    return out


def _allocator_settings():
    """(allocator config string or None, memory fraction or None) from status()."""
    opts = core.status().get("optimizations", {})
    alloc = opts.get("allocator", {}).get("value")
    frac = opts.get("memory_fraction", {})
    fraction = None
    if frac.get("applied") and isinstance(frac.get("value"), dict):
        fraction = frac["value"].get("fraction")
    if alloc is None:
        # The variable this torch reads, as the engine reads it (an empty
        # value counts as set from 2.11, and then hides the others).
        import torch

        alloc = core._alloc_var(str(torch.__version__))[1]
    return alloc, fraction


def _nvml_index(device):
    """NVML's index for torch's device `device` (CUDA_VISIBLE_DEVICES renumbers)."""
    devices, _ = core.nvml_devices()
    import torch

    if torch.cuda.is_initialized():
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid).lower()
            for d in devices:
                if d["uuid"].lower().replace("gpu-", "") == uuid.replace("gpu-", ""):
                    return d["index"], d
        except Exception:  # noqa: BLE001 - a figure, never a failure
            pass
    index = core.nvml_index(device)
    for d in devices:
        if d["index"] == index:
            return index, d
    return None, None


def _process_name(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _figures(text, observed):
    """Every figure of the report, with a note for each one that is missing."""
    import torch

    notes = []
    fig = {"request": None, "device": None}
    if text is not None:
        fig.update(_from_message(text))
    stats = None
    if observed is not None:
        fig["device"] = observed["device"]
        fig["request"] = observed["request"]
        fig["limit_or_total"] = observed["limit"]
        fig["device_free"] = observed["device_free"]
        stats = observed["stats"]
    cuda_up = torch.cuda.is_initialized()
    if fig["device"] is None and cuda_up:
        fig["device"] = torch.cuda.current_device()
    if stats is None:
        if cuda_up and fig["device"] is not None:
            stats = torch.cuda.memory_stats(fig["device"])
        else:
            notes.append("CUDA is not initialised in this process: no allocator figures")
    stats = stats or {}
    fig["allocated"] = stats.get("allocated_bytes.all.current")
    fig["reserved"] = stats.get("reserved_bytes.all.current")
    fig["peak"] = stats.get("allocated_bytes.all.peak")
    fig["inactive_split"] = stats.get("inactive_split_bytes.all.current")
    fig["num_ooms"] = stats.get("num_ooms")
    fig["total"] = fig["free"] = fig["name"] = None
    others = []
    if fig["device"] is not None:
        index, info = _nvml_index(fig["device"])
        if info is not None:
            fig["total"], fig["free"], fig["name"] = info["total"], info["free"], info["name"]
            me = os.getpid()
            for pid, used in core.nvml_processes(index):
                if pid != me:
                    others.append({"pid": pid, "name": _process_name(pid), "used_bytes": used})
            others.sort(key=lambda p: -p["used_bytes"])
    if fig["total"] is None:
        _, why = core.nvml_devices()
        notes.append(f"NVML: {why or 'this GPU could not be matched'}: no device totals or "
                     "other processes")
        if observed is not None:
            fig["free"] = observed["device_free"]
    fig["others"] = others
    return fig, notes


def _build_report(text=None, *, exhausted=False):
    """The report of the OOM whose message is `text` (None: the observer's
    last), and the observer's sequence number it used."""
    observed = core._oom_observed()
    if observed is not None and time.time() - observed["time"] > _OBSERVER_WINDOW_S:
        observed = None
    if observed is not None and text is not None:
        dev = _from_message(text).get("device")
        if dev is not None and dev != observed["device"]:
            observed = None
    fig, notes = _figures(text, observed)
    alloc_conf, fraction = _allocator_settings()
    expandable = core._alloc_expandable(alloc_conf)
    autocast = observed.get("autocast") if observed else None
    if autocast is None:
        try:
            import torch

            autocast = bool(torch.is_autocast_enabled("cuda"))
        except TypeError:
            autocast = None
    frag = None
    if fig["reserved"] is not None and fig["allocated"] is not None:
        frag = max(0, fig["reserved"] - fig["allocated"])
    limit = None
    if observed is not None and fraction is not None:
        limit = observed["limit"]
    others = fig["others"]
    advice = core._oom_advice(
        request=fig["request"], total=fig["total"] or (observed or {}).get("limit"),
        limit=limit, allocated=fig["allocated"], reserved=fig["reserved"],
        inactive_split=fig["inactive_split"], fraction=fraction, expandable=expandable,
        autocast=autocast, exhausted=exhausted,
        others=[(p["pid"], p["name"], p["used_bytes"]) for p in others])
    snapshot = observed.get("snapshot") if observed else None
    if observed and observed.get("snapshot_error"):
        notes.append(observed["snapshot_error"])
    message = None
    if text is not None:
        message = text.strip().splitlines()[0] if text.strip() else "OutOfMemoryError"
    return {
        "time": time.time(),
        "source": "observer" if observed is not None else "exception",
        "message": message,
        "device": fig["device"],
        "device_name": fig["name"],
        "request_bytes": fig["request"],
        "total_bytes": fig["total"],
        "free_bytes": fig["free"],
        "limit_bytes": limit,
        "allocated_bytes": fig["allocated"],
        "reserved_bytes": fig["reserved"],
        "peak_allocated_bytes": fig["peak"],
        "fragmentation_bytes": frag,
        "inactive_split_bytes": fig["inactive_split"],
        "num_ooms": fig["num_ooms"],
        "other_processes": others,
        "allocator_config": alloc_conf,
        "expandable_segments": expandable,
        "memory_fraction": fraction,
        "autocast": autocast,
        "snapshot": snapshot,
        "advice": advice,
        "notes": notes,
    }, (observed or {}).get("seq", 0)


def _gib(b):
    if b is None:
        return "unknown"
    return f"{b / _GIB:.2f} GiB" if b >= 1024 ** 3 else f"{b / 1024 ** 2:.0f} MiB"


def format_report(report):
    """The report as printed before the traceback of an uncaught OOM.

    >>> print(format_report(outofcuda.last_oom()))  # doctest: +SKIP
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
    dict (see the README for its keys), or None before any.

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
    sys.stderr.write(format_report(report) + "\n\n")
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
