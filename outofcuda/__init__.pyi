# Type stubs for outofcuda's public API (the runtime loads these names lazily).
from os import PathLike
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    List,
    Literal,
    NamedTuple,
    Optional,
    TypedDict,
    TypeVar,
    Union,
    overload,
)

import torch
from torch.utils.data import DataLoader

__version__: str

__all__ = ["status", "apply", "config", "autocast_context", "compile_model", "smart_dataloader",
           "memory_report", "clear_cache", "MemoryMonitor", "CudaOptimizer", "last_oom",
           "auto_microbatch", "find_batch_size"]

_M = TypeVar("_M", bound=torch.nn.Module)
_F = TypeVar("_F", bound=Callable[..., Any])
_DType = Union[torch.dtype, Literal["bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32"]]
_Device = Union[int, str, torch.device, None]

class Status(Dict[str, Any]):
    def __str__(self) -> str: ...

def status() -> Status: ...
def apply() -> Status: ...
def config() -> Dict[str, Any]: ...

# -- API (outofcuda.api) --
def autocast_context(
    device_type: Optional[str] = None,
    dtype: Optional[_DType] = None,
    enabled: bool = True,
) -> torch.autocast: ...
_CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]

def compile_model(
    model: _M,
    channels_last: Optional[bool] = None,
    compile: Optional[bool] = None,
    mode: Optional[_CompileMode] = None,
    fullgraph: Optional[bool] = None,
) -> _M: ...
def smart_dataloader(dataset: Any, **kwargs: Any) -> DataLoader[Any]: ...
class _GpuProcess(TypedDict):
    """A process holding memory on a GPU, as NVML lists it."""

    pid: int
    name: Optional[str]        # /proc/<pid>/comm (or cmdline); None if unreadable
    used_gb: Optional[float]   # None where the driver cannot tell
    this_process: bool

class _DeviceMemory(TypedDict):
    name: str
    total_gb: float
    allocated_gb: float
    reserved_gb: float
    free_gb: float
    peak_allocated_gb: float
    used_gb: float
    nvml_index: int
    processes: Optional[List[_GpuProcess]]  # largest first; None where NVML cannot list them

def memory_report() -> Dict[str, _DeviceMemory]: ...
def clear_cache() -> int: ...

class CudaOptimizer:
    def prepare(
        self,
        model: _M,
        channels_last: Optional[bool] = None,
        compile: Optional[bool] = None,
        mode: Optional[_CompileMode] = None,
        fullgraph: Optional[bool] = None,
    ) -> _M: ...
    def dataloader(self, dataset: Any, **kwargs: Any) -> DataLoader[Any]: ...
    def autocast(
        self,
        device_type: Optional[str] = None,
        dtype: Optional[_DType] = None,
        enabled: bool = True,
    ) -> torch.autocast: ...
    def clear(self) -> int: ...
    def report(self) -> Dict[str, Dict[str, Any]]: ...

# -- watchdog (outofcuda.monitor) --
# outofcuda.monitor.Sample at run time. Names with a leading underscore here
# are types only: the package does not export them.
class _Sample(NamedTuple):
    time: float
    used: int
    total: int
    process: Optional[int]
    reserved: Optional[int]
    allocated: Optional[int]

class MemoryMonitor(ContextManager["MemoryMonitor"]):
    threshold: float
    interval: float
    cooldown: float
    capacity: int
    device: int
    on_high: Optional[Callable[[Dict[str, Any]], Any]]
    allocator_stats: bool
    def __init__(
        self,
        threshold: float = 0.85,
        interval: float = 2.0,
        device: _Device = None,
        on_high: Optional[Callable[[Dict[str, Any]], Any]] = None,
        *,
        cooldown: float = 30.0,
        capacity: int = 10000,
        allocator_stats: bool = False,
    ) -> None: ...
    def start(self) -> "MemoryMonitor": ...
    def stop(self) -> None: ...
    def __enter__(self) -> "MemoryMonitor": ...
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]: ...
    @property
    def running(self) -> bool: ...
    @property
    def reason(self) -> Optional[str]: ...
    def samples(self) -> List[_Sample]: ...
    @property
    def events(self) -> List[Dict[str, Any]]: ...
    def to_csv(self, path: Union[str, "PathLike[str]"]) -> int: ...
    def plot(self, path: Union[str, "PathLike[str]"]) -> Union[str, "PathLike[str]"]: ...

# -- out-of-memory help (outofcuda.oom, outofcuda.microbatch) --
# A DistributedDataParallel (or other module with no_sync()), several, or False.
_SyncModules = Union[torch.nn.Module, List[torch.nn.Module], Literal[False], None]
def last_oom() -> Optional[Dict[str, Any]]: ...
@overload
def auto_microbatch(
    fn: _F,
    *,
    scaler: Any = None,
    min_size: int = 1,
    retry_after: int = 100,
    ddp: _SyncModules = None,
) -> _F: ...
@overload
def auto_microbatch(
    fn: None = None,
    *,
    scaler: Any = None,
    min_size: int = 1,
    retry_after: int = 100,
    ddp: _SyncModules = None,
) -> Callable[[_F], _F]: ...
def find_batch_size(
    fn: Callable[[int], Any], start: int, *, min_size: int = 1, grow: bool = False
) -> int: ...
