"""The `gpu` fixture of the GPU checks: the test environment (tests/conftest.py
`venv`), once torch there can use CUDA. The device check comes first so a
machine without an NVIDIA GPU skips without building anything."""
import os

import pytest


@pytest.fixture(scope="module")
def gpu(request):
    if not (os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia/gpus")):
        pytest.skip("no NVIDIA GPU on this machine")
    venv = request.getfixturevalue("venv")
    r = venv.run("import torch; print(torch.cuda.is_available())")
    if r.returncode != 0 or r.stdout.strip() != "True":
        pytest.skip("torch.cuda.is_available() is False in the test environment")
    return venv
