"""NVML on a machine without a GPU: a stand-in driver library
(tests/stub_nvml/stub_nvml.c, built by tests/conftest.py with gcc as
libnvidia-ml.so.1 and found only through LD_LIBRARY_PATH) answers from a
file each test writes.
Everything above the driver is the real product: the built wheel, real torch,
a fresh interpreter per scenario."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import stub_nvml_config as config, stub_nvml_device as device
from fake_torch import make_fake_torch
from kit import CHILD, last_json

GIB = 1 << 30
MIB = 1 << 20
UUID0 = "GPU-0a1b2c3d-0000-4000-8000-000000000000"   # stub_nvml_device()'s default
UUID1 = "GPU-9f8e7d6c-1111-4111-8111-111111111111"
MIG1 = "MIG-5e5e5e5e-2222-4222-8222-222222222222"


@pytest.fixture
def nvml(stub_nvml_libs, tmp_path):
    """Returns env(config_path, variant="full", **more) for venv.run."""
    def env(cfg, variant="full", **more):
        return {"LD_LIBRARY_PATH": str(stub_nvml_libs[variant]), "STUB_NVML_CONFIG": str(cfg),
                **more}
    return env


# ---- the stand-in itself ----

def test_stub_exports_what_outofcuda_looks_up(stub_nvml_libs):
    """Every NVML name src/nvml.c asks dlsym for exists in the stand-in (and
    nvmlDeviceGetUtilizationRates, for later sampling)."""
    src = (Path(__file__).resolve().parent.parent / "src" / "nvml.c").read_text()
    wanted = set(re.findall(r"\"(nvml[A-Z][A-Za-z0-9_]+)\"", src)) | {"nvmlDeviceGetUtilizationRates"}
    legacy = {"nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex"}
    nm = subprocess.run(["nm", "-D", "--defined-only", str(stub_nvml_libs["full"] / "libnvidia-ml.so.1")],
                        capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in nm.splitlines() if " T " in line}
    assert wanted - legacy <= exported, wanted - legacy - exported
    nm = subprocess.run(["nm", "-D", "--defined-only",
                         str(stub_nvml_libs["legacy"] / "libnvidia-ml.so.1")],
                        capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in nm.splitlines() if " T " in line}
    assert legacy <= exported and "nvmlInit_v2" not in exported


def test_stub_utilization_answers(stub_nvml_libs, tmp_path, monkeypatch):
    import ctypes
    cfg = config(tmp_path / "nvml.cfg", [device(util="63,21")])
    monkeypatch.setenv("STUB_NVML_CONFIG", str(cfg))
    lib = ctypes.CDLL(str(stub_nvml_libs["full"] / "libnvidia-ml.so.1"))
    assert lib.nvmlInit_v2() == 0
    handle = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
    util = (ctypes.c_uint * 2)()
    assert lib.nvmlDeviceGetUtilizationRates(handle, util) == 0
    assert list(util) == [63, 21]


def test_stub_utilization_sequences(stub_nvml, tmp_path, monkeypatch):
    """utilseq: one value per call, then NOT_SUPPORTED (3) or, with "+", the
    last value again; a device without one keeps its util= figures."""
    import ctypes
    cfg = config(tmp_path / "nvml.cfg", [device(), device(uuid=UUID1), device(util="5,6")],
                 utilseqs=[(0, ["10,4", 30], ""), (1, [70], "+")])
    monkeypatch.setenv("STUB_NVML_CONFIG", str(cfg))
    lib = ctypes.CDLL(str(stub_nvml / "libnvidia-ml.so.1"))
    assert lib.nvmlInit_v2() == 0

    def served(index, calls):
        handle, util, out = ctypes.c_void_p(), (ctypes.c_uint * 2)(), []
        assert lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0
        for _ in range(calls):
            rc = lib.nvmlDeviceGetUtilizationRates(handle, util)
            out.append(list(util) if rc == 0 else rc)
        return out

    assert served(0, 4) == [[10, 4], [30, 0], 3, 3]
    assert served(1, 3) == [[70, 0], [70, 0], [70, 0]]
    assert served(2, 2) == [[5, 6], [5, 6]]


# ---- devices, status, doctor ----

def test_devices_status_and_doctor_list_the_gpus(venv, workdir, tmp_path, nvml):
    cfg = config(tmp_path / "nvml.cfg", [
        device(), device(name="Tesla V100-SXM2-16GB", uuid=UUID1, cc="7.0", total=16 * GIB,
                         used=3 * GIB)], migs=[(MIG1, 1)])   # a MIG instance of GPU 1
    env = nvml(cfg)
    d = last_json(venv.run("import json, _outofcuda; print(json.dumps(_outofcuda.nvml_devices()))",
                           env=env, cwd=workdir))
    devices, why = d
    assert why is None
    assert [(g["index"], g["name"], g["uuid"], g["compute_capability"]) for g in devices] == [
        (0, "NVIDIA A100-SXM4-80GB", UUID0, [8, 0]), (1, "Tesla V100-SXM2-16GB", UUID1, [7, 0])]
    assert devices[1]["total"] == 16 * GIB and devices[1]["used"] == 3 * GIB
    assert devices[1]["free"] == 13 * GIB and devices[0]["driver"] == "550.54.15"

    r = venv.run(None, args=("-m", "outofcuda", "status"), env=env, cwd=workdir)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith(("0 ", "1 "))]
    assert len(rows) == 2, r.stdout
    assert rows[0].split()[:3] == ["0", "NVIDIA", "A100-SXM4-80GB"] and "8.0" in rows[0]
    assert "1,024 MiB / 81,920 MiB" in rows[0] and rows[0].endswith("550.54.15")
    assert "7.0" in rows[1] and "3,072 MiB / 16,384 MiB" in rows[1]
    js = json.loads(venv.check(None, args=("-m", "outofcuda", "status", "--json"), env=env,
                               cwd=workdir).stdout)
    assert [g["uuid"] for g in js["gpus"]] == [UUID0, UUID1] and js["nvml_error"] is None

    # doctor checks CUDA_VISIBLE_DEVICES against NVML's count.
    r = venv.run(None, args=("-m", "outofcuda", "doctor", "--json"), cwd=workdir,
                 env=dict(env, CUDA_VISIBLE_DEVICES="0,2"))
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["cuda_visible_devices"]["ok"] is False
    assert "names GPU 2 but NVML sees 2" in checks["cuda_visible_devices"]["message"]
    r = venv.run(None, args=("-m", "outofcuda", "doctor", "--json"), cwd=workdir,
                 env=dict(env, CUDA_VISIBLE_DEVICES=f"1,{MIG1}"))
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["cuda_visible_devices"]["ok"] is True


@pytest.mark.parametrize("visible,ok,words", [
    ("GPU-ffffffff", False, "'GPU-ffffffff' matches no device NVML sees"),
    ("0,MIG-ffffffff-0000-0000-0000-000000000000", False, "shows 1 GPU"),
    ("0,7,1", False, "names GPU 7 but NVML sees 2"),
    ("-1", False, "hides every GPU"),
    (" 1 , 0 ", True, "NVML GPUs 1, 0"),
    ("GPU-9f8e", True, "NVML GPUs 1"),
])
def test_doctor_reads_cuda_visible_devices_as_the_engine_does(venv, workdir, tmp_path, nvml,
                                                              visible, ok, words):
    """doctor's verdict is nvml.c's: CUDA stops at the first entry no device
    answers to, a UUID included."""
    cfg = config(tmp_path / "nvml.cfg", MIXED, migs=[(MIG1, 1)])
    env = dict(nvml(cfg), CUDA_VISIBLE_DEVICES=visible)
    r = venv.run(None, args=("-m", "outofcuda", "doctor", "--json"), cwd=workdir, env=env)
    check = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["cuda_visible_devices"]
    assert check["ok"] is ok and words in check["message"], check
    shown = last_json(venv.run("import json, _outofcuda; print(json.dumps("
                               "_outofcuda.visible_devices()['indices']))", env=env, cwd=workdir))
    index = last_json(venv.run(DECIDE, env=env, cwd=workdir))[1]
    assert index == (shown + [None] * 3)[:3]   # the map the rest of the engine uses


# ---- autocast "auto" ----

DECIDE = """
import json, _outofcuda
print(json.dumps([list(_outofcuda._api_autocast_dtype("cuda")),
                  [_outofcuda.nvml_index(i) for i in range(3)]]))
