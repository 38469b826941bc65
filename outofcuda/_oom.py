"""Out of memory: explain it (:func:`last_oom`), survive it in training
(:func:`auto_microbatch`) and in inference (:func:`find_batch_size`).

The figures come from torch's OOM observer, which outofcuda's C core attaches
when CUDA initialises (so they are those of the moment of failure), from
``torch.cuda.memory_stats()`` and from NVML; the ranked actions are chosen in C
(``_outofcuda._oom_advice``). Nothing here initialises CUDA.
"""
import contextlib
import copy
import functools
import gc
import math
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence

from ._native import core

__all__ = ["last_oom", "auto_microbatch", "find_batch_size"]

_GIB = 1024.0 ** 3
_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3, "TiB": 1024 ** 4}
# How long after the observer fired an exception may still use its figures.
_OBSERVER_WINDOW_S = 30.0

_lock = threading.Lock()
_last = {"report": None, "seq": 0}


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


def _figures(exc, observed):
    """Every figure of the report, with a note for each one that is missing."""
    import torch

    notes = []
    fig = {"request": None, "device": None}
    if exc is not None:
        fig.update(_from_message(str(exc)))
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


def _build_report(exc=None, *, exhausted=False):
    observed = core._oom_observed()
    if observed is not None and time.time() - observed["time"] > _OBSERVER_WINDOW_S:
        observed = None
    if observed is not None and exc is not None:
        dev = _from_message(str(exc)).get("device")
        if dev is not None and dev != observed["device"]:
            observed = None
    fig, notes = _figures(exc, observed)
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
    if exc is not None:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
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
    report, seq = _build_report(exc, exhausted=exhausted)
    with _lock:
        _last["report"], _last["seq"] = report, max(seq, _last["seq"])
    if exc is not None:
        try:
            exc.outofcuda_report = report
        except AttributeError:
            pass
    return report


def last_oom():
    """The report of the last CUDA out-of-memory error in this process, as a
    dict (see the README for its keys), or None before any.

    >>> import outofcuda
    >>> outofcuda.last_oom() is None   # no OOM yet
    True
    """
    observed = core._oom_observed()
    with _lock:
        stale = observed is None or observed["seq"] <= _last["seq"]
        if stale:
            return _last["report"]
    # The program caught an OOM itself: build from the observer's figures.
    report, seq = _build_report(None)
    with _lock:
        _last["report"], _last["seq"] = report, max(seq, _last["seq"])
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


# ---- splitting batches -----------------------------------------------------

def _is_container(x):
    """Mappings and Sequences are walked; text and bytes are values."""
    return (isinstance(x, (Mapping, Sequence))
            and not isinstance(x, (str, bytes, bytearray, memoryview)))


def _tensors(x, torch, path=()):
    """Every tensor inside `x`; `path` holds the containers above, so a
    container that holds itself is walked once."""
    if isinstance(x, torch.Tensor):
        yield x
    elif _is_container(x) and id(x) not in path:
        inner = path + (id(x),)
        for v in (x.values() if isinstance(x, Mapping) else x):
            yield from _tensors(v, torch, inner)


def _batch_len(batch):
    """Length along dimension 0 shared by every tensor in `batch`."""
    import torch

    sizes = set()
    for t in _tensors(batch, torch):
        if t.dim() == 0:
            raise ValueError("auto_microbatch: a 0-d tensor in the batch cannot be split; "
                             "pass it as another argument or through a closure instead")
        sizes.add(t.shape[0])
    if not sizes:
        if _is_container(batch) and len(batch) == 0:
            raise ValueError(f"auto_microbatch: the batch is empty (an empty "
                             f"{type(batch).__name__}); skip the step for an empty batch")
        raise TypeError("auto_microbatch: the batch holds no tensor to split (expected a "
                        "tensor, or a Mapping/Sequence such as a dict, list or tuple of tensors)")
    if len(sizes) > 1:
        raise ValueError(f"auto_microbatch: tensors in the batch disagree on dimension 0 "
                         f"({sorted(sizes)}); every tensor must hold one row per sample")
    n = sizes.pop()
    if n == 0:
        raise ValueError("auto_microbatch: the batch is empty (its tensors have 0 rows along "
                         "dimension 0); skip the step for an empty batch")
    return n


def _first_batch(args):
    """The batch: the first positional argument that holds a tensor with a
    dimension 0, so ``step(model, batch)`` works as well as ``step(batch)``."""
    import torch

    for a in args:
        if any(t.dim() > 0 for t in _tensors(a, torch)):
            return a
    return args[0]


