"""Known bugs of the installed stack (src/kbtable.c, src/knownbugs.c): the table in
pure C (no Python), the guard on the stand-in releases (tests/fake_torch.py)
with the stand-in NVML (tests/stub_nvml) at compute capabilities 8.0, 9.0 and
10.0 and cuDNN on both sides of the fix, OUTOFCUDA_KNOWN_BUGS=0, and the real
CUDA build of torch 2.14.1 (no GPU). Each scenario is a fresh interpreter."""
import json
import platform
import random
from functools import partial
from pathlib import Path

import pytest

from conftest import pure_c_driver, stub_nvml_config as config, stub_nvml_device as device
from fake_torch import make_fake_torch
from kit import last_json, oc_h_table

ROOT = Path(__file__).resolve().parent.parent
BUG = "cudnn-sdpa-nan-grad-sm90"


@pytest.fixture
def nvml(stub_nvml, tmp_path):
    """env(cc, **more): the stand-in NVML showing one GPU of that capability."""
    def env(cc, **more):
        cfg = config(tmp_path / f"nvml-{cc}.cfg", [device(cc=cc)])
        return {"LD_LIBRARY_PATH": str(stub_nvml), "STUB_NVML_CONFIG": str(cfg), **more}
    return env


# Every scenario here must also run silently (stderr empty).
last_json = partial(last_json, quiet=True)


# ---- the table in pure C ----

@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    build = pure_c_driver(tmp_path_factory.mktemp("kb"), "known_bugs/driver.c", "kbtable.c")

    def run(cases):
        """cases: facts tuples (case()); returns {row id: [(code, decision, why)]}."""
        out = {}
        for ln in build([("facts",) + c for c in cases]).splitlines():
            i, d, code, why = ln.split(" ", 3)
            out.setdefault(i, []).append((KB_CODES[int(code)], int(d), why))
        return out
    run.raw = build
    return run


# Each row as its source states it (docs/known-bugs.md), decided here
# independently of the C code: torch, torch's CUDA, cuDNN and compute
# capability ranges (lo <= v < hi; None: any), the variable with which torch
# avoids it itself, and the extra fact the row needs.
ROWS = {
    BUG: dict(torch=(21100, 21500), cudnn=(91501, 92600), cc=(90, 100),
              unless="TORCH_CUDNN_SDPA_DEPRIORITIZED"),
    "alloc-conf-generic-ignored": dict(torch=(20900, 21100), needs="alloc"),
    "torchrun-gpu0-context": dict(needs="ctx"),
    "cudnn-sublibrary-mismatch": dict(cuda=(1300, 1400), cudnn=(92000, 92300), needs="other"),
    "fsdp2-bf16-premul-sum": dict(torch=(20500, None)),
    "avg-pool2d-channels-last-grad": dict(),
    "tf32-mixed-api": dict(torch=(20900, None)),
    "cudnn-sdpa-nan-dkdv-sq1": dict(torch=(21100, None), cudnn=(92501, 92700), cc=(90, 100),
                                    unless="TORCH_CUDNN_SDPA_DEPRIORITIZED"),
    "cudnn-sdpa-gqa-sm100": dict(torch=(21100, None), cc=(100, 101),
                                 unless="TORCH_CUDNN_SDPA_DEPRIORITIZED"),
    "cudnn-sdpa-ima-cuda-below-12.9": dict(torch=(20900, 21000), cuda=(1200, 1209), cc=(90, 101)),
    "nccl-aarch64-hang": dict(nccl=(0, 22903), needs="aarch64"),
    "cudnn-pre-turing": dict(cudnn=(91100, None), cc=(30, 75)),
    "conv3d-half-cudnn": dict(cudnn=(91002, 91500)),
    "cudnn-fp8-sdpa-zeros": dict(cudnn=(92400, 92500), cc=(100, 110)),
    "compile-vram-2.10": dict(torch=(21000, 21200)),
    "expandable-ipc-2.13": dict(torch=(21300, None)),
}


def inside(r, v):
    return v >= r[0] and (r[1] is None or v < r[1])


def expected(row, torch, cuda_build, cuda, cudnn, local_rank, foreign, ccs, env,
             stack=(-1, 0, -1)):
    """The row's code for these facts (its verdict: VERDICT[code])."""
    spec, (nccl, aarch64, other) = ROWS[row], stack
    if torch > 0 and "torch" in spec and not inside(spec["torch"], torch):
        return "out_of_range"
    if cuda_build == 0:
        return "no_cuda"
    if "cuda" in spec and cuda > 0 and not inside(spec["cuda"], cuda):
        return "out_of_range"
    if "unless" in spec and env.get(spec["unless"]) == "1":
        return "torch_avoids"
    if spec.get("needs") == "alloc" and ("PYTORCH_CUDA_ALLOC_CONF" in env
                                         or "PYTORCH_ALLOC_CONF" not in env):
        return "condition_unmet"
    if spec.get("needs") == "ctx" and (local_rank <= 0 or foreign == -1):
        return "condition_unmet"
    if "cc" in spec and ccs is not None and not any(inside(spec["cc"], c) for c in ccs):
        return "out_of_range"
    if "cudnn" in spec and cudnn == 0:
        return "no_cudnn"
    if "cudnn" in spec and cudnn > 0 and not inside(spec["cudnn"], cudnn):
        return "out_of_range"
    if "nccl" in spec and nccl >= 0 and not inside(spec["nccl"], nccl):
        return "out_of_range"
    if (spec.get("needs") == "aarch64" and not aarch64) or (spec.get("needs") == "other"
                                                            and other == 0):
        return "condition_unmet"
    if (torch <= 0 or cuda_build < 0 or ("cuda" in spec and cuda <= 0)
            or (spec.get("needs") == "ctx" and foreign < -1)
            or ("cc" in spec and ccs is None) or ("cudnn" in spec and cudnn < 0)
            or ("nccl" in spec and nccl < 0) or (spec.get("needs") == "other" and other < 0)):
        return "needs_fact"
    return "applies"


KB_CODES = oc_h_table("OC_KB_CODES")  # the driver prints a code's number
VERDICT = {"applies": 1, "needs_fact": -1, "out_of_range": 0, "no_cuda": 0, "no_cudnn": 0,
           "torch_avoids": 0, "condition_unmet": 0}


def case(torch, cuda_build, cuda, cudnn, local_rank, foreign, ccs, env, stack=(-1, 0, -1)):
    env_text = ";".join(f"{k}={v}" for k, v in env.items()) or "-"
    return (torch, cuda_build, cuda, cudnn, *stack, local_rank, foreign,
            -1 if ccs is None else len(ccs), *(ccs or ()), env_text)


def edges(lo_hi):
    lo, hi = lo_hi
    return [v for v in (lo - 1, lo, hi - 1 if hi else None, hi) if v is not None and v > 0]