"""


@pytest.mark.parametrize("cc,dtype", [("8.0", "bfloat16"), ("9.0", "bfloat16"),
                                      ("7.5", "float16"), ("6.1", "float16")])
def test_autocast_auto_follows_compute_capability(venv, workdir, tmp_path, nvml, cc, dtype):
    cfg = config(tmp_path / "nvml.cfg", [device(cc=cc)])
    (decision, index) = last_json(venv.run(DECIDE, env=nvml(cfg), cwd=workdir))
    op = ">=" if dtype == "bfloat16" else "<"
    assert decision == [dtype, f"compute capability {cc} {op} 8.0 (from NVML)"]
    assert index == [0, None, None]


def test_autocast_hook_decides_from_nvml_with_a_cuda_torch(venv, tmp_path, nvml):
    """With a CUDA build of torch (the stand-in package of tests/fake_torch.py),
    the start-up hook itself sets the autocast dtype from NVML's compute
    capability, and status() reports it."""
    root = make_fake_torch(tmp_path / "fake", "2.11.0")
    code = """
import json, torch, _outofcuda
print(json.dumps([_outofcuda.status()["optimizations"]["amp_dtype"],
                  [list(map(str, c)) for c in torch._C.calls if "autocast" in str(c[0])]]))
"""
    for cc, dtype in (("8.6", "bfloat16"), ("7.5", "float16")):
        cfg = config(tmp_path / f"nvml-{cc}.cfg", [device(cc=cc)])
        entry, calls = last_json(venv.run(code, env=nvml(cfg, PYTHONPATH=str(root)),
                                          cwd=tmp_path))
        assert entry["applied"] is True and entry["value"] == dtype, entry
        assert entry["code"] == "default"  # OUTOFCUDA_AMP_DTYPE=auto, outofcuda's default
        assert entry["capability"] == cc and entry["notes"] == ["capability_from_nvml"], entry
        assert calls == [["set_autocast_dtype", "cuda", f"torch.{dtype}"]]


BF16_CONV = {"id": "bf16_conv", "ways_back": ["OUTOFCUDA_AMP_DTYPE=float16", "channels_last"]}


@pytest.mark.parametrize("cc,amp,cost", [("9.0", None, BF16_CONV), ("8.0", None, BF16_CONV),
                                         ("7.5", None, None), ("9.0", "bf16", None)])
def test_autocast_bfloat16_default_names_its_cost_on_convolution_networks(venv, tmp_path, nvml,
                                                                          cc, amp, cost):
    """Where outofcuda itself makes bfloat16 the autocast dtype (auto, compute
    capability 8.0 or more), its record carries the typed cost (slower on
    eager NCHW convolution networks) with the two ways back, and the verbose
    table shows them; a dtype the user asked for, or float16, carries none."""
    root = make_fake_torch(tmp_path / "fake", "2.11.0")
    cfg = config(tmp_path / "nvml.cfg", [device(cc=cc)])
    env = nvml(cfg, PYTHONPATH=str(root), OUTOFCUDA_VERBOSE="1")
    if amp:
        env["OUTOFCUDA_AMP_DTYPE"] = amp
    r = venv.run("""