def _rebuild_mapping(x, items):
    if isinstance(x, MutableMapping):
        # A shallow copy keeps what the constructor would lose: a
        # defaultdict's factory, a UserDict subclass's own attributes.
        try:
            new = copy.copy(x)
            for k, v in items:
                new[k] = v
            return new
        except Exception:  # noqa: BLE001 - fall back to building a new one
            pass
    try:
        return type(x)(items)
    except Exception:  # noqa: BLE001 - a read-only Mapping with its own constructor
        return dict(items)


def _rebuild_sequence(x, items):
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*items)
    if isinstance(x, MutableSequence) and not isinstance(x, list):
        try:
            new = copy.copy(x)
            for i, v in enumerate(items):
                new[i] = v
            return new
        except Exception:  # noqa: BLE001 - fall back to building a new one
            pass
    try:
        return type(x)(items)
    except Exception:  # noqa: BLE001 - a Sequence with its own constructor
        return list(items)


def _slice(x, n, start, stop, torch, path=()):
    """`x` with every tensor whose dimension 0 is `n` cut to rows
    [start, stop); other values, and containers holding none, unchanged."""
    if isinstance(x, torch.nn.Parameter):
        return x  # a model's weight, never samples, even when it has n rows
    if isinstance(x, torch.Tensor):
        return x[start:stop] if x.dim() > 0 and x.shape[0] == n else x
    if not _is_container(x) or id(x) in path:
        return x
    inner = path + (id(x),)
    if isinstance(x, Mapping):
        old = list(x.items())
        new = [(k, _slice(v, n, start, stop, torch, inner)) for k, v in old]
        if all(a[1] is b[1] for a, b in zip(old, new)):
            return x
        return _rebuild_mapping(x, new)
    old = list(x)
    new = [_slice(v, n, start, stop, torch, inner) for v in old]
    if all(a is b for a, b in zip(old, new)):
        return x
    return _rebuild_sequence(x, new)


def _leaves(loss):
    """Tensors that backward() of `loss` accumulates gradients into."""
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            found.append(var)
        stack.extend(n for n, _ in node.next_functions)
    return found


class _GradGuard:
    """Keeps each leaf's gradient as it was at entry so a failed attempt can be
    undone exactly, without copying: the entry gradient is set aside, this
    call's gradient builds up alone in ``.grad``, and on success the two are
    added (in place into the entry tensor, so its identity is kept)."""

    def __init__(self):
        self.saved = {}

    def adopt(self, loss):
        for leaf in _leaves(loss):
            key = id(leaf)
            if key not in self.saved:
                self.saved[key] = (leaf, leaf.grad)
                leaf.grad = None

    def undo(self):
        for leaf, grad in self.saved.values():
            leaf.grad = grad
        self.saved.clear()

    def commit(self):
        for leaf, grad in self.saved.values():
            if grad is not None and leaf.grad is not None:
                grad.add_(leaf.grad)
                leaf.grad = grad
            elif grad is not None:
                leaf.grad = grad
        self.saved.clear()


def _check_fn(fn, who):
    if not callable(fn):
        raise TypeError(f"{who}: fn must be callable, got {type(fn).__name__}")


def _check_min_size(min_size, who):
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"{who}: min_size must be an int >= 1, got {min_size!r}")


# Micro-batch splits made in this process, every auto_microbatch together
# (the OUTOFCUDA_SUMMARY block at exit reads it through _split_count).
_splits_total = 0


def _split_count():
    return _splits_total


def _check_sync_modules(ddp):
    """The modules whose no_sync() an explicit ``ddp=`` names, as a tuple."""
    mods = tuple(ddp) if isinstance(ddp, (list, tuple)) else (ddp,)
    for m in mods:
        if not callable(getattr(type(m), "no_sync", None)):
            raise TypeError("auto_microbatch: ddp must be a DistributedDataParallel model (or "
                            "another module with a no_sync() method, such as FSDP), or a "
                            f"list of them, or False; got {type(m).__name__}")
    return mods


