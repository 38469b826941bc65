"""Stand-ins for packages that manage GPU memory themselves, importing torch
the way their released wheels do (read in vllm 0.33.0, sglang 0.5.23 and
torch_memory_saver 0.0.10 from PyPI):
- vllm/__init__.py imports vllm.env_override first, which imports torch;
- `import sglang` reaches sglang/srt/utils/common.py, which imports torch
  while `sglang` is still being imported;
- torch_memory_saver/__init__.py imports .entrypoint, which imports torch
  (its preload library is loaded through LD_PRELOAD, see TMS_PRELOAD).
Each records what the allocator variable and torch's allocator held when it
ran, as the real ones read them (vLLM's config check and torch_memory_saver's
sanity check read os.environ["PYTORCH_CUDA_ALLOC_CONF"])."""
from pathlib import Path

FILES = {
    "vllm": {
        "vllm/__init__.py": "from .version import __version__\nimport vllm.env_override  # noqa\n",
        "vllm/version.py": "__version__ = '0.33.0'\n",
        "vllm/env_override.py": "import os\nimport torch\n"
                                "SEEN = os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')\n",
    },
    "sglang": {
        "sglang/__init__.py": "from sglang.srt.utils import common  # noqa\n",
        "sglang/srt/__init__.py": "",
        "sglang/srt/utils/__init__.py": "from sglang.srt.utils.common import *  # noqa\n",
        "sglang/srt/utils/common.py": "import os\nimport torch\n"
                                      "SEEN = os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')\n",
    },
    "torch_memory_saver": {
        "torch_memory_saver/__init__.py": "from .entrypoint import TorchMemorySaver  # noqa\n",
        "torch_memory_saver/entrypoint.py": "import os\nimport torch\n"
                                            "class TorchMemorySaver:\n    pass\n",
    },
}

# What LD_PRELOAD holds under torch_memory_saver's hook_mode="preload".
TMS_PRELOAD = "torch_memory_saver_hook_mode_preload_cu13.abi3.so"


def make_fake_framework(root: Path, name: str) -> Path:
    """Writes the stand-in package `name` under root; returns root."""
    for rel, text in FILES[name].items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
