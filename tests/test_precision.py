"""TF32 and torch's two float32-precision APIs (2.9+: the legacy allow_tf32 /
set_float32_matmul_precision, and fp32_precision). outofcuda writes matmul
TF32 only when CUDA starts, and only where the program chose no precision by
then; a program that chose ends exactly as without outofcuda, and no getter
raises that would not raise without it. On the real CUDA build of 2.14.1 (no
GPU: CUDA's start is outofcuda's queued callback, run by hand with stand-ins
for the device calls) and on the stand-ins of other releases."""
import json

import pytest

from fake_torch import RELEASES, make_fake_torch

# What torch runs at CUDA initialisation: outofcuda's queued callback, with
# stand-ins for the device calls.
CUDA_START = """
C._cuda_getDeviceCount = lambda: 1
C._cuda_getDevice = lambda: 0
C._cuda_setMemoryFraction = lambda fraction, device: None
C._cuda_attach_out_of_memory_observer = lambda fn: None
for fn, _stack in list(torch.cuda._queued_calls):
    if getattr(fn, "__name__", "") == "outofcuda_at_cuda_init":
        fn()
"""

# Runs `{action}` (the program's choice, before CUDA starts), then what torch
# runs at CUDA initialisation, reading torch's getters at each stage.
PROGRAM = """
import json, torch
C = torch._C
def read():
    out = {{}}
    for name, get in (("allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
                      ("fp32_precision", lambda: torch.backends.cuda.matmul.fp32_precision),
                      ("fmp", torch.get_float32_matmul_precision),
                      ("cudnn_allow_tf32", lambda: torch.backends.cudnn.allow_tf32)):
        try:
            out[name] = get()
        except RuntimeError as e:
            assert "mix of the legacy and new APIs" in str(e), e
            out[name] = "raises"
    return out
stages = [read()]
{action}
stages.append(read())
""" + CUDA_START + """stages.append(read())
{after}
stages.append(read())
st = None
try:
    import _outofcuda
    st = _outofcuda.status()["optimizations"]["tf32"]
except ImportError:
    pass
print("P=" + json.dumps([stages, st]))
"""

ACTIONS = [
    "pass",
    "torch.backends.cuda.matmul.allow_tf32 = False",
    "torch.backends.cuda.matmul.allow_tf32 = True",
    "torch.backends.cuda.matmul.fp32_precision = 'ieee'",
    "torch.backends.cuda.matmul.fp32_precision = 'tf32'",
    "torch.backends.fp32_precision = 'ieee'",
    "torch.backends.fp32_precision = 'tf32'",
    "torch.backends.cudnn.fp32_precision = 'ieee'",
    "torch.set_float32_matmul_precision('highest')",
    "torch.set_float32_matmul_precision('high')",
    "torch.set_float32_matmul_precision('medium')",
]


def run_program(venv, action, env=None, after="pass"):
    r = venv.run(PROGRAM.format(action=action, after=after), env=env, args=("-W", "error"))
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stderr == "", r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("P=")][-1]
    return json.loads(line[2:])


TF32_ON = {"allow_tf32": True, "fp32_precision": "tf32", "fmp": "high", "cudnn_allow_tf32": True}


@pytest.mark.parametrize("action", ACTIONS)
def test_a_program_that_chose_ends_as_without_outofcuda(cuda_venv, action):
    (with_oc, st), (without, _) = (run_program(cuda_venv, action),
                                   run_program(cuda_venv, action, {"OUTOFCUDA_DISABLE": "1"}))
    # Nothing is written at import: the program starts from torch's own state.
    assert with_oc[0] == without[0]
    assert "raises" not in with_oc[0].values()
    assert with_oc[1] == without[1]
    if action == "pass":
        # The program chose nothing: TF32 on once CUDA starts, every getter agreeing.
        assert with_oc[2] == TF32_ON, with_oc
        assert st["applied"] and st["now"] == {"matmul": True} and st["changed"] is False
        assert st["code"] == "at_cuda_init" and st["value"] == {"matmul": True}
    else:
        assert with_oc[2] == without[2], (with_oc, without)
        assert not st["applied"] and (st["state"], st["code"]) == ("skipped", "program_chose"), st


# torch.compile before CUDA starts: dynamo guards global state, allow_tf32
# among it, so TF32 set at CUDA's start recompiles a graph compiled before
# (docs/what-it-changes.md, "TF32 and torch.compile"). The CPU backend of the
# CUDA build; the device stand-ins are put back after the callback, so that
# dynamo (which saves CUDA's RNG state where CUDA looks available) finds no
# device afterwards.
COMPILED_FIRST = """
import json, torch
from torch._dynamo.utils import counters
C = torch._C
{choice}
g = torch.compile(lambda x: x @ x + 1, backend="eager")
x = torch.randn(4, 4)
g(x)
before = counters["stats"]["unique_graphs"]
saved = C._cuda_getDeviceCount, C._cuda_getDevice
""" + CUDA_START + """C._cuda_getDeviceCount, C._cuda_getDevice = saved
g(x)
print(json.dumps([before, counters["stats"]["unique_graphs"]]))
"""


