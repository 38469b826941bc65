"""MemoryMonitor: a native watchdog that empties torch's cache when VRAM runs high.

The watchdog is a C thread (``src/monitor.c``) that polls NVML without the
GIL; this module validates arguments, gives it a context manager, and turns
its timeline into lists, CSV and a plot.
"""
import atexit
import csv
import math
import sys
import warnings
from collections import namedtuple

from ._native import core

__all__ = ["MemoryMonitor", "Sample"]

Sample = namedtuple("Sample", "time used total process reserved allocated")
Sample.__doc__ = """One timeline point. ``time``: seconds since start; ``used``/``total``:
device bytes (NVML, every process); ``process``: bytes NVML charges to this process
(None when NVML does not list it); ``reserved``/``allocated``: torch's allocator
(None unless ``allocator_stats=True`` and CUDA is initialised)."""

_warned_no_gpu = False

# Interpreter shutdown: join every watchdog while Python still runs, before
# finalisation makes taking the GIL from another thread unsafe; from then on
# no watchdog starts.
atexit.register(core._monitor_stop_all, True)

# Bounds the C thread relies on: its longest wait (the C layer clamps there
# too) and a timeline that fits in memory (56 bytes a sample). A shorter
# interval than INTERVAL_MIN is raised to it (the C layer clamps there too):
# polling NVML more often only spins a core. Device indices are C ints.
INTERVAL_MAX = 86400.0
INTERVAL_MIN = 0.01
CAPACITY_MAX = 10_000_000
DEVICE_MAX = 2**31 - 1


def _device_index(device):
    if device is None:
        torch = sys.modules.get("torch")
        # Only ask torch when CUDA is already up: current_device() initialises it.
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, bool):
        raise TypeError(f"device must be None, an int, 'cuda:N' or a torch.device, got {device!r}")
    if isinstance(device, int):
        index = device
    else:
        text = str(device)
        kind, _, num = text.partition(":")
        if kind != "cuda" or (num and not (num.isascii() and num.isdigit())):
            raise ValueError(f"device must be a CUDA device ('cuda', 'cuda:N' or N), got {device!r}")
        if len(num.lstrip("0")) > len(str(DEVICE_MAX)):  # int() of 5000 digits raises
            raise ValueError(f"device index must be from 0 to {DEVICE_MAX}, got {device!r}")
        index = int(num) if num else _device_index(None)
    if not 0 <= index <= DEVICE_MAX:
        raise ValueError(f"device index must be from 0 to {DEVICE_MAX}, got {index}")
    return index


def _number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"{name} must be a finite number, got an integer of "
                         f"{value.bit_length()} bits") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