def auto_microbatch(fn=None, *, scaler=None, min_size=1, retry_after=100, ddp=None):
    """Makes a training step survive CUDA out-of-memory by splitting the batch.

    ``fn(batch, *args, **kwargs)`` must return the batch's *mean* loss and must
    not call ``backward()``. The wrapper runs forward and backward itself and
    returns the full batch's mean loss (detached). On OOM it frees memory,
    restores every gradient to its state at entry and splits into 2, 4, 8 ...
    micro-batches. The batch is the first positional argument that holds a
    tensor of at least one dimension (``self`` and a model before it are
    skipped): a tensor, or any
    Mapping/Sequence of them (dict, UserDict such
    as a tokenizer's BatchEncoding, defaultdict, list, tuple, namedtuple),
    whose tensors all share dimension 0, its length ``n``. Every tensor among
    *all* the arguments whose dimension 0 is ``n`` is split with it, so
    ``step(x, y)`` and ``step(x, target=y)`` work; other values (a class-weight
    tensor of another length, an ``nn.Parameter``, numbers, strings) reach
    every micro-batch whole.
    Each micro-batch's loss is backpropagated weighted by its share of the
    samples, so the gradients equal the full batch's (up to float rounding)
    for models without batch-coupled layers (BatchNorm statistics do change
    with the split). The split that worked is kept for later calls (per
    instance for a method); after ``retry_after`` clean calls a split with
    half as many pieces is tried again. A micro-batch of ``min_size`` samples
    that still fails re-raises the original error with the report attached
    (``err.outofcuda_report``). With ``scaler`` (a GradScaler) the scaled
    loss is backpropagated; call ``scaler.step`` yourself.

    Under DistributedDataParallel every micro-batch but the last runs inside
    the model's ``no_sync()``, so a split step all-reduces once, like the
    whole batch. The DDP model is found among the step's arguments, the
    attributes of ``self`` for a method (decorated or bound), its closure
    and the globals it names; ``ddp=model`` names it (or a list; also the root of an FSDP
    model, which is never looked for), ``ddp=False`` turns this off.

    >>> @outofcuda.auto_microbatch
    ... def step(x, y):
    ...     return torch.nn.functional.cross_entropy(model(x), y)
    >>> loss = step(x, y); opt.step(); opt.zero_grad()
    """
    if fn is None:
        return functools.partial(auto_microbatch, scaler=scaler, min_size=min_size,
                                 retry_after=retry_after, ddp=ddp)
    _check_fn(fn, "auto_microbatch")
    _check_min_size(min_size, "auto_microbatch")
    if scaler is not None and not callable(getattr(scaler, "scale", None)):
        raise TypeError("auto_microbatch: scaler must be a torch.amp.GradScaler (it has no "
                        ".scale method)")
    if isinstance(retry_after, bool) or not isinstance(retry_after, int) or retry_after < 1:
        raise ValueError(f"auto_microbatch: retry_after must be an int >= 1, got {retry_after!r}")
    if ddp is not None and ddp is not False:
        ddp = _check_sync_modules(ddp)
    return _MicroBatcher(fn, scaler, min_size, retry_after, ddp)


class _SplitState:
    """What one wrapped step learnt: the micro-batch size that worked."""

    __slots__ = ("micro_size", "clean_calls", "splits", "pieces")

    def __init__(self):
        self.micro_size = None   # samples per micro-batch that worked; None = whole batch
        self.clean_calls = 0
        self.splits = 0          # how many times an OOM forced a smaller micro-batch
        self.pieces = 1          # micro-batches the last call used (1 = whole batch)


def _state_property(name):
    return property(lambda self: getattr(self._state, name),
                    lambda self, value: setattr(self._state, name, value))


