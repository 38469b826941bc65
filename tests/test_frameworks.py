"""Frameworks that manage GPU memory themselves (vLLM, SGLang,
torch_memory_saver; src/frameworks.c) and the allocator default, on the
stand-in torch releases (tests/fake_torch.py) with stand-in framework
packages (tests/fake_frameworks.py). The same checks on the real CUDA build
of torch 2.14.1, and once with the real vllm wheel, are in
tests/test_cuda_build.py."""
import os
import shutil
import subprocess

import pytest

from fake_frameworks import FILES, TMS_PRELOAD, make_fake_framework
from fake_torch import RELEASES
from test_gating import REPORT, names, run_release

SETTERS = ("_accelerator_setAllocatorSettings", "_cuda_cudaCachingAllocator_set_allocator_settings")
DEFAULTS = "garbage_collection_threshold:0.8,expandable_segments:True"


def with_frameworks(tmp_path, env=None):
    fw = tmp_path / "fw"
    for name in FILES:
        make_fake_framework(fw, name)
    full = {"PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{fw}"}
    full.update(env or {})
    return full


def setter_calls(rep):
    return [c[1] for c in rep["calls"] if c[0] in SETTERS]


def fractions(rep):
    return [c for c in rep["calls"] if c[0] == "_cuda_setMemoryFraction"]


# ---- the default: no max_split_size_mb beside expandable segments ----

@pytest.mark.parametrize("release", sorted(RELEASES))
def test_default_never_pairs_max_split_with_expandable_segments(venv, tmp_path, release):
    rep, _ = run_release(venv, tmp_path, release)
    conf = rep["conf_read"]
    if "expandable_segments" in RELEASES[release]["keys"]:
        assert conf == DEFAULTS
    else:  # 2.0: no expandable segments, so max_split_size_mb:128 applies
        assert conf == "garbage_collection_threshold:0.8,max_split_size_mb:128"


@pytest.mark.parametrize("user,expected", [
    # expandable segments off by the user's choice: max_split_size_mb:128 joins
    ("expandable_segments:False",
     "expandable_segments:False,garbage_collection_threshold:0.8,max_split_size_mb:128"),
    # the user's max_split_size_mb gets no expandable segments beside it
    ("max_split_size_mb:512", "max_split_size_mb:512,garbage_collection_threshold:0.8"),
    # a combination the user wrote is kept
    ("max_split_size_mb:512,expandable_segments:True",
     "max_split_size_mb:512,expandable_segments:True,garbage_collection_threshold:0.8"),
])
def test_max_split_only_where_expandable_segments_are_off(venv, tmp_path, user, expected):
    rep, _ = run_release(venv, tmp_path, "2.14.1", env={"PYTORCH_CUDA_ALLOC_CONF": user})
    assert rep["conf_read"] == expected
    notes = rep["status"]["optimizations"]["allocator"]["notes"]
    assert ("expandable_held_back" in notes) == (user == "max_split_size_mb:512"), notes


def test_own_alloc_conf_replaces_every_default(venv, tmp_path):
    own = "max_split_size_mb:256,expandable_segments:True"
    rep, _ = run_release(venv, tmp_path, "2.14.1", env={"OUTOFCUDA_ALLOC_CONF": own})
    assert rep["conf_read"] == own
    rep, _ = run_release(venv, tmp_path / "b", "2.14.1",
                         env={"OUTOFCUDA_ALLOC_CONF": "expandable_segments:False"})
    assert rep["conf_read"] == "expandable_segments:False"  # no max_split_size_mb added


@pytest.mark.parametrize("release,fraction,idle", [("2.14.1", "1", True), ("2.14.1", "0.9", False),
                                                   ("2.4.1", "1", False)])
def test_status_says_when_gc_threshold_cannot_act(venv, tmp_path, release, fraction, idle):
    # From 2.11 a fraction of 1 leaves torch's allocator without a limit, and
    # it collects cached blocks only under one; before, any fraction set one.
    rep, _ = run_release(venv, tmp_path, release, env={"OUTOFCUDA_MEMORY_FRACTION": fraction})
    notes = rep["status"]["optimizations"]["allocator"]["notes"]
    assert ("gc_threshold_idle" in notes) == idle, notes


