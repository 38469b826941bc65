"""Platforms where one of outofcuda's defaults cannot work (src/platform.c).
Expandable segments fail on WSL (torch's Linux allocator does not detect it and
does not fall back): there outofcuda's default allocator string leaves them out,
says why in status(), and still lets a user's own choice stand. The kernel
release is simulated through the engine's one test door,
_outofcuda._testing.simulate_kernel_release, before torch is imported; torch is the
stand-in of a CUDA release (tests/fake_torch.py)."""
import json

import pytest

from fake_torch import make_fake_torch
from kit import last_json

WSL2 = "5.15.167.4-microsoft-standard-WSL2"
WSL1 = "4.4.0-19041-Microsoft"
NATIVE = "6.8.0-45-generic"

REPORT = """
import json, sys, _outofcuda
_outofcuda._testing.simulate_kernel_release(sys.argv[1])
import torch
torch.cuda._fake_cuda_init()
print('REPORT=' + json.dumps({'conf_read': torch._alloc_conf(), 'status': _outofcuda.status(),
                              'platform': _outofcuda._platform()}))
"""


def run(venv, tmp_path, release, env=None, torch_release="2.14.1"):
    root = make_fake_torch(tmp_path / "fake", torch_release)
    full_env = {"PYTHONPATH": str(root)}
    full_env.update(env or {})
    r = venv.run(None, env=full_env, args=("-W", "error", "-", release), cwd=tmp_path,
                 input=REPORT)
    return last_json(r, "REPORT="), r


@pytest.mark.parametrize("kernel", [WSL2, WSL1])
@pytest.mark.parametrize("torch_release", ["2.4.1", "2.14.1"])
def test_wsl_gets_no_expandable_segments_by_default(venv, tmp_path, kernel, torch_release):
    rep, r = run(venv, tmp_path, kernel, torch_release=torch_release)
    assert r.stderr == ""
    conf = rep["conf_read"]
    assert "expandable_segments" not in conf
    # The rest of the defaults stay, and the one meant for a non-expandable
    # allocator joins.
    assert "garbage_collection_threshold:0.8" in conf and "max_split_size_mb:128" in conf
    alloc = rep["status"]["optimizations"]["allocator"]
    assert alloc["applied"] and alloc["value"] == conf
    assert "platform_no_expandable" in alloc["notes"]  # why: the platform's "why" below
    assert rep["platform"] == {"kernel_release": kernel, "expandable_segments_work": False,
                               "why": rep["platform"]["why"],
                               "alloc_defaults": "garbage_collection_threshold:0.8"}


def test_native_linux_keeps_expandable_segments(venv, tmp_path):
    rep, r = run(venv, tmp_path, NATIVE)
    assert r.stderr == ""
    assert "expandable_segments:True" in rep["conf_read"]
    assert "max_split_size_mb" not in rep["conf_read"]
    assert rep["status"]["optimizations"]["allocator"]["notes"] == []
    assert rep["platform"] == {"kernel_release": NATIVE, "expandable_segments_work": True,
                               "why": None, "alloc_defaults":
                               "garbage_collection_threshold:0.8,expandable_segments:True"}


@pytest.mark.parametrize("env", [{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                                 {"OUTOFCUDA_ALLOC_CONF": "expandable_segments:True"}])
def test_a_users_expandable_segments_stand_on_wsl(venv, tmp_path, env):
    rep, _ = run(venv, tmp_path, WSL2, env=env)
    assert "expandable_segments:True" in rep["conf_read"]
    notes = rep["status"]["optimizations"]["allocator"]["notes"]
    assert "platform_no_expandable" not in notes
    # outofcuda's defaults were adjusted, and status says the user's key
    # overrode that; OUTOFCUDA_ALLOC_CONF replaces the defaults whole.
    assert ("user_expandable_kept" in notes) == ("PYTORCH_CUDA_ALLOC_CONF" in env), notes


def test_a_kernel_release_of_odd_bytes_reads_as_printable_ascii(venv, tmp_path):
    # a custom kernel's release with a byte that is not UTF-8 and a terminal
    # escape: status() and the report still work, and show neither
    rep, r = run(venv, tmp_path, "5.15.0-microsoft-standard-WSL2\udcff\x1b[31m")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    release = rep["platform"]["kernel_release"]
    assert release == "5.15.0-microsoft-standard-WSL2??[31m"
    assert release in rep["platform"]["why"]
    assert "expandable_segments" not in rep["conf_read"]


DOCTOR = """
import sys, _outofcuda
_outofcuda._testing.simulate_kernel_release(sys.argv[1])
from outofcuda import cli
sys.exit(cli.main(['doctor', '--json']))
"""


@pytest.mark.parametrize("user", [None, "expandable_segments:True"])
@pytest.mark.parametrize("kernel", [WSL2, NATIVE])
def test_doctor_shows_the_defaults_this_platform_gets(venv, tmp_path, kernel, user):
    # doctor tells what outofcuda applies here, and names a user's
    # expandable_segments:True where it fails
    env = {"PYTORCH_CUDA_ALLOC_CONF": user} if user else {}
    r = venv.run(None, env=env, args=("-", kernel), cwd=tmp_path, input=DOCTOR)
    assert r.stderr == "", r.stderr
    check = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["alloc_conf"]
    wsl = kernel == WSL2
    if user is None:
        assert check["ok"], check
        defaults = ("garbage_collection_threshold:0.8,max_split_size_mb:128" if wsl
                    else "garbage_collection_threshold:0.8,expandable_segments:True")
        assert f"no user allocator settings (defaults: {defaults})" in check["message"]
    else:
        assert check["ok"] is not wsl, check
    if check["ok"]:
        assert ("no expandable segments: WSL kernel" in check["message"]) is wsl
    if wsl and user:
        assert "sets expandable_segments:True, which fails on this platform" in check["message"]
        assert check["fix"] == "remove expandable_segments:True on this platform"