import json, torch, _outofcuda
print(json.dumps(_outofcuda.status()["optimizations"]["amp_dtype"]))
""", env=env, cwd=tmp_path)
    entry = last_json(r)
    assert entry["applied"] is True and entry.get("cost") == cost, entry
    table = r.stderr[r.stderr.index("  amp_dtype "):r.stderr.index("  oom_handler ")]
    for way in BF16_CONV["ways_back"]:
        assert (way in table) == (cost is not None), table
    # doctor and report --bug render the same record.
    # (doctor's exit says whether other checks want attention: not this test's)
    r = venv.run(None, args=["-m", "outofcuda", "doctor", "--json"], env=env, cwd=tmp_path,
                 timeout=300)
    assert r.stdout, r.stderr
    doctor = json.loads(r.stdout)
    (check,) = [c for c in doctor["checks"] if c["name"] == "amp_dtype"]
    assert check["ok"] is True and check["code"] == (cost or {}).get("id"), check
    assert check["message"].endswith(entry["reason"])
    bug = json.loads(venv.check(None, args=["-m", "outofcuda", "report", "--bug", "--json"],
                                env=env, cwd=tmp_path, timeout=300).stdout)
    assert bug["optimizations"]["amp_dtype"].get("cost") == cost


def auto_fraction(total):
    """The rule docs/what-it-changes.md states for OUTOFCUDA_MEMORY_FRACTION=auto."""
    headroom = min(max(total / 50, 768 * MIB), 2 * GIB, total / 4)
    return 1.0 - headroom / total


FRACTION = """
import json, torch, _outofcuda
queued = _outofcuda.status()["optimizations"]["memory_fraction"]
torch.cuda._fake_cuda_init()
print(json.dumps([queued, _outofcuda.status()["optimizations"]["memory_fraction"],
                  [c[1:] for c in torch._C.calls if c[0] == "_cuda_setMemoryFraction"]]))
"""


@pytest.mark.parametrize("gib", [2, 8, 24, 80, 141, 192])
def test_memory_cap_leaves_a_headroom_sized_by_what_lives_outside_the_allocator(
        venv, tmp_path, nvml, gib):
    """OUTOFCUDA_MEMORY_FRACTION=auto (the default): the cap set when CUDA
    starts leaves 2 % of the board, at least 768 MiB and at most 2 GiB (never
    over a quarter of it), outside torch's caching allocator; NVML gives the
    board's size. Until CUDA starts the fraction reads None."""
    root = make_fake_torch(tmp_path / "fake", "2.11.0")
    cfg = config(tmp_path / "nvml.cfg", [device(total=gib * GIB)])
    queued, entry, calls = last_json(venv.run(FRACTION, env=nvml(cfg, PYTHONPATH=str(root)),
                                              cwd=tmp_path))
    assert queued["state"] == "queued" and queued["value"] == {"fraction": None, "device": None}
    want = auto_fraction(gib * GIB)
    assert entry["applied"] is True and entry["value"] == {"fraction": want, "device": 0}, entry
    assert calls == [[want, 0]]
    withheld = {2: 0.5, 8: 0.75, 24: 0.75, 80: 1.6, 141: 2, 192: 2}[gib]
    assert gib * (1 - want) == pytest.approx(withheld)


