"""Surviving CUDA out-of-memory: :func:`auto_microbatch` splits a training
step's batch, :func:`find_batch_size` finds the largest batch that fits. Both
free memory after an OOM (outofcuda.oom's _release) and leave its report to
outofcuda.oom, built when it is read."""
import contextlib
import copy
import functools
import math
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence

from ._native import core
from .oom import _note, _record, _release, is_oom

__all__ = ["auto_microbatch", "find_batch_size"]


# ---- splitting batches -----------------------------------------------------

def _is_container(x):
    """Mappings and Sequences are walked; text and bytes are values."""
    return (isinstance(x, (Mapping, Sequence))
            and not isinstance(x, (str, bytes, bytearray, memoryview)))


# How deep containers may nest in a batch: the walks below recurse once per
# level, so a deeper batch would end in a RecursionError instead of a message.
_DEPTH_MAX = 100


def _deeper(path, x):
    """`path` with x's container added, or a ValueError past _DEPTH_MAX."""
    if len(path) >= _DEPTH_MAX:
        raise ValueError(f"auto_microbatch: the batch nests containers more than {_DEPTH_MAX} "
                         f"deep (a {type(x).__name__} at that depth); pass tensors in "
                         f"shallower dicts, lists or tuples")
    return path + (id(x),)


def _tensors(x, torch, path=()):
    """Every tensor inside `x`; `path` holds the containers above, so a
    container that holds itself is walked once."""
    if isinstance(x, torch.Tensor):
        yield x
    elif _is_container(x) and id(x) not in path:
        inner = _deeper(path, x)
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


def _samples(args, torch):
    """n, the batch's length along dimension 0. A tensor as the first
    argument, the common case, is the batch and its own length."""
    a = args[0]
    if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] > 0:
        return a.shape[0]
    return _batch_len(_first_batch(args))


def _check_loss(loss, torch):
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(
            "auto_microbatch: fn must return the batch's mean loss as a 0-d "
            f"tensor, got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))


def _copy_with(x, pairs):
    """A shallow copy of x with new[k] = v for each pair, or None where x
    cannot be copied or written. A copy keeps what the constructor would lose:
    a defaultdict's factory, a UserDict subclass's own attributes."""
    try:
        new = copy.copy(x)
        for k, v in pairs:
            new[k] = v
        return new
    except Exception:  # noqa: BLE001 - the caller builds a new one
        return None


def _rebuild_mapping(x, items):
    new = _copy_with(x, items) if isinstance(x, MutableMapping) else None
    if new is not None:
        return new
    try:
        return type(x)(items)
    except Exception:  # noqa: BLE001 - a read-only Mapping with its own constructor
        return dict(items)


def _rebuild_sequence(x, items):
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*items)
    mutable = isinstance(x, MutableSequence) and not isinstance(x, list)
    new = _copy_with(x, enumerate(items)) if mutable else None
    if new is not None:
        return new
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
    inner = _deeper(path, x)
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


class _GradGuard:
    """Keeps each leaf's gradient as it was at entry so a failed attempt can be
    undone exactly, without copying: the entry gradient is set aside, this
    call's gradient builds up alone in ``.grad``, and on success the two are
    added (in place into the entry tensor, so its identity is kept)."""

    __slots__ = ("saved", "aside")

    def __init__(self):
        self.saved = {}
        self.aside = 0   # gradients set aside: 0 when every leaf started empty

    def adopt(self, loss):
        self.aside += core._grad_set_aside(loss, self.saved)

    def undo(self):
        _restore(self.saved)

    def commit(self):
        if self.aside:
            _add_back(self.saved)
        self.saved.clear()


def _restore(saved):
    """Every leaf's gradient back to what it was at entry."""
    for leaf, grad in saved.values():
        leaf.grad = grad
    saved.clear()