# Every range's edges (just outside, first inside, last inside, first outside),
# crossed, row by row, with the cases of the facts that row reads; the facts it
# does not read take a few values (every row is decided on every case).
ENVS = [{}, {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}, {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "true"},
        {"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
        {"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}]
RANKS = ((-1, -2), (0, -2), (1, -2), (1, -1), (2, 0))
# NCCL's version, aarch64, another cuDNN on the loader path.
STACKS = ((-1, 0, -1), (0, 1, 0), (22902, 1, 1), (22903, 1, 1), (22809, 0, -1), (22809, 1, -1))


def row_grid(spec):
    def pick(key, extra, default):
        return sorted(extra | set(edges(spec[key]))) if key in spec else default
    ccs_all = [None, [], [80, 90]] + ([[v] for v in edges(spec["cc"])] if "cc" in spec else [[90]])
    envs = ENVS if "unless" in spec or spec.get("needs") == "alloc" else ENVS[:2]
    ranks = RANKS if spec.get("needs") == "ctx" else RANKS[::3]
    stacks = STACKS if "nccl" in spec or spec.get("needs") in ("aarch64", "other") else STACKS[:2]
    return [(t, cb, cu, cd, lr, fd, ccs, env, st)
            for t in pick("torch", {0, 20000}, [0, 21300]) for cb in (-1, 0, 1)
            for cu in pick("cuda", {0, 1201}, [0, 1300]) for cd in pick("cudnn", {-1, 0}, [-1, 92000])
            for lr, fd in ranks for ccs in ccs_all for env in envs for st in stacks
            if cb == 1 or (cu == 0 and lr == -1 and ccs in (None, [90]))]


GRID = [g for spec in ROWS.values() for g in row_grid(spec)]


def test_every_row_matches_its_source_on_every_edge(driver):
    out = driver([case(*g) for g in GRID])
    assert sorted(out) == sorted(ROWS), "the table's rows are the documented ones"
    for row, decisions in out.items():
        assert len(decisions) == len(GRID)
        for g, (code, d, why) in zip(GRID, decisions):
            assert (code, d) == (expected(row, *g), VERDICT[code]), (row, g, code, why)
            assert why and not why.startswith(("affected", "not affected", "undecided")), why


def test_table_fuzz_stays_within_bounds(driver):
    """Random facts, far-out values and device lists longer than the table
    reads (the driver runs under ASan/UBSan): decisions still follow the rules."""
    rnd = random.Random(30)
    facts = []
    for _ in range(2500):
        ccs = None if rnd.random() < 0.1 else [rnd.choice([-5, 0, 74, 75, 80, 90, 93, 99, 100, 10**6])
                                                for _ in range(rnd.choice([0, 1, 3, 70]))]
        env = rnd.choice(ENVS + [{"TORCH_CUDNN_SDPA_DEPRIORITIZED": "x" * 200}])
        facts.append((rnd.choice([-1, 0, 1, 20000, 20900, 21100, 21450, 21500, 2**40]),
                      rnd.choice([-1, 0, 1]), rnd.choice([-1, 0, 1300, 1399, 1400, 2**40]),
                      rnd.choice([-2, -1, 0, 91002, 91501, 92000, 92400, 92600, 92699, 2**40]),
                      rnd.choice([-1, 0, 1, 7, 2**40]), rnd.choice([-2, -1, 0, 5]), ccs, env,
                      (rnd.choice([-1, 0, 22809, 22903, 2**40]), rnd.choice([0, 1]),
                       rnd.choice([-1, 0, 1]))))
    out = driver([case(*g) for g in facts])
    for row, decisions in out.items():
        for g, (code, d, why) in zip(facts, decisions):
            t, cb, cu, cd, lr, fd, ccs, env, st = g
            assert code == expected(row, t, cb, cu, cd, lr, fd,
                                    None if ccs is None else ccs[:64], env, st), (row, g, why)
            assert d == VERDICT[code], (row, g, why)


@pytest.mark.parametrize("value,rc,rows,unknown", [
    ("tf32-mixed-api", 0, ["tf32-mixed-api"], ""),
    (" cudnn-sdpa-nan-grad-sm90 ,\ttorchrun-gpu0-context", 0,
     [BUG, "torchrun-gpu0-context"], ""),
    ("tf32-mixed-api,tf32-mixed-api", 0, ["tf32-mixed-api"], ""),
    # an entry that names no row is counted and handed back; the others still count
    ("tf32-mixed", 1, [], "tf32-mixed"), ("tf32-mixed-api,", 1, ["tf32-mixed-api"], ""),
    (",tf32-mixed-api", 1, ["tf32-mixed-api"], ""),
    ("tf32-mixed-api,cudnn-sdpa-nan-grad, x ", 2, ["tf32-mixed-api"], "cudnn-sdpa-nan-grad,x"),
    ("", 1, [], ""), (" ", 1, [], ""), ("TF32-MIXED-API", 1, [], "TF32-MIXED-API"),
    ("1", 1, [], "1"), ("x" * 3000, 1, [], "x" * 63)])
def test_the_off_list_names_rows_exactly(driver, value, rc, rows, unknown):
    ids = [ln.split()[0] for ln in driver.raw([("rows",)]).splitlines()]
    got_rc, bits, got_unknown = (driver.raw([("off", value)])[:-1].split(" ", 2) + [""])[:3]
    assert (int(got_rc), got_unknown) == (rc, unknown)
    assert int(bits) == sum(1 << ids.index(r) for r in rows)


@pytest.mark.parametrize("rank,visible,ctx,device", [
    (1, 4, [0], 0), (1, 4, [1], -1), (1, 4, [1, 0], 0), (3, 4, [3, 2], 2), (0, 4, [1], -1),
    (-1, 4, [0], -1), (1, 1, [0], -1), (4, 4, [0], -1), (1, 4, [], -1), (1, 4, [7], -1)])
def test_which_device_is_another_ranks(driver, rank, visible, ctx, device):
    """Only a rank above 0 that names one of several visible devices can be on
    the wrong one."""
    line = ("foreign", rank, visible, len(ctx), *ctx)
    assert int(driver.raw([line]).strip()) == device


# ---- the guard on the stand-in releases, stand-in NVML ----
# Why the guard is one flag written when CUDA starts: _set_sdp_use_cudnn is a
# field of torch's global context read at every dispatch, so it takes effect
# whenever set and initialises nothing. _set_sdp_priority_order would not last
# (priority_order() in sdp_utils.cpp writes cuDNN first once, at the first SDPA
# dispatch on sm90/sm100); TORCH_CUDNN_SDPA_DEPRIORITIZED is read once, cannot
# be undone and would reach every child process. Deciding needs the cuDNN
# version, read through torch._C._cudnn.getVersionInt() (cudnn.version() asks
# every device's capability, which initialises CUDA). 2.11 puts cuDNN first on
# sm90/sm100 above cuDNN 9.15.0 (check_prefer_cudnn_attention); the fix is in
# cuDNN 9.26 (cudnn-frontend PR 628); 2.15 bundles it and guards older cuDNN
# itself (pytorch PR 196861). The failing kernel is sm90's; sm100 is not reported.

GUARD = """
import json, sys, torch, _outofcuda
def entry():
    (e,) = [b for b in _outofcuda.status()["known_bugs"] if b["id"] == "%s"]
    return e
at_import = entry()
calls_at_import = [c[0] for c in torch._C.calls]
enabled_at_import = torch._C._get_cudnn_sdp_enabled()
torch.cuda._fake_cuda_init()
print(json.dumps({"import": at_import, "cuda": entry(),
                  "calls_at_import": calls_at_import,
                  "cudnn_calls": [list(c) for c in torch._C.calls
                                  if c[0] in ("cudnn.version", "_set_sdp_use_cudnn")],
                  "enabled_at_import": enabled_at_import,
                  "enabled": torch._C._get_cudnn_sdp_enabled(),
                  "error": _outofcuda.status()["hook"]["error"]}))
""" % BUG


def guard(venv, tmp_path, env, release="2.14.1", cudnn=None, row=BUG, **fake):
    root = make_fake_torch(tmp_path / f"fake-{release}-{cudnn}-{len(fake)}", release, cudnn=cudnn,
                           **fake)
    return last_json(venv.run(GUARD.replace(BUG, row), env=dict(env, PYTHONPATH=str(root)),
                              cwd=tmp_path, args=("-W", "error")))


@pytest.mark.parametrize("release,cudnn", [("2.14.1", None), ("2.11.0", 91900),
                                           ("2.11.0", 92500)])
def test_sm90_with_cudnn_before_the_fix_turns_cudnn_attention_off(venv, tmp_path, nvml,
                                                                  release, cudnn):
    d = guard(venv, tmp_path, nvml("9.0"), release, cudnn)
    # At import: decided as far as it can be without loading cuDNN.
    assert d["import"]["applies"] is None and d["import"]["done"] is False
    assert d["import"]["code"] == "needs_fact" and d["import"]["verdict"] == "undecided"
    assert "cudnn.version" not in d["calls_at_import"] and d["enabled_at_import"] is True
    # When CUDA starts: read, decided, acted on.
    assert d["cudnn_calls"] == [["cudnn.version"], ["_set_sdp_use_cudnn", False]]
    assert d["enabled"] is False
    e = d["cuda"]
    assert [e["applies"], e["done"], e["verdict"], e["code"]] == [True, True, "applies", "avoided"]
    assert e["evidence"] == "https://github.com/pytorch/pytorch/issues/196678"
    assert "NaN" in e["title"] and d["error"] is None


# CUDA's first use inside an sdpa_kernel() block. The guard reads and writes
# torch's flags only (never torch's objects: gc.get_referrers is counted), so
# the block puts cuDNN attention back on when it exits, and status() says so.
BLOCKS = """
import gc, json, torch, _outofcuda
from torch.nn.attention import sdpa_kernel, SDPBackend as B
C = torch._C
walks = []
real_get_referrers = gc.get_referrers
gc.get_referrers = lambda *objs: walks.append(len(objs)) or real_get_referrers(*objs)
def flags():
    return [bool(C._get_flash_sdp_enabled()), bool(C._get_mem_efficient_sdp_enabled()),
            bool(C._get_math_sdp_enabled()), bool(C._get_cudnn_sdp_enabled())]
def row():
    e = _outofcuda.status()["known_bugs"][0]
    return [e["applies"], e["done"], e["now"]]
def start_cuda():
    %s
out = {}
with sdpa_kernel(%s):
    start_cuda()                                      # CUDA's first use, inside the block
    out["inside"], out["row_inside"] = flags(), row()
out["after"], out["row_after"] = flags(), row()
C._set_sdp_use_cudnn(False)  # the documented way back: what enable_cudnn_sdp(False) does
out["fixed"], out["row_fixed"] = flags(), row()
with sdpa_kernel(B.CUDNN_ATTENTION):                  # a block entered after CUDA started
    out["again"] = flags()
out["after_again"] = flags()
out["walks"] = walks
out["error"] = _outofcuda.status()["hook"]["error"]
print(json.dumps(out))
"""
FAKE_START = "torch.cuda._fake_cuda_init()"
MIXED, CUDNN_ONLY = "[B.FLASH_ATTENTION, B.MATH, B.CUDNN_ATTENTION]", "B.CUDNN_ATTENTION"


def check_blocks(d, chosen):
    f, t = False, True
    if chosen == MIXED:
        # The guard is written inside the block; the block's exit puts back the
        # flags it saved on entry, cuDNN attention on among them.
        assert d["inside"] == [t, f, t, f] and d["row_inside"] == [t, t, "off"]
    else:
        # cuDNN attention alone on: turning it off would leave no backend.
        assert d["inside"] == [f, f, f, t] and d["row_inside"] == [t, f, "on"]
    assert d["after"] == [t, t, t, t] and d["row_after"][2] == "on"
    assert d["fixed"] == [t, t, t, f] and d["row_fixed"][2] == "off"
    assert d["again"] == [f, f, f, t] and d["after_again"] == [t, t, t, f]
    assert d["walks"] == [], "the guard searched torch's objects"
    assert d["error"] is None


@pytest.mark.parametrize("chosen", [MIXED, CUDNN_ONLY])
def test_cuda_starting_inside_an_sdpa_kernel_block(venv, tmp_path, nvml, chosen):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    check_blocks(last_json(venv.run(BLOCKS % (FAKE_START, chosen),
                                    env=dict(nvml("9.0"), PYTHONPATH=str(root)), cwd=tmp_path,
                                    args=("-W", "error"))), chosen)


def test_status_reads_the_guard_from_torchs_flag_without_walking_the_heap(venv, tmp_path, nvml):
    """status() with the guard taken costs what it costs on any GPU: torch's
    flag is read, the collector is never asked for referrers."""
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    d = last_json(venv.run("""
import gc, json, torch, torch.nn.attention, _outofcuda  # real torch imports the latter itself
torch.cuda._fake_cuda_init()
calls = []
gc.get_referrers = lambda *objs: calls.append(len(objs)) or []
st = [_outofcuda.status() for _ in range(3)]
torch._C._set_sdp_use_cudnn(True)                     # the program's own choice
print(json.dumps({"calls": calls, "st": st[0], "now_on": _outofcuda.status()["known_bugs"][0]}))
""", env=dict(nvml("9.0"), PYTHONPATH=str(root)), cwd=tmp_path, args=("-W", "error")))
    assert d["calls"] == []
    row = d["st"]["known_bugs"][0]
    assert [row["applies"], row["done"], row["now"]] == [True, True, "off"]
    assert [d["now_on"]["done"], d["now_on"]["now"]] == [True, "on"]
    sdpa = d["st"]["optimizations"]["sdpa"]
    assert (sdpa["notes"], sdpa["known_bug"]) == (["cudnn_attention_off"], BUG), sdpa


def test_turning_one_row_off_leaves_the_other_rows_as_they_were(venv, tmp_path, nvml):
    """cuDNN's version is read for the facts, not for the rows that are on:
    with the guard's row off, the sub-library row is decided as before."""
    root = make_fake_torch(tmp_path / "fake", "2.14.1", cudnn=92000, cuda_version="13.0")
    other = tmp_path / "system-cudnn"
    other.mkdir()
    (other / "libcudnn.so.9").write_bytes(b"")
    rows = {}
    for off in (None, BUG):
        env = dict(nvml("9.0"), PYTHONPATH=str(root), **({"OUTOFCUDA_KNOWN_BUGS": off} if off else {}))
        env["LD_LIBRARY_PATH"] += f":{other}"
        rows[off] = last_json(venv.run(
            "import json, torch, _outofcuda\ntorch.cuda._fake_cuda_init()\n"
            "print(json.dumps({b['id']: [b['applies'], b['done'], b['now']]\n"
            "                  for b in _outofcuda.status()['known_bugs']}))",
            env=env, cwd=tmp_path))
    assert rows[None].pop(BUG) == [True, True, "off"]
    assert rows[BUG].pop(BUG) == [None, False, None]
    assert rows[BUG] == rows[None]
    assert rows[BUG]["cudnn-sublibrary-mismatch"] == [True, False, None]


@pytest.mark.parametrize("release,cudnn", [("2.14.1", 92600), ("2.15.0", None),
                                           ("2.11.0", 91500), ("2.9.1", 92400)])
def test_sm90_outside_the_affected_versions_changes_nothing(venv, tmp_path, nvml, release,
                                                           cudnn):
    # A CUDA 13.0 build: 2.9's CUDA 12 builds below 12.9 have their own row.
    d = guard(venv, tmp_path, nvml("9.0"), release, cudnn, cuda_version="13.0")
    assert d["enabled"] is True
    assert ["_set_sdp_use_cudnn", False] not in d["cudnn_calls"]
    assert d["cuda"]["applies"] is False and d["cuda"]["done"] is False
    assert [d["cuda"]["verdict"], d["cuda"]["code"]] == ["not_affected", "out_of_range"]


@pytest.mark.parametrize("cc", ["8.0", "12.0"])
@pytest.mark.parametrize("cudnn", [92400, 92600])
def test_other_devices_change_nothing_and_never_load_cudnn(venv, tmp_path, nvml, cc, cudnn):
    """The wheel names cuDNN's version: no row loads cuDNN to read it."""
    d = guard(venv, tmp_path, nvml(cc), "2.14.1", cudnn, wheels=True)
    assert d["import"]["applies"] is False and d["cuda"]["applies"] is False
    assert d["import"]["code"] == "out_of_range"
    assert d["cudnn_calls"] == [] and d["enabled"] is True


def test_known_bugs_off_keeps_torchs_choice(venv, tmp_path, nvml):
    d = guard(venv, tmp_path, nvml("9.0", OUTOFCUDA_KNOWN_BUGS="0"))
    assert d["cudnn_calls"] == [] and d["enabled"] is True
    assert d["cuda"]["applies"] is None and d["cuda"]["done"] is False
    assert d["cuda"]["code"] == "off"


def test_torchs_own_deprioritisation_is_respected(venv, tmp_path, nvml):
    d = guard(venv, tmp_path, nvml("9.0", TORCH_CUDNN_SDPA_DEPRIORITIZED="1"), wheels=True)
    assert d["cudnn_calls"] == [] and d["enabled"] is True
    assert d["import"]["code"] == "torch_avoids"


def test_a_cpu_build_is_not_affected(venv, workdir, nvml):
    """The real CPU build of torch 2.13.0 next to an sm90 GPU."""
    st = last_json(venv.run("import json, torch, _outofcuda; "
                            "print(json.dumps(_outofcuda.status()['known_bugs']))",
                            env=nvml("9.0"), cwd=workdir))
    assert [st[0]["applies"], st[0]["code"]] == [False, "no_cuda"]


@pytest.mark.parametrize("release,version", [(None, None), ("2.10.0", None),
                                             ("2.10.0", "2.10.9")])
def test_no_driver_library_is_loaded_where_no_entry_can_apply(venv, workdir, nvml, tmp_path,
                                                               release, version):
    """A CPU-only build (the real 2.13.0), or a CUDA build outside the
    releases of every row that needs a device's capability (the cuDNN
    attention rows: 2.9.x, then 2.11 on; a named row that also waits for
    cuDNN asks NVML when CUDA starts), with the autocast dtype given (so nothing
    else asks NVML): `import torch` loads no libnvidia-ml, the table is
    decided from torch's facts alone."""
    env = nvml("9.0", OUTOFCUDA_AMP_DTYPE="bfloat16")
    if release is not None:
        env["PYTHONPATH"] = str(make_fake_torch(tmp_path / "fake", release, version=version))
    st = last_json(venv.run("""
import json, torch, _outofcuda
maps = open("/proc/self/maps").read()
print(json.dumps({"nvml_loaded": "libnvidia-ml" in maps,
                  "applies": _outofcuda.status()["known_bugs"][0]["applies"]}))
""", env=env, cwd=workdir))
    assert st == {"nvml_loaded": False, "applies": False}


def test_table_evaluated_on_given_facts(venv):
    r = last_json(venv.run("""
import json, _outofcuda
c = _outofcuda._known_bugs_check
print(json.dumps([c("2.14.1+cu130", True, 92400, [90], {})[0]["applies"],
                  c("2.14.1", True, 92400, [90], {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"})[0]["applies"],
                  c("2.14.1", True, None, [90], {})[0]["applies"],
                  c("2.14.1", True, 92600, [90, 80], {})[0]["applies"],
                  c(None, None, None, None, {})[0]["applies"]]))
"""))
    assert r == [True, False, None, False, None]


# ---- the allocator variable 2.9 and 2.10 ignore (pytorch issue 183387) ----
# Each release has one runtime setter (_cuda_cudaCachingAllocator_set_allocator_settings
# on 2.9, _accelerator_setAllocatorSettings on 2.10); a setter call resets the keys it
# leaves out (measured on 2.14.1; bridge.c's hand_back_allocator), so every call carries
# the whole merge.

ALLOC = """
import json, os, torch, _outofcuda
st = _outofcuda.status()
(e,) = [b for b in st["known_bugs"] if b["id"] == "alloc-conf-generic-ignored"]
setters = [c[1] for c in torch._C.calls
           if c[0] in ("_accelerator_setAllocatorSettings",
                       "_cuda_cudaCachingAllocator_set_allocator_settings")]
print(json.dumps({"parsed": torch._alloc_conf(), "setters": setters,
                  "merged": st["optimizations"]["allocator"]["value"],
                  "row": [e["applies"], e["done"], e["code"]],
                  "env": {k: os.environ.get(k) for k in
                          ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")},
                  "error": st["hook"]["error"]}))
"""
USER = "max_split_size_mb:256,expandable_segments:False"


def keys(conf):
    return dict(item.split(":", 1) for item in conf.split(",") if item)


def alloc(venv, tmp_path, release, version=None, **env):
    root = make_fake_torch(tmp_path / f"fake-{release}-{version}", release, version=version)
    return last_json(venv.run(ALLOC, env=dict(env, PYTHONPATH=str(root)), cwd=tmp_path))


@pytest.mark.parametrize("release,version", [("2.9.0", None), ("2.9.1", None),
                                             ("2.9.1", "2.10.9")])
def test_the_users_generic_variable_reaches_the_allocator_where_torch_ignores_it(
        venv, tmp_path, release, version):
    """2.9.0 to 2.10: what the CUDA allocator parses holds the user's keys from
    PYTORCH_ALLOC_CONF (the user's expandable_segments:False wins over
    outofcuda's default), in the one string given to torch's setter."""
    d = alloc(venv, tmp_path, release, version, PYTORCH_ALLOC_CONF=USER)
    parsed = keys(d["parsed"])
    assert parsed["max_split_size_mb"] == "256" and parsed["expandable_segments"] == "False", d
    assert parsed["garbage_collection_threshold"] == "0.8"
    assert d["setters"] == [d["merged"]] and d["parsed"] == d["merged"]
    assert d["row"] == [True, True, "avoided"] and d["error"] is None
    # The user's environment is left as it was.
    assert d["env"] == {"PYTORCH_ALLOC_CONF": USER, "PYTORCH_CUDA_ALLOC_CONF": None}


def test_a_generic_variable_outofcuda_adds_nothing_to_still_reaches_torch(venv, tmp_path):
    user = "garbage_collection_threshold:0.8,expandable_segments:True,max_split_size_mb:64"
    d = alloc(venv, tmp_path, "2.9.1", PYTORCH_ALLOC_CONF=user)
    assert keys(d["parsed"]) == keys(user) and d["row"][:2] == [True, True], d


@pytest.mark.parametrize("release,env,code", [
    ("2.11.0", {"PYTORCH_ALLOC_CONF": USER}, "out_of_range"),
    ("2.9.1", {"PYTORCH_ALLOC_CONF": USER, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"},
     "condition_unmet"),
    ("2.9.1", {}, "condition_unmet")])
def test_the_allocator_row_outside_its_range(venv, tmp_path, release, env, code):
    d = alloc(venv, tmp_path, release, **env)
    assert d["row"] == [False, False, code], d["row"]
    if release == "2.11.0":  # torch reads the user's variable itself
        assert keys(d["parsed"])["max_split_size_mb"] == "256"


def test_the_allocator_row_turned_off_leaves_torch_as_it_is(venv, tmp_path):
    d = alloc(venv, tmp_path, "2.9.1", PYTORCH_ALLOC_CONF=USER,
              OUTOFCUDA_KNOWN_BUGS="alloc-conf-generic-ignored")
    assert d["row"] == [None, False, "off"]
    # As before the row existed: the user's keys never reach the allocator.
    assert "max_split_size_mb" not in keys(d["parsed"])
    assert keys(d["parsed"])["expandable_segments"] == "True"


@pytest.mark.parametrize("release", ["2.9.1", "2.11.0", "2.14.1"])
@pytest.mark.parametrize("user", ["", "max_split_size_mb:512", "roundup_power2_divisions:4",
                                  "garbage_collection_threshold:0.6,max_split_size_mb:128"])
def test_the_string_given_to_the_setter_is_whole(venv, tmp_path, release, user):
    """torch's runtime parser resets max_split_size, roundup_power2_divisions
    and garbage_collection_threshold when a string leaves them out: the one
    string outofcuda hands over holds every key of the user's and every
    default the user did not set."""
    env = {"PYTORCH_ALLOC_CONF" if release != "2.9.1" else "PYTORCH_CUDA_ALLOC_CONF": user}
    d = alloc(venv, tmp_path, release, **env)
    if d["merged"] is None:
        # Nothing to add: no setter call, torch parses the user's own string.
        assert d["setters"] == [] and d["parsed"] == user, d
        return
    assert d["setters"] == [d["merged"]], d
    handed = keys(d["setters"][0])
    assert keys(user).items() <= handed.items(), (user, handed)
    # outofcuda's own keys are there too (expandable segments only where no
    # max_split_size_mb of the user's stands beside them).
    assert handed["garbage_collection_threshold"] == keys(user).get(
        "garbage_collection_threshold", "0.8")
    assert ("expandable_segments" in handed) == ("max_split_size_mb" not in keys(user))
    assert d["parsed"] == d["setters"][0]


# expandable-ipc-2.13: from 2.13 an expandable segment's IPC handle carries 8
# uninitialised bytes (read in the 2.14.1 and 2.15.0 binaries). A DataLoader
# worker (torch's _worker_info set, as _worker_loop sets it before the dataset
# runs) sends its CUDA tensors only through CUDA IPC: there outofcuda's own
# expandable segments go off when CUDA starts.
IPC = """
import json, sys, types, torch, _outofcuda
if %r:
    worker = types.ModuleType("torch.utils.data._utils.worker")
    worker._worker_info = object()
    sys.modules[worker.__name__] = worker
torch.cuda._fake_cuda_init()
st = _outofcuda.status()
(e,) = [b for b in st["known_bugs"] if b["id"] == "expandable-ipc-2.13"]
a = st["optimizations"]["allocator"]
print(json.dumps({"row": [e["applies"], e["done"], e["code"], e["kind"]], "parsed": torch._alloc_conf(),
                  "alloc": [a["state"], a["code"], a["value"]], "error": st["hook"]["error"]}))
"""
STEERED = "expandable_segments:False,garbage_collection_threshold:0.8"


@pytest.mark.parametrize("release,version,worker,env,code", [
    ("2.12.1", "2.13.0", True, {}, "avoided"),
    ("2.15.0", None, True, {}, "avoided"),
    ("2.12.1", None, True, {}, "out_of_range"),
    ("2.15.0", None, False, {}, "applies"),
    ("2.15.0", None, True, {"OUTOFCUDA_KNOWN_BUGS": "expandable-ipc-2.13"}, "off"),
    ("2.15.0", None, True, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "applies"),
    ("2.15.0", None, True, {"OUTOFCUDA_ALLOC_CONF": "expandable_segments:True"}, "applies")])
def test_a_dataloader_worker_gets_no_expandable_segments_of_outofcudas(
        venv, tmp_path, release, version, worker, env, code):
    root = make_fake_torch(tmp_path / "fake", release, version=version)
    d = last_json(venv.run(IPC % worker, env=dict(env, PYTHONPATH=str(root)), cwd=tmp_path))
    assert d["row"][2] == code and d["error"] is None, d
    assert d["row"][3] == "guard" and d["row"][1] is (code == "avoided"), d
    if code == "avoided":
        # Whole (the gc threshold kept), before the first allocation, and said so.
        assert keys(d["parsed"]) == keys(STEERED) and d["alloc"] == ["applied", "at_cuda_init",
                                                                      STEERED], d
    else:
        assert keys(d["parsed"])["expandable_segments"] == "True", d
        assert d["alloc"][1] != "at_cuda_init", d


# ---- the TF32 mixed-API trap ----

# Per program choice (a forked child each): the program sets TF32 through
# one API before CUDA starts, CUDA starts (outofcuda's TF32 step), then every
# reader of either API is tried; what raised is recorded.
TF32 = """
import json, os, warnings, torch
warnings.simplefilter("ignore")  # 2.9.0's own deprecation warnings on the legacy API
C = torch._C
CHOICES = {
    "none": lambda: None,
    "legacy-on": lambda: C._set_cublas_allow_tf32(True),
    "legacy-off": lambda: C._set_cublas_allow_tf32(False),
    "precision-high": lambda: C._set_float32_matmul_precision("high"),
    "new-tf32": lambda: C._set_fp32_precision_setter("cuda", "matmul", "tf32"),
    "new-ieee": lambda: C._set_fp32_precision_setter("cuda", "matmul", "ieee"),
    "new-generic": lambda: C._set_fp32_precision_setter("generic", "all", "tf32"),
}
READS = {
    "allow_tf32": lambda: C._get_cublas_allow_tf32(),
    "matmul_precision": lambda: C._get_float32_matmul_precision(),
    "cudnn_allow_tf32": lambda: C._get_cudnn_allow_tf32(),
    "fp32_precision": lambda: C._get_fp32_precision_getter("cuda", "matmul"),
}
out = {}
for name, choose in CHOICES.items():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        raised = []
        try:
            choose()
        except Exception:
            raised.append("choice")
        torch.cuda._fake_cuda_init()
        for read, fn in READS.items():
            try:
                fn()
            except RuntimeError:
                raised.append(read)
        os.write(w, json.dumps(raised).encode())
        os._exit(0)
    os.close(w)
    out[name] = json.loads(os.read(r, 65536).decode())
    os.waitpid(pid, 0)
print(json.dumps(out))
"""


@pytest.mark.parametrize("release,version", [("2.9.0", None), ("2.9.1", None),
                                             ("2.9.1", "2.10.0"), ("2.11.0", None),
                                             ("2.11.0", "2.12.0"), ("2.11.0", "2.13.0"),
                                             ("2.14.1", None), ("2.15.0", None)])
def test_nothing_outofcuda_sets_makes_a_tf32_read_raise(venv, tmp_path, release, version):
    """2.9 to 2.15, whichever API the program uses: the reads that raise with
    outofcuda are exactly those that raise without it (torch's own trap for a
    program that mixes the APIs), never one more."""
    root = make_fake_torch(tmp_path / "fake", release, version=version)
    env = {"PYTHONPATH": str(root)}
    with_oc = last_json(venv.run(TF32, env=env, cwd=tmp_path))
    bare = last_json(venv.run(TF32, env=dict(env, OUTOFCUDA_DISABLE="1"), cwd=tmp_path))
    # 2.9.0's fake setters and getters warn (filtered in the scenario); a
    # scenario that says nothing else on stderr passes last_json's quiet check.
    assert with_oc == bare, (with_oc, bare)
    # Where the program chose nothing or used one API only, nothing raises.
    for choice in ("none", "legacy-on", "legacy-off", "precision-high", "new-ieee"):
        assert with_oc[choice] == [], (choice, with_oc[choice])


def test_the_tf32_row_says_outofcuda_avoids_the_trap(venv, tmp_path):
    rows = {}
    for release in ("2.4.1", "2.9.0", "2.15.0"):
        root = make_fake_torch(tmp_path / release, release)
        st = last_json(venv.run("import json, torch, _outofcuda; print(json.dumps("
                                "_outofcuda.status()['known_bugs']))",
                                env={"PYTHONPATH": str(root)}, cwd=tmp_path))
        (rows[release],) = [b for b in st if b["id"] == "tf32-mixed-api"]
    assert rows["2.4.1"]["applies"] is False
    for release in ("2.9.0", "2.15.0"):
        assert rows[release]["applies"] is True and rows[release]["code"] == "avoided"


def test_the_fsdp2_row_needs_fsdp2s_divide_factor_setter(venv, tmp_path):
    # Stand-ins from the records: no FSDPModule before 2.4, one without the
    # divide-factor setter in 2.4.1, the setter from 2.5 (a 2.9.1 reporting 2.5.0).
    rows = {}
    for release, version in (("2.0.1", None), ("2.4.1", None), ("2.9.1", "2.5.0")):
        root = make_fake_torch(tmp_path / release, release, version=version)
        st = last_json(venv.run("import json, torch, _outofcuda; print(json.dumps("
                                "_outofcuda.status()['known_bugs']))",
                                env={"PYTHONPATH": str(root)}, cwd=tmp_path))
        (rows[release],) = [b for b in st if b["id"] == "fsdp2-bf16-premul-sum"]
    assert [rows[r]["applies"] for r in ("2.0.1", "2.4.1", "2.9.1")] == [False, False, True], rows


# ---- GPU-0 contexts under torchrun (pytorch issue 135279) ----
# At CUDA's start a LOCAL_RANK=1 process calls _cuda_getDeviceCount,
# _cuda_setMemoryFraction(f, LOCAL_RANK) and attaches the OOM observer, nothing
# else: the TF32, cuDNN and SDPA flags touch no device, and NVML creates no context.

GPU0 = """
import json, torch, _outofcuda
torch.cuda._fake_cuda_init()
(e,) = [b for b in _outofcuda.status()["known_bugs"] if b["id"] == "torchrun-gpu0-context"]
print(json.dumps({"row": [e["applies"], e["done"], e["code"], e["reason"]],
                  "calls": [[a for a in c if not callable(a)] for c in torch._C.calls
                            if c[0].startswith("_cuda_")],
                  "fraction": _outofcuda.status()["optimizations"]["memory_fraction"]["value"]}))
"""


@pytest.fixture
def two_gpus(stub_nvml, venv, tmp_path):
    def run(procs, **env):
        cfg = config(tmp_path / "nvml-2.cfg", [device(cc="9.0"), device(cc="9.0")], procs=procs)
        root = make_fake_torch(tmp_path / "fake", "2.14.1")
        full = dict({"LD_LIBRARY_PATH": str(stub_nvml), "STUB_NVML_CONFIG": str(cfg),
                     "PYTHONPATH": str(root), "OUTOFCUDA_AMP_DTYPE": "bfloat16"}, **env)
        return venv.run(GPU0, env=full, cwd=tmp_path)
    return run


def test_a_rank_with_a_context_on_device_0_is_named(two_gpus):
    r = two_gpus([(0, "self", 600 << 20), (1, "self", 900 << 20)], LOCAL_RANK="1",
                 OUTOFCUDA_SUMMARY="1")
    d = last_json.func(r)  # the summary is on stderr
    assert d["row"][:3] == [True, False, "applies"], d["row"]
    assert "NVML lists this process on cuda:0, not LOCAL_RANK 1's" in d["row"][3]
    # The exit summary names it, with the fix.
    line = [ln for ln in r.stderr.splitlines() if "known bug" in ln]
    assert len(line) == 1 and "torchrun-gpu0-context" in line[0], r.stderr
    assert "torch.cuda.set_device" in line[0] and "issues/135279" in line[0]


def test_outofcuda_never_touches_device_0_on_another_rank(two_gpus):
    """LOCAL_RANK=1: every device call outofcuda makes at CUDA's start names
    device 1 (the fraction torch's allocator holds, then outofcuda's), none
    device 0 or the current device."""
    d = last_json(two_gpus([(1, "self", 900 << 20)], LOCAL_RANK="1"))
    assert d["calls"] == [["_cuda_getDeviceCount"], ["_cuda_getMemoryFraction", 1],
                          ["_cuda_setMemoryFraction", 0.98, 1],
                          ["_cuda_attach_out_of_memory_observer"]], d["calls"]
    assert d["fraction"]["device"] == 1
    assert d["row"][:3] == [False, False, "condition_unmet"], d["row"]


@pytest.mark.parametrize("rank,procs", [
    (None, [(0, "self", 1 << 20)]), ("0", [(0, "self", 1 << 20), (1, "self", 1 << 20)]),
    ("1", []), ("5", [(0, "self", 1 << 20)])])
def test_no_context_elsewhere_is_not_named(two_gpus, rank, procs):
    env = {"OUTOFCUDA_SUMMARY": "1"}
    if rank is not None:
        env["LOCAL_RANK"] = rank
    r = two_gpus(procs, **env)
    d = last_json.func(r)  # the summary is on stderr
    assert d["row"][:3] == [False, False, "condition_unmet"], d["row"]
    assert "known bug" not in r.stderr


def test_doctor_names_another_process_on_another_ranks_device(cuda_venv, workdir, stub_nvml,
                                                             tmp_path):
    """A process of this user with LOCAL_RANK=1 that NVML lists on device 0 of
    two (a rank that used CUDA before set_device)."""
    import subprocess, sys
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            env={"LOCAL_RANK": "1", "PATH": "/usr/bin:/bin"})
    try:
        cfg = config(tmp_path / "nvml.cfg", [device(cc="8.0"), device(cc="8.0")],
                     procs=[(0, rank.pid, 700 << 20), (1, rank.pid, 900 << 20)])
        r = cuda_venv.run(None, args=("-m", "outofcuda", "doctor", "--json"), cwd=workdir,
                          env={"LD_LIBRARY_PATH": str(stub_nvml), "STUB_NVML_CONFIG": str(cfg)},
                          timeout=300)
    finally:
        rank.kill()
        rank.wait()
    (check,) = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "known_bugs"]
    assert (f"torchrun-gpu0-context: process {rank.pid} (LOCAL_RANK 1) holds a context on "
            "cuda:0, not cuda:1") in check["message"], check


# ---- rows that are only named: cuDNN's version from the wheel, else at CUDA's start ----

SUBLIB = """
import json, torch, _outofcuda
def rows():
    return {b["id"]: [b["applies"], b["code"]] for b in _outofcuda.status()["known_bugs"]}
at_import = rows()
torch.cuda._fake_cuda_init()
print(json.dumps({"import": at_import, "cuda": rows(),
                  "cudnn_read": [c for c in torch._C.calls if c[0] == "cudnn.version"] != []}))
"""
S = "cudnn-sublibrary-mismatch"


def other_cudnn(tmp_path, where="system"):
    """A folder holding a libcudnn.so.9 (a cuDNN besides the wheel's)."""
    d = tmp_path / where
    d.mkdir(parents=True)
    (d / "libcudnn.so.9").write_bytes(b"")
    return d


@pytest.mark.parametrize("where,applies", [(None, False), ("system", True),
                                           ("venv/nvidia/cudnn/lib", False)])
def test_the_sublibrary_row_applies_only_beside_another_cudnn(venv, tmp_path, nvml, where,
                                                              applies):
    """2.13.0's CUDA 13.0 wheel (cuDNN 9.20 by the record): the row applies
    only where another cuDNN 9 is on the loader path (a wheel's own folder is
    not another), decided at import from the wheel's version (cuDNN never
    loaded); doctor's probe decides it alike."""
    root = make_fake_torch(tmp_path / "fake", "2.12.1", version="2.13.0", cuda_version="13.0",
                           wheels=True)
    env = dict(nvml("8.0", OUTOFCUDA_SUMMARY="1"), PYTHONPATH=str(root))
    if where:
        env["LD_LIBRARY_PATH"] += f":{other_cudnn(tmp_path, where)}"
    r = venv.run(SUBLIB + """
ld = {"LD_LIBRARY_PATH": __import__("os").environ["LD_LIBRARY_PATH"]}
print(json.dumps([b["applies"] for b in _outofcuda._known_bugs_check(
    torch.__version__, "13.0", 92000, [80], ld) if b["id"] == "%s"]))""" % S, env=env,
                 cwd=tmp_path)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("{", "["))]
    d, doctor = json.loads(lines[-2]), json.loads(lines[-1])
    assert d["cudnn_read"] is False
    assert d["import"][S][0] is applies and d["cuda"][S][0] is applies, d["import"][S]
    assert doctor == [applies]
    if applies:
        assert d["import"][S][1] == "applies"
        assert f"known bug      {S}" in r.stderr, r.stderr
    else:
        assert d["import"][S][1] == "condition_unmet"
        assert S not in r.stderr