@pytest.mark.parametrize("more,want", [
    ({"OUTOFCUDA_MEMORY_FRACTION": "0.9"}, 0.9),           # the user's own value wins
    ({"OUTOFCUDA_MEMORY_FRACTION": "auto"}, auto_fraction(80 * GIB)),
    ({"CUDA_VISIBLE_DEVICES": MIG1}, 0.95),                # a MIG instance: NVML's total is the GPU's
    ({"STUB_NVML_CONFIG": "/nonexistent"}, 0.95),          # the board's size unknown
])
def test_memory_cap_where_the_board_does_not_size_it(venv, tmp_path, nvml, more, want):
    root = make_fake_torch(tmp_path / "fake", "2.11.0")
    cfg = config(tmp_path / "nvml.cfg", [device(total=80 * GIB)], migs=[(MIG1, 0)])
    _, entry, calls = last_json(venv.run(FRACTION, env=nvml(cfg, PYTHONPATH=str(root), **more),
                                         cwd=tmp_path))
    assert entry["value"] == {"fraction": want, "device": 0}, entry
    assert calls == [[want, 0]]


def test_real_cpu_torch_hook_leaves_autocast_alone(venv, workdir, tmp_path, nvml):
    """torch 2.13 CPU build: the hook sets no CUDA autocast dtype and says why;
    the decision for autocast_context() still comes from NVML."""
    cfg = config(tmp_path / "nvml.cfg", [device(cc="9.0")])
    entry, decision = last_json(venv.run("""
import json, torch, _outofcuda
print(json.dumps([_outofcuda.status()["optimizations"]["amp_dtype"],
                  _outofcuda._api_autocast_dtype("cuda")]))
""", env=nvml(cfg), cwd=workdir))
    assert entry["applied"] is False and entry["code"] == "no_cuda"
    assert decision[0] == "bfloat16"


MIXED = [device(cc="8.0"), device(name="Tesla V100-SXM2-16GB", uuid=UUID1, cc="7.0",
                                  total=16 * GIB)]


@pytest.mark.parametrize("visible,dtype,index", [
    (None, "float16", [0, 1, None]),                     # the lowest capability decides
    ("0", "bfloat16", [0, None, None]),
    ("1", "float16", [1, None, None]),
    ("1,0", "float16", [1, 0, None]),
    (" 0 , 1 ", "float16", [0, 1, None]),
    ("GPU-0a1b2c3d", "bfloat16", [0, None, None]),       # a UUID prefix
    (UUID1, "float16", [1, None, None]),
    (MIG1, "float16", [1, None, None]),                  # a MIG instance of GPU 1
    (f"MIG-{UUID0}/1/0", "bfloat16", [0, None, None]),  # R450 MIG syntax
    ("0,7,1", "bfloat16", [0, None, None]),              # CUDA stops at the unknown entry
    ("MIG-ffffffff-0000-0000-0000-000000000000,1", None, [None, None, None]),
    ("-1", None, [None, None, None]),                    # nothing visible: no capability
])
def test_mixed_devices_and_cuda_visible_devices(venv, workdir, tmp_path, nvml, visible, dtype,
                                                index):
    cfg = config(tmp_path / "nvml.cfg", MIXED, migs=[(MIG1, 1)])
    env = nvml(cfg)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    decision, got = last_json(venv.run(DECIDE, env=env, cwd=workdir))
    assert decision[0] == dtype, decision
    assert got == index


# ---- processes: every entry layout ----

PROCS = """
import json, _outofcuda, outofcuda
rep = outofcuda.memory_report()
print(json.dumps([_outofcuda.nvml_processes(0), rep]))
"""


@pytest.mark.parametrize("count", [1, 2, 64, 100, 3000])
@pytest.mark.parametrize("stride", [16, 24, 32])
def test_processes_read_right_for_every_entry_layout(venv, workdir, tmp_path, nvml, stride,
                                                     count):
    """_v3 entries of 16, 24 and 32 bytes, as driver branches write them; more
    processes than the first buffer holds (64) make the driver answer
    INSUFFICIENT_SIZE, and the list is read again into a larger one."""
    procs = [(0, 100000 + 7 * i, (i % 50 + 1) * 256 * MIB) for i in range(count)]
    cfg = config(tmp_path / "nvml.cfg", [device(total=80 * GIB)], procs=procs, stride=stride)
    got, rep = last_json(venv.run(PROCS, env=nvml(cfg), cwd=workdir))
    assert got == [[pid, used] for _, pid, used in procs]
    listed = rep["cuda:0"]["processes"]
    assert len(listed) == count
    assert sorted(p["pid"] for p in listed) == sorted(pid for _, pid, _ in procs)
    assert listed[0]["used_gb"] == max(u for _, _, u in procs) / GIB