class MemoryMonitor:
    """Watch a GPU's memory; above ``threshold`` empty torch's cache and call ``on_high``.

    ``threshold``: fraction of the device's memory in use (NVML, all
    processes) that triggers action, in (0, 1]. ``interval``: seconds between
    polls (> 0, at most 86400; below 0.01 it polls every 0.01 s, and
    ``.interval`` says so). ``device``: None (the current device when CUDA is up, else
    0), an index, ``"cuda:N"`` or a ``torch.device``. ``on_high(event)`` is
    called from the watchdog thread with a dict (time, used, total, fraction,
    released, ...). It acts once per upward crossing and, while usage stays
    high, again only after ``cooldown`` seconds (emptying the cache in a loop
    slows training). ``capacity`` bounds the timeline (oldest dropped; at
    most 10,000,000).
    ``allocator_stats=True`` also records torch's reserved/allocated bytes,
    taking the GIL briefly at each poll; by default the poll never takes it.

    Without a GPU it starts, records nothing and warns once why.

    >>> from outofcuda import MemoryMonitor
    >>> with MemoryMonitor(threshold=0.85, interval=2.0) as mon:
    ...     train(model, loader)      # needs a GPU and a training loop  # doctest: +SKIP
    >>> mon.events                    # what it did (needs the run)  # doctest: +SKIP
    >>> mon.to_csv("vram.csv")        # the timeline (needs the run) # doctest: +SKIP
    """

    def __init__(self, threshold=0.85, interval=2.0, device=None, on_high=None, *,
                 cooldown=30.0, capacity=10000, allocator_stats=False, _source=None):
        threshold = _number("threshold", threshold)
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1] (a fraction of the device's memory), got {threshold}")
        interval = _number("interval", interval)
        if not 0.0 < interval <= INTERVAL_MAX:
            raise ValueError(f"interval must be > 0 and <= {INTERVAL_MAX:.0f} seconds (one day), "
                             f"got {interval}")
        cooldown = _number("cooldown", cooldown)
        if cooldown < 0.0:
            raise ValueError(f"cooldown must be >= 0 seconds, got {cooldown}")
        if (isinstance(capacity, bool) or not isinstance(capacity, int)
                or not 1 <= capacity <= CAPACITY_MAX):
            raise ValueError(f"capacity must be a whole number from 1 to {CAPACITY_MAX}, "
                             f"got {capacity!r}")
        if on_high is not None and not callable(on_high):
            raise TypeError(f"on_high must be callable or None, got {on_high!r}")
        if not isinstance(allocator_stats, bool):
            raise TypeError(f"allocator_stats must be True or False, got {allocator_stats!r}")
        self.threshold = threshold
        self.interval = max(interval, INTERVAL_MIN)
        self.cooldown = cooldown
        self.capacity = capacity
        self.device = _device_index(device)
        self.on_high = on_high
        self.allocator_stats = allocator_stats
        self._source = "" if _source is None else str(_source)
        self._handle = None

    # -- lifecycle --

    def start(self):
        """Start watching (a fresh timeline). Raises RuntimeError if already running."""
        return self._start(stacklevel=3)

    def _start(self, stacklevel):
        # stacklevel names the user's frame: start()'s caller, or the line of
        # the `with` statement when __enter__ starts it.
        global _warned_no_gpu
        if self.running:
            raise RuntimeError("this MemoryMonitor is already running")
        old, self._handle = self._handle, None
        if old is not None:
            core._monitor_stop(old)
        args = (self.device, self.threshold, self.interval, self.cooldown, self.on_high,
                self.capacity, self.allocator_stats)
        # _source (tests only) reads the memory figures from a file instead
        # of NVML, through the engine's test door.
        self._handle = (core._testing.monitor_start(*args, self._source) if self._source
                        else core._monitor_start(*args))
        why = self.reason
        if why and not _warned_no_gpu:
            _warned_no_gpu = True
            warnings.warn(core._labelled(f"outofcuda.MemoryMonitor: {why}; it records nothing"),
                          RuntimeWarning,
                          stacklevel=stacklevel)
        return self

    def stop(self):
        """Stop and join the watchdog (idempotent); the timeline stays readable.

        Called from ``on_high`` (the watchdog's own thread) it stops the
        watchdog, which ends once ``on_high`` returns; the join follows later."""
        if self._handle is not None:
            core._monitor_stop(self._handle)

    def __enter__(self):
        return self._start(stacklevel=3)

    def __exit__(self, exc_type, exc, tb):
        self.stop()
        return False

    @property
    def running(self):
        """True while the watchdog thread runs (False in a forked child)."""
        return self._handle is not None and core._monitor_info(self._handle)["running"]

    @property
    def reason(self):
        """Why nothing is watched (no GPU, inherited across fork), or None."""
        if self._handle is None:
            return None
        return core._monitor_info(self._handle)["why"] or None

    # -- results --

    def samples(self):
        """The timeline, oldest first, as :class:`Sample` tuples."""
        if self._handle is None:
            return []
        return [Sample(*row) for row in core._monitor_samples(self._handle)]

    @property
    def events(self):
        """What the watchdog did, oldest first: dicts with kind ("high" or
        "on_high_error"), time, used, total, fraction, used_after, released, message."""
        if self._handle is None:
            return []
        return core._monitor_events(self._handle)

    def to_csv(self, path):
        """Write the timeline to ``path`` (CSV with a header); returns the row count."""
        rows = self.samples()
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(Sample._fields)
            for s in rows:
                w.writerow(["" if v is None else v for v in s])
        return len(rows)

    def plot(self, path):
        """Draw the timeline (GiB over seconds) and the actions to a PNG at ``path``.

        Both axes start at 0; without samples they span 1 s and 1 GiB (the
        device's total once a sample gave it). Needs matplotlib
        (``python3 -m pip install matplotlib``).
        """
        try:
            import matplotlib
        except ImportError:
            raise ImportError(
                "MemoryMonitor.plot() needs matplotlib, an optional dependency: "
                f"{sys.executable or 'python3'} -m pip install matplotlib; "
                "MemoryMonitor.to_csv() needs nothing extra"
            ) from None
        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        rows = self.samples()
        gib = float(1 << 30)
        fig, ax = plt.subplots(figsize=(8, 4))
        try:
            t = [s.time for s in rows]
            ax.plot(t, [s.used / gib for s in rows], label="device used (NVML)")
            for field in ("process", "reserved", "allocated"):
                pts = [(s.time, getattr(s, field) / gib) for s in rows if getattr(s, field) is not None]
                if pts:
                    ax.plot(*zip(*pts), label=field)
            if rows:
                ax.axhline(self.threshold * rows[-1].total / gib, linestyle="--", color="grey",
                           label=f"threshold {self.threshold:.0%}")
            for e in self.events:
                ax.axvline(e["time"], color="red", alpha=0.4)
            # Fixed floors: matplotlib would centre an empty or flat plot on
            # 0 with a span of 0.08 (negative seconds and GiB).
            xmax, ymax = _plot_limits(rows)
            ax.set_xlim(0, xmax)
            ax.set_ylim(0, ymax)
            ax.set_xlabel("seconds since start")
            ax.set_ylabel("GiB")
            ax.set_title(f"outofcuda MemoryMonitor, cuda:{self.device}")
            ax.legend(loc="best")
            fig.savefig(path, format="png")
        finally:
            plt.close(fig)
        return path

    def __repr__(self):
        state = "running" if self.running else "stopped"
        return (f"MemoryMonitor(threshold={self.threshold}, interval={self.interval}, "
                f"device={self.device}, {state})")


def _plot_limits(rows):
    """(seconds, GiB): where MemoryMonitor.plot()'s axes end. At least 1 s
    and 1 GiB; the last sample's time and the device's total memory (every
    figure plotted, the threshold line included, lies under it) once a
    sample gave them."""
    gib = float(1 << 30)
    seconds = max([1.0] + [s.time for s in rows])
    top = max([1.0] + [s.total / gib for s in rows if s.total])
    top = max([top] + [getattr(s, f) / gib for s in rows
                       for f in ("used", "process", "reserved", "allocated")
                       if getattr(s, f) is not None])
    return seconds, top