@pytest.mark.parametrize("wheels", [True, False])
def test_no_row_stays_undecided_once_cuda_has_started(venv, tmp_path, nvml, wheels):
    """2.15.0 beside an sm90 (no guard applies there): with the cuDNN wheel,
    every row is decided at import from its version, read without loading
    cuDNN. Without one, no guard needs cuDNN's version, so cuDNN is not loaded
    (+51 MiB) for rows that are only named: they stay undecided and say that
    `outofcuda doctor` reads it, never that CUDA's start will."""
    root = make_fake_torch(tmp_path / "fake", "2.15.0", cuda_version="13.0", wheels=wheels)
    r = venv.run(SUBLIB + """
print(json.dumps({b["id"]: b["reason"] for b in _outofcuda.status()["known_bugs"]
                  if b["code"] == "needs_fact"}))""",
                 env=dict(nvml("9.0"), PYTHONPATH=str(root)), cwd=tmp_path)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 2, r.stdout + r.stderr
    d, waiting = json.loads(lines[0]), json.loads(lines[1])
    assert d["cudnn_read"] is False
    D = "cudnn-sdpa-nan-dkdv-sq1"  # cuDNN 9.26 is inside its versions
    if wheels:
        assert {i: c for i, c in d["cuda"].items() if c[0] is None} == {}
        assert d["import"][D] == [True, "applies"] and waiting == {}
    else:
        assert d["cuda"][D] == [None, "needs_fact"] and D in waiting
        assert all("`outofcuda doctor` reads it" in w for w in waiting.values()), waiting