def test_processes_through_older_entry_points(venv, workdir, tmp_path, nvml):
    """Drivers without _v3: the unsuffixed entry point (16-byte v1 entries)."""
    procs = [(0, 4242, 3 * GIB), (0, 4343, 5 * GIB)]
    cfg = config(tmp_path / "nvml.cfg", [device()], procs=procs)
    got, rep = last_json(venv.run(PROCS, env=nvml(cfg, "legacy"), cwd=workdir))
    assert got == [[4242, 3 * GIB], [4343, 5 * GIB]]
    assert rep["cuda:0"]["total_gb"] == 80.0
    # A driver whose _v3 fails (NOT_SUPPORTED on some virtualised GPUs): _v2.
    cfg = config(tmp_path / "nvml.cfg", [device()], procs=procs,
                 errors=[("nvmlDeviceGetComputeRunningProcesses_v3", 3)])
    got, rep = last_json(venv.run(PROCS, env=nvml(cfg), cwd=workdir))
    assert got == [[4242, 3 * GIB], [4343, 5 * GIB]]
    # Every entry point fails: no list, and the report says it does not know.
    cfg = config(tmp_path / "nvml.cfg", [device()], procs=procs,
                 errors=[(f"nvmlDeviceGetComputeRunningProcesses{s}", 3) for s in ("_v3", "_v2", "")])
    got, rep = last_json(venv.run(PROCS, env=nvml(cfg), cwd=workdir))
    assert got == [] and rep["cuda:0"]["processes"] is None
    assert rep["cuda:0"]["total_gb"] == 80.0


# ---- memory_report() and `outofcuda report` ----

REPORT = """
import json, os, outofcuda
rep = outofcuda.memory_report()
print(json.dumps({"rep": rep, "pid": os.getpid(), "ppid": os.getppid(),
                  "comm": open("/proc/self/comm").read().strip(),
                  "pcomm": open(f"/proc/{os.getppid()}/comm").read().strip()}))
"""


def test_memory_report_from_nvml_with_processes(venv, workdir, tmp_path, nvml):
    cfg = config(tmp_path / "nvml.cfg", MIXED, stride=32,
                 procs=[(0, "self", 2 * GIB), (0, "parent", 6 * GIB), (0, 4000001, GIB),
                        (1, "parent", 512 * MIB)])
    d = last_json(venv.run(REPORT, env=nvml(cfg, CUDA_VISIBLE_DEVICES="1,0"), cwd=workdir))
    rep = d["rep"]
    assert list(rep) == ["cuda:0", "cuda:1"]
    a100, v100 = rep["cuda:1"], rep["cuda:0"]
    assert (v100["name"], v100["nvml_index"], v100["total_gb"]) == ("Tesla V100-SXM2-16GB", 1,
                                                                       16.0)
    assert (a100["name"], a100["nvml_index"], a100["total_gb"]) == ("NVIDIA A100-SXM4-80GB", 0,
                                                                       80.0)
    assert a100["used_gb"] == 1.0 and a100["free_gb"] == 79.0
    assert a100["allocated_gb"] == 0.0 and a100["reserved_gb"] == 0.0   # CUDA never started
    # Largest first; names from /proc; None where the pid does not exist here.
    assert a100["processes"] == [
        {"pid": d["ppid"], "name": d["pcomm"], "used_gb": 6.0, "this_process": False},
        {"pid": d["pid"], "name": d["comm"], "used_gb": 2.0, "this_process": True},
        {"pid": 4000001, "name": None, "used_gb": 1.0, "this_process": False}]
    assert v100["processes"] == [
        {"pid": d["ppid"], "name": d["pcomm"], "used_gb": 0.5, "this_process": False}]
    # The type stubs name exactly these keys.
    import ast
    stubs = ast.parse((Path(__file__).resolve().parent.parent / "outofcuda" / "__init__.pyi")
                      .read_text())
    fields = {c.name: [a.target.id for a in c.body if isinstance(a, ast.AnnAssign)]
              for c in stubs.body if isinstance(c, ast.ClassDef)}
    assert fields["_DeviceMemory"] == list(a100)
    assert fields["_GpuProcess"] == list(a100["processes"][0])


def test_report_command_lists_the_processes(venv, workdir, tmp_path, nvml):
    cfg = config(tmp_path / "nvml.cfg", [device()],
                 procs=[(0, "parent", 6 * GIB), (0, 4000001, GIB)])
    env = nvml(cfg)
    r = venv.run(None, args=("-m", "outofcuda", "report"), env=env, cwd=workdir)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "cuda:0"
    assert any(ln.split() == ["name", "NVIDIA", "A100-SXM4-80GB"] for ln in lines), r.stdout
    start = [i for i, ln in enumerate(lines) if ln.strip().startswith("processes")]
    assert start, r.stdout
    procs = lines[start[0] + 1:start[0] + 3]
    ppid = os.getpid()   # the venv interpreter's parent is this test process
    comm = Path("/proc/self/comm").read_text().strip()
    assert procs[0].split() == [str(ppid), comm, "6.000", "GiB"], procs
    assert procs[1].split() == ["4000001", "(unknown)", "1.000", "GiB"], procs
    js = json.loads(venv.check(None, args=("-m", "outofcuda", "report", "--json"), env=env,
                               cwd=workdir).stdout)
    assert [p["pid"] for p in js["cuda:0"]["processes"]] == [ppid, 4000001]


def test_report_command_without_processes_says_none(venv, workdir, tmp_path, nvml):
    cfg = config(tmp_path / "nvml.cfg", [device()])
    r = venv.check(None, args=("-m", "outofcuda", "report"), env=nvml(cfg), cwd=workdir)
    assert [ln.split() for ln in r.stdout.splitlines() if "processes" in ln] == [
        ["processes", "none"]], r.stdout
    cfg = config(tmp_path / "nvml.cfg", [device()], errors=[
        (f"nvmlDeviceGetComputeRunningProcesses{s}", 3) for s in ("_v3", "_v2", "")])
    r = venv.check(None, args=("-m", "outofcuda", "report"), env=nvml(cfg), cwd=workdir)
    assert [ln.split() for ln in r.stdout.splitlines() if "processes" in ln] == [
        ["processes", "unknown", "(NVML", "cannot", "list", "them)"]], r.stdout