# ---- frameworks imported before torch: their import imports torch ----

@pytest.mark.parametrize("release", ["2.0.1", "2.9.1", "2.14.1"])
@pytest.mark.parametrize("framework", sorted(FILES))
def test_framework_importing_torch_keeps_allocator_and_fraction(venv, tmp_path, release,
                                                                framework):
    env = with_frameworks(tmp_path, {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"})
    rep, r = run_release(venv, tmp_path, release, env=env, code=f"import {framework}\n" + REPORT)
    assert r.stderr == ""
    # The variable was never written: torch read the user's own value.
    assert rep["env_at_load"]["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.6"
    assert rep["conf_read"] == "garbage_collection_threshold:0.6"
    assert setter_calls(rep) == [] and fractions(rep) == []
    opts = rep["status"]["optimizations"]
    assert not opts["allocator"]["applied"] and not opts["memory_fraction"]["applied"]
    for entry in (opts["allocator"], opts["memory_fraction"]):
        assert (entry["state"], entry["code"]) == ("skipped", "framework"), entry
    # Which framework, by name, and the evidence for it.
    fw = rep["status"]["framework"]
    assert (fw["left_to"].lower(), fw["at_import"]) == (framework.lower(), "left_to"), fw
    assert fw["evidence"].startswith("https://"), fw
    assert opts["tf32"]["applied"]  # the rest is not the framework's


def test_torch_memory_saver_through_ld_preload(venv, tmp_path):
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build a stand-in preload library")
    lib = tmp_path / TMS_PRELOAD
    src = tmp_path / "empty.c"
    src.write_text("int outofcuda_test_preload;\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    rep, r = run_release(venv, tmp_path, "2.14.1", env={"LD_PRELOAD": str(lib)})
    assert r.stderr == ""
    assert rep["conf_read"] == "" and setter_calls(rep) == [] and fractions(rep) == []
    fw = rep["status"]["framework"]
    assert fw["left_to"] == fw["in_use_now"] == "torch_memory_saver" and fw["code"] == "left_to"


# ---- frameworks imported after torch: found again when CUDA initialises ----

def after(framework):
    """torch first, then the framework, then CUDA."""
    return f"import torch\nimport {framework}\n" + REPORT


@pytest.mark.parametrize("release,user,handed", [
    # outofcuda turned expandable segments on: off again, then the user's string
    ("2.14.1", None, ["expandable_segments:False", ""]),
    ("2.14.1", "garbage_collection_threshold:0.6",
     ["expandable_segments:False", "garbage_collection_threshold:0.6"]),
    ("2.14.1", "expandable_segments:True", ["expandable_segments:True"]),
    ("2.9.1", None, ["expandable_segments:False", ""]),
    ("2.0.1", None, [""]),                    # no expandable segments to undo
])
def test_framework_imported_after_torch_gets_the_users_allocator(venv, tmp_path, release, user,
                                                                handed):
    env = with_frameworks(tmp_path, {"PYTORCH_CUDA_ALLOC_CONF": user})
    rep, r = run_release(venv, tmp_path, release, env=env, code=after("vllm"))
    assert r.stderr == ""
    calls = setter_calls(rep)
    assert calls[1:] == handed  # calls[0]: outofcuda's merge, handed over at import
    assert rep["conf_read"] == (user or "")
    assert fractions(rep) == []
    opts = rep["status"]["optimizations"]
    assert not opts["allocator"]["applied"] and opts["allocator"]["code"] == "handed_back"
    assert opts["memory_fraction"]["code"] == "framework"
    fw = rep["status"]["framework"]
    assert (fw["left_to"], fw["at_import"], fw["at_cuda_init"]) == ("vLLM", "none", "left_to")
    assert rep["status"]["hook"]["error"] is None


# ---- a plain process, and the expert's override ----

def test_installed_but_unused_framework_changes_nothing(venv, tmp_path):
    env = with_frameworks(tmp_path)
    rep, _ = run_release(venv, tmp_path, "2.14.1", env=env)
    assert rep["conf_read"] == DEFAULTS
    assert len(fractions(rep)) == 1
    assert rep["status"]["optimizations"]["allocator"]["applied"]


@pytest.mark.parametrize("code", ["import vllm\n" + REPORT, after("sglang")])
def test_override_applies_outofcuda_beside_a_framework(venv, tmp_path, code):
    env = with_frameworks(tmp_path, {"OUTOFCUDA_FRAMEWORK_OVERRIDE": "1"})
    rep, _ = run_release(venv, tmp_path, "2.14.1", env=env, code=code)
    assert rep["conf_read"] == DEFAULTS
    assert len(fractions(rep)) == 1
    opts = rep["status"]["optimizations"]
    assert opts["allocator"]["applied"] and opts["memory_fraction"]["applied"]
    fw = rep["status"]["framework"]
    assert fw["left_to"] is None and fw["code"] == "override", fw
    assert fw["at_import"] == ("override" if code.startswith("import vllm") else "none")


# ---- decided by what is true when it matters ----

def test_a_framework_whose_import_failed_is_not_in_use(venv, tmp_path):
    # A vLLM built for another torch: vllm/__init__.py imports torch, then
    # raises ImportError, and vllm is gone from sys.modules.
    env = with_frameworks(tmp_path)
    init = tmp_path / "fw" / "vllm" / "__init__.py"
    init.write_text(init.read_text() + "raise ImportError('vllm built for torch 2.14.0')\n")
    code = "try:\n    import vllm\nexcept ImportError:\n    pass\n" + REPORT
    rep, r = run_release(venv, tmp_path, "2.14.1", env=env, code=code)
    assert r.stderr == ""
    assert rep["conf_read"] == DEFAULTS
    assert setter_calls(rep) == [DEFAULTS] and len(fractions(rep)) == 1
    st = rep["status"]
    opts = st["optimizations"]
    assert opts["allocator"]["applied"] and opts["memory_fraction"]["applied"]
    assert opts["allocator"]["code"] == "framework_left"
    assert opts["memory_fraction"]["code"] == "at_cuda_init"
    assert st["framework"] == {"left_to": None, "in_use_now": None, "at_import": "left_to",
                               "at_cuda_init": "gone_at_cuda_init", "code": "gone_at_cuda_init",
                               "evidence": None}
    assert st["hook"]["error"] is None


def test_a_framework_still_in_use_when_cuda_starts_keeps_everything(venv, tmp_path):
    env = with_frameworks(tmp_path)
    rep, _ = run_release(venv, tmp_path, "2.14.1", env=env, code="import vllm\n" + REPORT)
    assert setter_calls(rep) == [] and fractions(rep) == []
    fw = rep["status"]["framework"]
    assert fw["left_to"] == "vLLM" and fw["in_use_now"] == "vLLM"
    assert (fw["at_import"], fw["at_cuda_init"]) == ("left_to", "left_to"), fw


def test_preload_matched_by_the_library_file_name(venv, tmp_path):
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build a stand-in preload library")
    folder = tmp_path / "not_torch_memory_saver_tools"
    folder.mkdir()
    src = tmp_path / "empty.c"
    src.write_text("int outofcuda_test_preload;\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "libfoo.so"), str(src)],
                   check=True)
    rep, r = run_release(venv, tmp_path, "2.14.1", env={"LD_PRELOAD": str(folder / "libfoo.so")})
    assert r.stderr == ""
    assert rep["conf_read"] == DEFAULTS and len(fractions(rep)) == 1
    assert rep["status"]["framework"]["in_use_now"] is None


def test_a_framework_imported_after_cuda_started_is_named(venv, tmp_path):
    env = with_frameworks(tmp_path)
    code = REPORT.replace("torch.cuda._fake_cuda_init()", "torch.cuda._fake_cuda_init()\nimport sglang")
    rep, _ = run_release(venv, tmp_path, "2.14.1", env=env, code=code)
    assert len(fractions(rep)) == 1                  # already in effect before it came
    fw = rep["status"]["framework"]
    assert fw["in_use_now"] == "SGLang" and fw["left_to"] is None
    # imported after CUDA started: none was in use then
    assert (fw["at_import"], fw["at_cuda_init"]) == ("none", "none"), fw