GQA, IMA = "cudnn-sdpa-gqa-sm100", "cudnn-sdpa-ima-cuda-below-12.9"


@pytest.mark.parametrize("row,release,cuda,cc,env,off", [
    (GQA, "2.11.0", "12.8", "10.0", {}, True), (GQA, "2.12.1", "13.0", "10.0", {}, True),
    (GQA, "2.10.0", "12.8", "10.0", {}, False), (GQA, "2.12.1", "13.0", "12.0", {}, False),
    (GQA, "2.12.1", "13.0", "10.0", {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}, False),
    (GQA, "2.12.1", "13.0", "10.0", {"OUTOFCUDA_KNOWN_BUGS": GQA}, False),
    (IMA, "2.9.1", "12.8", "9.0", {}, True), (IMA, "2.9.1", "12.8", "10.0", {}, True),
    (IMA, "2.9.1", "12.9", "9.0", {}, False), (IMA, "2.10.0", "12.8", "9.0", {}, False),
    (IMA, "2.9.1", "12.8", "8.0", {}, False),
    (IMA, "2.9.1", "12.8", "9.0", {"OUTOFCUDA_KNOWN_BUGS": IMA}, False)])
def test_the_new_attention_guards_at_their_edges(venv, tmp_path, nvml, row, release, cuda, cc,
                                                 env, off):
    """The B200 GQA row and the 2.9 CUDA-below-12.9 row: decided at import
    from torch, its CUDA and NVML's compute capability (no cuDNN range), and
    cuDNN attention turned off when CUDA starts, not at import."""
    d = guard(venv, tmp_path, nvml(cc, **env), release, row=row, cuda_version=cuda, wheels=True)
    assert d["enabled_at_import"] is True and d["enabled"] is not off
    assert (["_set_sdp_use_cudnn", False] in d["cudnn_calls"]) is off
    assert d["cuda"]["done"] is off and ["cudnn.version"] not in d["cudnn_calls"]
    if "OUTOFCUDA_KNOWN_BUGS" in env:
        assert [d["cuda"]["applies"], d["cuda"]["code"]] == [None, "off"]
    else:
        assert d["import"]["applies"] is off, d["import"]