# ---- MemoryMonitor through NVML ----

def test_monitor_crosses_its_threshold_through_nvml(venv, workdir, tmp_path, nvml):
    """The watchdog's real NVML source (no _source file): memory use rises past
    the threshold while it watches. The script renames a prepared answer file
    (60 of 80 GiB in use) over the stand-in's, which re-reads it."""
    cfg_path = config(tmp_path / "nvml.cfg", [device(total=80 * GIB, used=8 * GIB)],
                      procs=[(0, "self", 3 * GIB)])
    high = config(tmp_path / "high.cfg", [device(total=80 * GIB, used=60 * GIB)],
                  procs=[(0, "self", 3 * GIB)])
    d = last_json(venv.run(f"""
import json, os, time
from outofcuda import MemoryMonitor
calls = []
m = MemoryMonitor(threshold=0.5, interval=0.01, cooldown=0, on_high=calls.append).start()
def wait(what, cond, limit=30):
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {{what}}: {{m.reason}} {{m.samples()[-3:]}}")
        time.sleep(0.01)
wait("two samples", lambda: len(m.samples()) >= 2)
early = m.events
os.replace({str(high)!r}, {str(cfg_path)!r})
wait("a 'high' event", lambda: m.events)
m.stop()
s = m.samples()
print(json.dumps({{"early": early, "events": m.events, "calls": len(calls), "reason": m.reason,
                  "first": s[0], "last": s[-1]}}))
""", env=nvml(cfg_path), cwd=workdir, timeout=90))
    assert d["reason"] is None
    assert d["early"] == []
    first, last = d["first"], d["last"]
    assert first[1] == 8 * GIB and first[2] == 80 * GIB and first[3] == 3 * GIB
    assert last[1] == 60 * GIB
    e = d["events"][0]
    assert e["kind"] == "high" and e["fraction"] == 0.75 and e["used"] == 60 * GIB
    assert d["calls"] >= 1


# ---- the OOM report from NVML's figures ----

def test_oom_report_totals_and_other_processes(venv, workdir, tmp_path, nvml):
    """The report built from recorded figures (the observer's call, as torch
    makes it) takes the device total and the other processes from NVML; 32-byte
    entries (early R535) are read right."""
    cfg = config(tmp_path / "nvml.cfg", [device(total=80 * GIB, used=79 * GIB)], stride=32,
                 procs=[(0, "self", 40 * GIB), (0, "parent", 30 * GIB), (0, 4000001, 9 * GIB)])
    d = last_json(venv.run("""
import json, os, outofcuda, _outofcuda as core
gib = 1024 ** 3
core._oom_observer(0, 2 * gib, 80 * gib, gib // 2)
rep = outofcuda.last_oom()
print(json.dumps({"rep": {k: rep[k] for k in ("total_bytes", "device_name", "other_processes",
                                               "advice")},
                  "text": outofcuda.oom.format_report(rep), "ppid": os.getppid(),
                  "pcomm": open(f"/proc/{os.getppid()}/comm").read().strip()}))
""", env=nvml(cfg), cwd=workdir))
    rep = d["rep"]
    assert rep["total_bytes"] == 80 * GIB and rep["device_name"] == "NVIDIA A100-SXM4-80GB"
    assert rep["other_processes"] == [
        {"pid": d["ppid"], "name": d["pcomm"], "used_bytes": 30 * GIB},
        {"pid": 4000001, "name": "", "used_bytes": 9 * GIB}]
    assert rep["advice"][0].startswith(f"Another process holds 30.00 GiB on this GPU: pid "
                                       f"{d['ppid']}")
    assert "  device             80.00 GiB total" in d["text"]
    assert f"pid {d['ppid']} ({d['pcomm']}) 30.00 GiB, pid 4000001 (?) 9.00 GiB" in d["text"]


# ---- no leak on the NVML paths ----

def test_nvml_paths_do_not_leak(venv, workdir, tmp_path, nvml):
    """3000 calls each with two GPUs and 100 processes (the list is read twice
    per call: the first buffer is too small): gc objects, pymalloc blocks and
    RSS stay flat, so neither the Python objects nor the C buffers leak."""
    procs = [(0, "self", GIB), (0, 4000001, GIB)] + [(i % 2, 200000 + i, MIB) for i in range(98)]
    cfg = config(tmp_path / "nvml.cfg", MIXED, procs=procs, stride=32)
    d = venv.json(CHILD + """
import gc, json, _outofcuda, outofcuda
cases = {"memory_report": outofcuda.memory_report, "nvml_devices": _outofcuda.nvml_devices,
         "nvml_processes": lambda: _outofcuda.nvml_processes(0),
         "autocast_dtype": lambda: _outofcuda._api_autocast_dtype("cuda")}
out = {}
for name, fn in cases.items():
    for _ in range(300):
        fn()
    gc.collect()
    o0, b0, r0 = len(gc.get_objects()), sys.getallocatedblocks(), rss()
    for _ in range(3000):
        fn()
    gc.collect()
    out[name] = [len(gc.get_objects()) - o0, sys.getallocatedblocks() - b0, rss() - r0]
out["sample"] = len(outofcuda.memory_report()["cuda:0"]["processes"])
print(json.dumps(out))
""", env=nvml(cfg), cwd=workdir, timeout=300)
    assert d.pop("sample") == 51
    for name, (objects, blocks, rss) in d.items():
        assert objects <= 20 and blocks <= 200 and rss <= 1 << 20, (name, objects, blocks, rss)