def _add_back(saved):
    """The entry gradients set aside, with this call's added in place (the
    entry tensor keeps its identity)."""
    for leaf, grad in saved.values():
        if grad is not None and leaf.grad is not None:
            grad.add_(leaf.grad)
            leaf.grad = grad
        elif grad is not None:
            leaf.grad = grad


def _check_fn(fn, who):
    if not callable(fn):
        raise TypeError(f"{who}: fn must be callable, got {type(fn).__name__}")


def _check_min_size(min_size, who):
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"{who}: min_size must be an int >= 1, got {min_size!r}")


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

    >>> import torch, outofcuda
    >>> model = torch.nn.Linear(8, 3)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> @outofcuda.auto_microbatch
    ... def step(x, y):
    ...     return torch.nn.functional.cross_entropy(model(x), y)
    >>> x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    >>> loss = step(x, y); opt.step(); opt.zero_grad()
    >>> step.pieces   # the whole batch fitted: one piece
    1
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
        self._prefix = instance or ()
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

    def _run_whole(self, args, kwargs, torch):
        """One attempt on the whole batch: no slicing, no no_sync(), and the
        gradient bookkeeping of _GradGuard inlined (this is every step's path)."""
        saved = {}
        try:
            loss = self.fn(*self._prefix, *args, **kwargs)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                _check_loss(loss, torch)
            aside = core._grad_set_aside(loss, saved)
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        except BaseException:
            _restore(saved)
            raise
        if aside:
            _add_back(saved)
        return loss.detach()

    def _run(self, n, size, args, kwargs, torch):
        prefix = self._instance or ()
        syncs = self._sync_modules(args, kwargs)
        guard, total = _GradGuard(), None
        try:
            for start in range(0, n, size):
                stop = min(n, start + size)
                part_args = _slice(args, n, start, stop, torch)
                part_kwargs = _slice(kwargs, n, start, stop, torch)
                with contextlib.ExitStack() as stack:
                    if stop < n:
                        # Gradients of all but the last micro-batch stay
                        # local; the last backward all-reduces their sum.
                        for module in syncs:
                            stack.enter_context(module.no_sync())
                    loss = self.fn(*prefix, *part_args, **part_kwargs)
                    _check_loss(loss, torch)
                    weighted = loss * ((stop - start) / n)
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
        import torch

        n = _samples(args, torch)
        st = self._state
        size = n if st.micro_size is None else min(n, st.micro_size)
        grow = st.micro_size is not None and st.clean_calls >= self.retry_after and size < n
        if grow:
            size, st.clean_calls = min(n, size * 2), 0
        while True:
            try:
                out = (self._run_whole(args, kwargs, torch) if size >= n
                       else self._run(n, size, args, kwargs, torch))
            except BaseException as exc:
                if not is_oom(exc):
                    raise
                error = exc
            else:
                st.pieces = 1 if size >= n else math.ceil(n / size)
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
            _note(error)
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
            core._microbatch_split()  # the OUTOFCUDA_SUMMARY block counts them


def find_batch_size(fn, start, *, min_size=1, grow=False):
    """The largest batch size (at most ``start``) for which ``fn(batch_size)``
    runs without CUDA out-of-memory.

    Calls ``fn(start)``; on OOM frees memory and halves the size until a call
    succeeds. With ``grow=True`` it then bisects between the size that worked
    and the one that failed to find the largest that works. Any exception that
    is not an OOM propagates unchanged; when ``min_size`` itself fails the
    original error is re-raised with the report attached.

    >>> import torch, outofcuda
    >>> model = torch.nn.Linear(8, 3)
    >>> def fits(b):
    ...     if b > 100:   # stands in for the CUDA OOM of a batch above 100 samples
    ...         raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    ...     model(torch.zeros(b, 8))
    >>> outofcuda.find_batch_size(fits, 512)
    64
    >>> outofcuda.find_batch_size(fits, 512, grow=True)
    100
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
            _note(exc)
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