@pytest.mark.parametrize("release,nccl_inside", [("2.11.0", True), ("2.14.1", False)])
def test_the_nccl_row_reads_the_wheels_nccl(venv, tmp_path, nvml, release, nccl_inside):
    """2.11.0's CUDA wheel pins NCCL 2.28.9, 2.14.1's 2.30.7 (the records):
    read from the wheel's folder; the row needs an aarch64 machine too."""
    root = make_fake_torch(tmp_path / "fake", release, wheels=True)
    d = last_json(venv.run(SUBLIB, env=dict(nvml("9.0"), PYTHONPATH=str(root)), cwd=tmp_path))
    applies, code = d["import"]["nccl-aarch64-hang"]
    if not nccl_inside:
        assert [applies, code] == [False, "out_of_range"]
    elif platform.machine() == "aarch64":
        assert [applies, code] == [True, "applies"]
    else:
        assert [applies, code] == [False, "condition_unmet"]


def test_named_rows_on_given_facts(venv, tmp_path):
    """What doctor's probe decides, at the named rows' edges."""
    r = last_json(venv.run("""
import json, _outofcuda
def row(id, *facts):
    (e,) = [b for b in _outofcuda._known_bugs_check(*facts) if b["id"] == id]
    return e["applies"]
S, D = "cudnn-sublibrary-mismatch", "cudnn-sdpa-nan-dkdv-sq1"
L = {"LD_LIBRARY_PATH": %r}
print(json.dumps({
    "sublib": [row(S, "2.12.1+cu130", "13.0", 92000, [80], L),
               row(S, "2.13.0", "13.2", 92299, [80], L),
               row(S, "2.13.0", "13.0", 92300, [80], L),
               row(S, "2.13.0", "12.8", 92000, [80], L),
               row(S, "2.13.0", "13.0", 91999, [80], L),
               row(S, "2.13.0", True, 92000, [80], L),
               row(S, "2.12.1+cu130", "13.0", 92000, [80], {})],
    "new": [[row(i, t, c, cd, ccs, {}) for t, c, cd, ccs in cases] for i, cases in (
        ("cudnn-pre-turing", [("2.14.1", "12.8", 91100, [70]), ("2.14.1", "12.8", 91099, [70]),
                              ("2.14.1", "12.8", 91100, [75]), ("2.0.1", "11.7", 8500, [61]),
                              ("2.14.1", "12.8", 92400, [30]), ("2.14.1", "12.8", 92400, [29])]),
        ("conv3d-half-cudnn", [("2.8.0", "12.8", 91002, [80]), ("2.9.1", "12.8", 91499, None),
                               ("2.9.1", "12.8", 91001, [80]), ("2.10.0", "12.8", 91500, [80])]),
        ("cudnn-fp8-sdpa-zeros", [("2.14.1", "13.0", 92400, [100]), ("2.14.1", "13.0", 92499, [103]),
                                  ("2.14.1", "13.0", 92500, [100]), ("2.14.1", "13.0", 92400, [90]),
                                  ("2.14.1", "13.0", 92399, [100]), ("2.14.1", "13.0", 92400, [110])]),
        ("compile-vram-2.10", [("2.10.0", "12.8", None, None), ("2.11.9", "12.8", None, None),
                               ("2.9.1", "12.8", None, None), ("2.12.0", "12.8", None, None)]),
        ("expandable-ipc-2.13", [("2.13.0", "13.0", None, None), ("2.15.0", "13.0", None, None),
                                 ("2.12.1", "13.0", None, None), ("2.13.0", False, None, None)]))],
    "dkdv": [row(D, "2.11.0", "12.8", 92501, [90], {}),
             row(D, "2.15.0", "13.2", 92699, [90], {}),
             row(D, "2.15.0", "13.2", 92500, [90], {}),
             row(D, "2.15.0", "13.2", 92700, [90], {}),
             row(D, "2.10.9", "12.8", 92600, [90], {}),
             row(D, "2.15.0", "13.2", 92600, [100], {}),
             row(D, "2.15.0", "13.2", 92600, [90], {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"})],
    "cpu": [row(i, "2.13.0", False, None, None, {})
            for i in ("fsdp2-bf16-premul-sum", "avg-pool2d-channels-last-grad", "tf32-mixed-api")],
    "fields": sorted(_outofcuda._known_bugs_check("2.13.0", "13.0", 92000, [90], {})[3]),
    "kinds": [b["kind"] for b in _outofcuda._known_bugs_check("2.13.0", "13.0", 92000, [90], {})]}))
""" % str(other_cudnn(tmp_path))))
    assert r["sublib"] == [True, True, False, False, False, None, False]
    assert r["new"] == [[True, False, False, False, True, False], [True, True, False, False],
                        [True, True, False, False, False, False], [True, True, False, False],
                        [True, True, False, False]]
    assert r["dkdv"] == [True, True, False, False, False, False, False]
    assert r["cpu"] == [False, False, False]
    assert {"fixed_in", "fix", "kind"} <= set(r["fields"])
    assert r["kinds"] == ["guard", "guard", "named", "named", "named", "named", "own", "named",
                          "guard", "guard"] + ["named"] * 5 + ["guard"]