# ---- every NVML error path ----

ERRORS = """
import json, _outofcuda, outofcuda
print(json.dumps({"devices": _outofcuda.nvml_devices(), "report": outofcuda.memory_report(),
                  "dtype": _outofcuda._api_autocast_dtype("cuda"),
                  "procs": _outofcuda.nvml_processes(0), "index": _outofcuda.nvml_index(0)}))
"""


def test_library_missing(venv, workdir):
    d = last_json(venv.run(ERRORS, cwd=workdir))
    assert d["devices"][0] == [] and "NVIDIA driver library not found" in d["devices"][1]
    assert d["report"] == {} and d["procs"] == [] and d["index"] is None
    # As the start-up hook decides (bridge.c): no guess, torch's own default.
    assert d["dtype"][0] is None
    assert d["dtype"][1].startswith("compute capability unknown: NVIDIA driver library not found")


def test_unknown_capability_is_one_verdict_for_the_hook_and_the_api(cuda_venv, workdir):
    """The CUDA build of torch without NVML: the start-up hook skips the
    autocast dtype, and autocast_context()'s choice says the same, not float16."""
    d = last_json(cuda_venv.run("""
import json, torch, _outofcuda
print(json.dumps([_outofcuda.status()["optimizations"]["amp_dtype"],
                  _outofcuda._api_autocast_dtype("cuda")]))
""", cwd=workdir))
    hook, (dtype, reason) = d
    assert hook["applied"] is False and hook["code"] == "dtype_unknown"
    assert hook["capability"] is None and hook["notes"] == []
    assert dtype is None and reason.startswith("compute capability unknown: ")


@pytest.mark.parametrize("variant,errors,why", [
    ("full", [("nvmlInit_v2", 999)], "NVML failed to initialise"),
    ("legacy", [("nvmlInit", 9)], "NVML failed to initialise"),
    ("no_memory", [], "NVML is missing a required function"),
])
def test_nvml_unusable(venv, workdir, tmp_path, nvml, variant, errors, why):
    cfg = config(tmp_path / "nvml.cfg", [device()], procs=[(0, 4242, GIB)], errors=errors)
    d = last_json(venv.run(ERRORS, env=nvml(cfg, variant), cwd=workdir))
    assert d["devices"][0] == [] and d["devices"][1].startswith(why)
    assert d["report"] == {} and d["procs"] == [] and d["index"] is None
    assert d["dtype"][0] is None and "unknown" in d["dtype"][1]
    r = venv.run(None, args=("-m", "outofcuda", "status"), env=nvml(cfg, variant), cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert f"GPUs            none ({why}" in r.stdout, r.stdout


def test_device_count_fails(venv, workdir, tmp_path, nvml):
    cfg = config(tmp_path / "nvml.cfg", [device()], errors=[("nvmlDeviceGetCount_v2", 999)])
    d = last_json(venv.run(ERRORS, env=nvml(cfg), cwd=workdir))
    assert d["devices"] == [[], None]
    assert d["report"] == {} and d["index"] is None
    assert d["dtype"][0] is None and "unknown" in d["dtype"][1]


@pytest.mark.parametrize("function", [
    "nvmlDeviceGetHandleByIndex_v2@1", "nvmlDeviceGetName@1", "nvmlDeviceGetUUID@1",
    "nvmlDeviceGetMemoryInfo@1", "nvmlDeviceGetCudaComputeCapability@1",
    "nvmlDeviceGetComputeRunningProcesses@1", "nvmlSystemGetDriverVersion",
])
def test_one_call_fails(venv, workdir, tmp_path, nvml, function):
    """One NVML call fails (on device 1, or everywhere for the global ones):
    the rest still answers, and nothing is made up for what failed."""
    errors = [(function, 999)]
    if function == "nvmlDeviceGetComputeRunningProcesses@1":   # every entry point
        errors = [(f"nvmlDeviceGetComputeRunningProcesses{s}@1", 999) for s in ("_v3", "_v2", "")]
    cfg = config(tmp_path / "nvml.cfg", MIXED, procs=[(0, 4242, GIB), (1, 4343, GIB)],
                 errors=errors)
    code = ERRORS + """
import os
os.environ["CUDA_VISIBLE_DEVICES"] = "GPU-9f8e"   # GPU 1's UUID prefix
uuid_prefix = _outofcuda.nvml_index(0)
print(json.dumps({"uuid_prefix": uuid_prefix, "procs1": _outofcuda.nvml_processes(1)}))
"""
    r = venv.run(code, env=nvml(cfg), cwd=workdir)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.splitlines()[0])
    extra = json.loads(r.stdout.splitlines()[1])
    devices, why = d["devices"]
    assert why is None and devices[0]["name"] == "NVIDIA A100-SXM4-80GB"
    rep = d["report"]
    assert rep["cuda:0"]["processes"][0]["pid"] == 4242
    name = function.split("@")[0]
    if name == "nvmlDeviceGetHandleByIndex_v2":
        assert [g["index"] for g in devices] == [0]
        assert list(rep) == ["cuda:0"] and extra["procs1"] == []
    elif name == "nvmlDeviceGetName":
        assert devices[1]["name"] == "" and rep["cuda:1"]["total_gb"] == 16.0
    elif name == "nvmlDeviceGetUUID":
        assert devices[1]["uuid"] == ""
    elif name == "nvmlDeviceGetMemoryInfo":
        assert devices[1]["total"] == 0 and rep["cuda:1"]["total_gb"] == 0.0
        assert extra["procs1"] == [[4343, GIB]]
    elif name == "nvmlDeviceGetCudaComputeCapability":
        assert devices[1]["compute_capability"] == [-1, -1]
    elif name == "nvmlDeviceGetComputeRunningProcesses":
        assert extra["procs1"] == [] and rep["cuda:1"]["processes"] is None
    elif name == "nvmlSystemGetDriverVersion":
        assert devices[0]["driver"] == "" and devices[1]["driver"] == ""
    # GPU 1 found by its UUID prefix unless its UUID (or GPU 1 itself) is unreadable.
    unreadable = name in ("nvmlDeviceGetUUID", "nvmlDeviceGetHandleByIndex_v2")
    assert extra["uuid_prefix"] == (None if unreadable else 1)
    if name in ("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetCudaComputeCapability"):
        # One device unreadable: its capability is unknown, so torch's default.
        assert d["dtype"] == [None, "compute capability unknown: no visible GPU reported a "
                                    "compute capability"]
    else:
        assert d["dtype"] == ["float16", "compute capability 7.0 < 8.0 (from NVML)"]