class _MicroBatcher:
    micro_size = _state_property("micro_size")
    clean_calls = _state_property("clean_calls")
    splits = _state_property("splits")
    pieces = _state_property("pieces")

    def __init__(self, fn, scaler, min_size, retry_after, ddp, instance=None, state=None):
        functools.update_wrapper(self, fn)
        self.fn, self.scaler, self.min_size, self.retry_after = fn, scaler, min_size, retry_after
        self.ddp, self._instance = ddp, instance
        self._state = state if state is not None else _SplitState()

    def __get__(self, instance, owner=None):
        """Decorating a method: ``self`` is passed first and each instance
        keeps its own split (two models need not fit the same micro-batch)."""
        if instance is None:
            return self
        key = "_outofcuda_microbatch_" + getattr(self.fn, "__name__", "step")
        try:
            state = vars(instance).setdefault(key, _SplitState())
        except (TypeError, AttributeError):  # no writable __dict__: share the one state
            state = self._state
        return _MicroBatcher(self.fn, self.scaler, self.min_size, self.retry_after, self.ddp,
                             (instance,), state)

    def _sync_modules(self, args, kwargs):
        """The modules whose no_sync() a split step uses: those of ddp=, or
        the DDP models found where a step gets its model: arguments, self's
        attributes, closure, globals."""
        if self.ddp is not None:
            return self.ddp or ()
        import torch

        fn = self.fn
        candidates = list(args) + list(kwargs.values())
        # A decorated method's instance, or that of a bound method wrapped as is.
        owners = self._instance or ((fn.__self__,) if hasattr(fn, "__self__") else ())
        for inst in owners:
            candidates += [inst] + list(getattr(inst, "__dict__", {}).values())
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                candidates.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is not None and scope is not None:
            candidates += [scope[name] for name in code.co_names if name in scope]
        # Only DDP is looked for: FSDP's no_sync() raises on any but the root
        # instance, which a closure may not hold; FSDP goes through ddp=.
        ddp_type = torch.nn.parallel.DistributedDataParallel
        found = []
        for c in candidates:
            if isinstance(c, ddp_type) and all(c is not f for f in found):
                found.append(c)
        return tuple(found)

    def _run(self, n, size, args, kwargs):
        import torch

        prefix = self._instance or ()
        syncs = self._sync_modules(args, kwargs) if size < n else ()
        guard, total = _GradGuard(), None
        try:
            for start in range(0, n, size):
                stop = min(n, start + size)
                part_args = _slice(args, n, start, stop, torch) if size < n else args
                part_kwargs = _slice(kwargs, n, start, stop, torch) if size < n else kwargs
                with contextlib.ExitStack() as stack:
                    if stop < n:
                        # Gradients of all but the last micro-batch stay
                        # local; the last backward all-reduces their sum.
                        for module in syncs:
                            stack.enter_context(module.no_sync())
                    loss = self.fn(*prefix, *part_args, **part_kwargs)
                    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                        raise TypeError(
                            "auto_microbatch: fn must return the batch's mean loss as a 0-d "
                            f"tensor, got {type(loss).__name__}"
                            + (f" of shape {tuple(loss.shape)}"
                               if isinstance(loss, torch.Tensor) else ""))
                    weighted = loss * ((stop - start) / n) if size < n else loss
                    guard.adopt(weighted)
                    (self.scaler.scale(weighted) if self.scaler is not None
                     else weighted).backward()
                part = weighted.detach()
                total = part if total is None else total + part
                del loss, weighted, part_args, part_kwargs
        except BaseException:
            guard.undo()
            raise
        guard.commit()
        return total

    def __call__(self, *args, **kwargs):
        if not args:
            raise TypeError("auto_microbatch: call the step with the batch as its first "
                            "positional argument")
        n = _batch_len(_first_batch(args))
        st = self._state
        size = n if st.micro_size is None else min(n, st.micro_size)
        grow = st.micro_size is not None and st.clean_calls >= self.retry_after and size < n
        if grow:
            size, st.clean_calls = min(n, size * 2), 0
        while True:
            try:
                out = self._run(n, size, args, kwargs)
            except BaseException as exc:
                if not is_oom(exc):
                    raise
                error = exc
            else:
                st.pieces = math.ceil(n / size)
                if size < n:
                    st.micro_size = size
                    st.clean_calls += 1
                elif grow:
                    st.micro_size = None
                return out
            if size <= self.min_size and not grow:
                _record(error, exhausted=True)
                _release(error)
                raise error
            _record(error)
            _release(error)
            del error
            if grow:
                # The larger try failed: return to the split that worked.
                grow, size = False, min(n, st.micro_size)
                continue
            size = max(self.min_size, math.ceil(size / 2))
            st.micro_size = size
            st.clean_calls = 0
            st.splits += 1
            global _splits_total
            _splits_total += 1


def find_batch_size(fn, start, *, min_size=1, grow=False):
    """The largest batch size (at most ``start``) for which ``fn(batch_size)``
    runs without CUDA out-of-memory.

    Calls ``fn(start)``; on OOM frees memory and halves the size until a call
    succeeds. With ``grow=True`` it then bisects between the size that worked
    and the one that failed to find the largest that works. Any exception that
    is not an OOM propagates unchanged; when ``min_size`` itself fails the
    original error is re-raised with the report attached.

    >>> bs = outofcuda.find_batch_size(lambda b: model(torch.zeros(b, 3, 224, 224)), 512)
    """
    _check_fn(fn, "find_batch_size")
    _check_min_size(min_size, "find_batch_size")
    if isinstance(start, bool) or not isinstance(start, int) or start < min_size:
        raise ValueError(f"find_batch_size: start must be an int >= min_size ({min_size}), "
                         f"got {start!r}")

    def fits(size):
        try:
            fn(size)
        except BaseException as exc:
            if not is_oom(exc):
                raise
            _record(exc)
            _release(exc)
            return exc
        return None

    size, failed = start, None
    while True:
        error = fits(size)
        if error is None:
            break
        if size <= min_size:
            _record(error, exhausted=True, refresh=True)
            raise error
        failed, size = size, max(min_size, size // 2)
    if grow and failed is not None:
        lo, hi = size, failed
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid) is None:
                lo = mid
            else:
                hi = mid
        size = lo
    return size