# ---- the real CUDA build of torch 2.14.1 (no GPU) ----

REAL = """
import json, torch, _outofcuda
C = torch._C
def entry():
    return _outofcuda.status()["known_bugs"][0]
def cudnn_loaded():
    with open("/proc/self/maps") as f:
        return "libcudnn_graph" in f.read()
at_import = entry()
loaded_at_import = cudnn_loaded()
# What CUDA's start runs, with stand-ins for the device calls (no GPU here).
C._cuda_getDeviceCount = lambda: 1
C._cuda_getDevice = lambda: 0
C._cuda_setMemoryFraction = lambda fraction, device: None
C._cuda_attach_out_of_memory_observer = lambda fn: None
(cb,) = [fn for fn, _stack in torch.cuda._queued_calls
         if getattr(fn, "__name__", "") == "outofcuda_at_cuda_init"]
cb()
print(json.dumps({"import": at_import, "cuda": entry(), "loaded_at_import": loaded_at_import,
                  "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
                  "cudnn": torch._C._cudnn.getVersionInt(),
                  "initialized": torch.cuda.is_initialized(),
                  "error": _outofcuda.status()["hook"]["error"]}))
"""


@pytest.mark.parametrize("cc,applies", [("9.0", True), ("8.0", False), ("10.0", False)])
def test_real_cuda_build_reports_what_the_device_implies(cuda_venv, workdir, nvml, cc, applies):
    """cuDNN's version is the installed nvidia-cudnn-cu13 wheel's (9.24.0.43):
    decided at import without loading cuDNN, acted on when CUDA starts. On a
    10.0 the B200 row turns cuDNN attention off instead."""
    d = last_json(cuda_venv.run(REAL, env=nvml(cc), cwd=workdir, args=("-W", "error")))
    assert d["loaded_at_import"] is False and d["initialized"] is False
    assert d["cudnn"] == 92400
    assert d["import"]["applies"] is applies and d["import"]["done"] is False
    if applies:
        assert d["cuda"]["applies"] is True and d["cuda"]["done"] is True, d["cuda"]
        assert d["cuda"]["code"] == "avoided"
    else:
        assert d["cuda"]["applies"] is False
    assert d["cudnn_sdp"] is (cc == "8.0")
    assert d["error"] is None