@pytest.mark.parametrize("function", ["nvmlDeviceGetHandleByUUID",
                                      "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
                                      "nvmlDeviceGetIndex"])
def test_mig_lookup_fails_stops_the_list(venv, workdir, tmp_path, nvml, function):
    cfg = config(tmp_path / "nvml.cfg", MIXED, migs=[(MIG1, 1)], errors=[(function, 999)])
    decision, index = last_json(venv.run(DECIDE, env=nvml(cfg, CUDA_VISIBLE_DEVICES=f"0,{MIG1}"),
                                         cwd=workdir))
    assert index == [0, None, None] and decision[0] == "bfloat16"


def test_optional_symbol_missing(venv, workdir, tmp_path, nvml):
    """A driver without nvmlDeviceGetCudaComputeCapability: devices are listed,
    the capability is unknown, and autocast keeps torch's default."""
    cfg = config(tmp_path / "nvml.cfg", [device(cc="9.0")])
    d = last_json(venv.run(ERRORS, env=nvml(cfg, "no_cc"), cwd=workdir))
    assert d["devices"][0][0]["compute_capability"] == [-1, -1]
    assert d["report"]["cuda:0"]["total_gb"] == 80.0
    assert d["dtype"] == [None, "compute capability unknown: no visible GPU reported a "
                                "compute capability"]


# ---- the GPU checks cannot pass without a GPU ----

ROOT = Path(__file__).resolve().parent.parent
HAS_GPU = os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia/gpus")


def _pytest_gpu(tmp_path, env_extra, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTOFCUDA_", "PYTEST_"))}
    # The inner run's own folder (pytest-of-*) goes with this test's.
    env.update(env_extra, TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-p", "no:xdist", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(HAS_GPU, reason="this machine has an NVIDIA GPU: the no-GPU paths do not run")
def test_gpu_tests_fail_instead_of_skipping_when_a_gpu_is_required(tmp_path):
    files = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests" / "gpu").glob("test_*.py"))]
    r = _pytest_gpu(tmp_path, {}, *files)
    assert r.returncode == 0, r.stdout[-3000:]
    assert " skipped" in r.stdout.splitlines()[-1] and "passed" not in r.stdout.splitlines()[-1]
    # As benchmarks/gpu_check.sh runs them: nothing skips, everything errors.
    r = _pytest_gpu(tmp_path, {"OUTOFCUDA_TEST_REQUIRE_GPU": "1"},
                    "--continue-on-collection-errors", *files)
    assert r.returncode == 1, r.stdout[-3000:]
    last = r.stdout.splitlines()[-1]
    assert "skipped" not in last and "passed" not in last and " errors" in last, last
    assert "OUTOFCUDA_TEST_REQUIRE_GPU=1 but no NVIDIA GPU on this machine" in r.stdout