@pytest.mark.parametrize("choice,env,graphs", [
    ("", {}, 2),                                              # TF32 at CUDA's start: once more
    ("", {"OUTOFCUDA_TF32": "0"}, 1),                         # the way out
    ("torch.set_float32_matmul_precision('high')", {}, 1),    # a precision chosen first
    ("torch.backends.fp32_precision = 'ieee'", {}, 1),
    ("", {"OUTOFCUDA_DISABLE": "1"}, 1),                      # as without outofcuda
])
def test_a_graph_compiled_before_cuda_starts_recompiles_once_unless_precision_was_chosen(
        cuda_venv, choice, env, graphs):
    before, after = cuda_venv.json(COMPILED_FIRST.format(choice=choice), env=env,
                                   args=("-W", "error"))
    assert (before, after) == (1, graphs)


# The program turns TF32 off after CUDA started, in each of torch's four ways.
TURN_OFF = [
    "torch.backends.cuda.matmul.allow_tf32 = False",
    "torch.set_float32_matmul_precision('highest')",
    "torch.backends.cuda.matmul.fp32_precision = 'ieee'",
    "torch.backends.fp32_precision = 'ieee'",
]


@pytest.mark.parametrize("after", TURN_OFF)
def test_status_tells_what_is_in_effect_when_it_is_called(cuda_venv, after):
    stages, st = run_program(cuda_venv, "pass", after=after)
    assert stages[2] == TF32_ON
    if after == "torch.backends.fp32_precision = 'ieee'":
        # torch keeps a matmul-specific setting over the global switch: the
        # legacy write of CUDA's start still rules, and status() says so.
        assert stages[3]["fp32_precision"] == "tf32"
        assert st["now"] == {"matmul": True} and st["changed"] is False
    else:
        assert stages[3]["fp32_precision"] == "ieee"
        assert st["now"] == {"matmul": False} and st["changed"] is True


FLAGS_NOW = """
import json, torch, _outofcuda
torch.backends.cudnn.benchmark = False
torch.backends.cuda.enable_flash_sdp(False)
opts = _outofcuda.status()["optimizations"]
print("S=" + json.dumps({k: opts[k] for k in ("cudnn_benchmark", "sdpa", "allocator")}))
print("A=" + json.dumps(torch._C._accelerator_getAllocatorSettings()))
"""


def test_status_reads_flags_and_the_allocator_from_torch(cuda_venv):
    r = cuda_venv.check(FLAGS_NOW, args=("-W", "error"))
    assert r.stderr == ""
    out = {ln[:1]: json.loads(ln[2:]) for ln in r.stdout.splitlines() if ln[1:2] == "="}
    s = out["S"]
    assert s["cudnn_benchmark"]["value"] is True and s["cudnn_benchmark"]["now"] is False
    assert s["cudnn_benchmark"]["changed"] is True
    # outofcuda wrote no SDPA flag (torch's default): nothing of its own changed.
    assert s["sdpa"]["now"] == {"flash": False, "mem_efficient": True, "math": True}
    assert s["sdpa"]["changed"] is None
    assert s["allocator"]["now"] == out["A"] == s["allocator"]["value"]
    assert s["allocator"]["changed"] is False


# ---- the stand-ins of other releases ----

STAND_IN = """
import json, torch
C = torch._C
{action}
mark = len(C.calls)
torch.cuda._fake_cuda_init()
import _outofcuda
print("R=" + json.dumps([[list(map(str, c)) for c in C.calls[mark:]],
                         _outofcuda.status()["optimizations"]["tf32"]]))
"""

NEW_API = [r for r in sorted(RELEASES) if "_get_fp32_precision_getter" in RELEASES[r]["c"]]
OLD_API = [r for r in sorted(RELEASES) if r not in NEW_API]


def run_stand_in(venv, tmp_path, release, action):
    root = make_fake_torch(tmp_path / "fake", release)
    r = venv.run(STAND_IN.format(action=action), env={"PYTHONPATH": str(root)},
                 args=("-W", "error"), cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return json.loads(r.stdout.split("R=")[-1])


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_stand_in_no_choice_gets_tf32_at_cuda_start(venv, tmp_path, release):
    calls, st = run_stand_in(venv, tmp_path, release, "pass")
    assert ["_set_cublas_allow_tf32", "True"] in calls
    assert st["applied"] and st["now"] == {"matmul": True}


@pytest.mark.parametrize("release", NEW_API)
@pytest.mark.parametrize("action", [
    "C._set_fp32_precision_setter('cuda', 'matmul', 'ieee')",
    "C._set_fp32_precision_setter('generic', 'all', 'ieee')",
    "C._set_fp32_precision_setter('cuda', 'all', 'tf32')",
    "C._set_cublas_allow_tf32(False)",
])
def test_stand_in_new_api_release_keeps_the_programs_choice(venv, tmp_path, release, action):
    calls, st = run_stand_in(venv, tmp_path, release, action)
    assert not [c for c in calls if c[0].startswith("_set_")], calls
    assert not st["applied"] and (st["state"], st["code"]) == ("skipped", "program_chose"), st


@pytest.mark.parametrize("release", OLD_API)
@pytest.mark.parametrize("action", ["C._set_cublas_allow_tf32(True)",
                                    "C._set_float32_matmul_precision('medium')"])
def test_stand_in_old_release_keeps_a_visible_choice(venv, tmp_path, release, action):
    calls, st = run_stand_in(venv, tmp_path, release, action)
    assert not [c for c in calls if c[0].startswith("_set_")], calls
    assert not st["applied"] and (st["state"], st["code"]) == ("skipped", "program_chose"), st