REAL_START = """C._cuda_getDeviceCount = lambda: 1
    C._cuda_getDevice = lambda: 0
    C._cuda_setMemoryFraction = lambda fraction, device: None
    C._cuda_attach_out_of_memory_observer = lambda fn: None
    for fn, _stack in torch.cuda._queued_calls:
        if getattr(fn, "__name__", "") == "outofcuda_at_cuda_init":
            fn()"""


@pytest.mark.parametrize("chosen", [MIXED, CUDNN_ONLY])
def test_real_cuda_build_inside_an_sdpa_kernel_block(cuda_venv, workdir, nvml, chosen):
    check_blocks(last_json(cuda_venv.run(BLOCKS % (REAL_START, chosen), env=nvml("9.0"),
                                         cwd=workdir, args=("-W", "error"))), chosen)


def test_real_cuda_build_known_bugs_off(cuda_venv, workdir, nvml):
    d = last_json(cuda_venv.run(REAL, env=nvml("9.0", OUTOFCUDA_KNOWN_BUGS="0"), cwd=workdir,
                                args=("-W", "error")))
    assert d["cudnn_sdp"] is True and d["cuda"]["done"] is False
    assert d["cuda"]["code"] == "off"


# ---- the command line ----

def test_doctor_and_status_name_the_bug(cuda_venv, workdir, nvml):
    r = cuda_venv.run(None, args=("-m", "outofcuda", "doctor", "--json"), env=nvml("9.0"),
                      cwd=workdir, timeout=300)
    (check,) = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "known_bugs"]
    assert check["ok"] is True and f"{BUG} applies" in check["message"], check
    assert "pytorch/issues/196678" in check["message"]
    r = cuda_venv.run(None, args=("-m", "outofcuda", "doctor", "--json"),
                      env=nvml("9.0", OUTOFCUDA_KNOWN_BUGS="0"), cwd=workdir, timeout=300)
    (check,) = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "known_bugs"]
    assert check["ok"] is False and "enable_cudnn_sdp(False)" in check["fix"]
    # Disabled: nothing avoids the bug, and doctor does not claim otherwise.
    r = cuda_venv.run(None, args=("-m", "outofcuda", "doctor", "--json"),
                      env=nvml("9.0", OUTOFCUDA_DISABLE="1"), cwd=workdir, timeout=300)
    (check,) = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "known_bugs"]
    assert check["ok"] is False and "outofcuda avoids it" not in check["message"], check
    assert "OUTOFCUDA_DISABLE" in check["message"]
    r = cuda_venv.run(None, args=("-m", "outofcuda", "status"), env=nvml("8.0"), cwd=workdir,
                      timeout=300)
    # Not affected on 8.0: counted with the others on the known_bugs row, not named.
    assert f"{BUG}:" not in r.stdout and " not affected\n" in r.stdout, r.stdout


def test_doctor_lines_per_kind_and_the_off_list(cuda_venv, workdir, nvml):
    """The real CUDA build of 2.14.1 beside an sm90: a guard turned off by
    the list makes doctor unhealthy (naming that row's fix); a row outofcuda's
    own settings avoid, or one only named, keeps it healthy, with its fix."""
    r = cuda_venv.run(None, args=("-m", "outofcuda", "doctor", "--json"),
                      env=nvml("9.0", OUTOFCUDA_KNOWN_BUGS=f"{BUG},tf32-mixed-api"), cwd=workdir,
                      timeout=300)
    (check,) = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "known_bugs"]
    msg = check["message"]
    assert check["ok"] is False and check["fix"].startswith(f"{BUG}: unset OUTOFCUDA_KNOWN_BUGS")
    assert "tf32-mixed-api" not in check["fix"]
    assert f"{BUG} applies" in msg and "off by OUTOFCUDA_KNOWN_BUGS: torch's choice kept; fixed in " \
        "torch 2.15.0" in msg
    assert "tf32-mixed-api applies" in msg and "outofcuda's own settings avoid it" in msg
    for named in ("fsdp2-bf16-premul-sum", "avg-pool2d-channels-last-grad"):
        assert f"{named} applies" in msg
    assert "fix: use a reduce_dtype of float32" in msg and "issues/190745" in msg
    # Only the tf32 row off: healthy.
    r = cuda_venv.run(None, args=("-m", "outofcuda", "doctor", "--json"),
                      env=nvml("9.0", OUTOFCUDA_KNOWN_BUGS="tf32-mixed-api"), cwd=workdir,
                      timeout=300)
    (check,) = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "known_bugs"]
    assert check["ok"] is True and "outofcuda avoids it" in check["message"], check
