"""Release gating: the hook against stand-ins of CUDA builds of torch 2.0 ...
newest (tests/fake_torch.py holds the table of names, keys and warnings per
release). Each run is `python -W error`, so any deprecated or warning call fails."""
import json
import runpy
from pathlib import Path

import pytest

from fake_torch import RELEASES, make_fake_torch
from kit import assert_records, last_json

ACCEL = "_accelerator_setAllocatorSettings"

REPORT = """
import json, os, torch, _outofcuda
torch.cuda._fake_cuda_init()
print('REPORT=' + json.dumps({
    'calls': [list(map(str, c)) for c in torch._C.calls],
    'env_at_load': torch._C.ENV_AT_LOAD,
    'env_now': {k: os.environ.get(k) for k in torch._C.ENV_AT_LOAD},
    'conf_read': torch._alloc_conf(),
    'status': _outofcuda.status(),
}))
"""


def run_release(venv, tmp_path, release, env=None, cuda=True, code=REPORT, args=()):
    root = make_fake_torch(tmp_path / "fake", release, cuda=cuda)
    full_env = {"PYTHONPATH": str(root)}
    full_env.update(env or {})
    r = venv.run(code, env=full_env, args=("-W", "error", *args), cwd=tmp_path)
    return last_json(r, "REPORT="), r


def setter_configures(release):
    """From 2.9 the allocator string goes to torch's runtime setter (the CUDA
    one up to 2.9.x, the accelerator one from 2.10) and the variable is never
    written; before, it is written while torch imports."""
    return tuple(int(x) for x in release.split(".")[:2]) >= (2, 9)


def names(report):
    return [c[0] for c in report["calls"]]


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_every_release_applies_without_warning(venv, tmp_path, release):
    rep, r = run_release(venv, tmp_path, release, env={"OUTOFCUDA_AMP_DTYPE": "bfloat16",
                                                       "LOCAL_RANK": "2"})
    assert r.stderr == ""
    st = rep["status"]
    assert st["hook"]["error"] is None
    opts = st["optimizations"]
    assert_records(opts)
    called = names(rep)
    # TF32 through the legacy setter, never only the new API, once CUDA
    # started and the program had chosen no precision.
    assert ["_set_cublas_allow_tf32", "True"] in rep["calls"]
    assert (opts["tf32"]["state"], opts["tf32"]["code"]) == ("applied", "at_cuda_init")
    assert opts["tf32"]["now"] == {"matmul": True}
    assert ["_set_cudnn_benchmark", "True"] in rep["calls"]
    # torch's defaults are not written again: cuDNN TF32 and the SDPA backends.
    assert not {"_set_cudnn_allow_tf32", "_set_sdp_use_flash", "_set_sdp_use_mem_efficient",
                "_set_sdp_use_math", "_set_sdp_use_cudnn"} & set(called)
    assert (opts["sdpa"]["state"], opts["sdpa"]["code"]) == ("skipped", "torch_default")
    assert opts["sdpa"]["now"] == {"flash": True, "mem_efficient": True, "math": True}
    # Autocast dtype through the release's own API.
    if RELEASES[release]["autocast_new"]:
        assert ["set_autocast_dtype", "cuda", "torch.bfloat16"] in rep["calls"]
        assert "set_autocast_gpu_dtype" not in called
    else:
        assert ["set_autocast_gpu_dtype", "torch.bfloat16"] in rep["calls"]
    # Memory fraction: queued, applied at CUDA init to LOCAL_RANK's device only.
    fractions = [c for c in rep["calls"] if c[0] == "_cuda_setMemoryFraction"]
    assert fractions == [["_cuda_setMemoryFraction", "0.95", "2"]]
    assert opts["memory_fraction"]["value"] == {"fraction": 0.95, "device": 2}
    # Allocator: set before torch loaded, in the variable this release reads,
    # with only keys it accepts.
    conf = rep["conf_read"]
    assert opts["allocator"]["applied"] and conf == opts["allocator"]["value"]
    keys = {item.split(":")[0] for item in conf.split(",")}
    assert keys <= RELEASES[release]["keys"]
    assert "garbage_collection_threshold" in keys
    # max_split_size_mb only where expandable segments are not (pytorch issue 123548)
    expandable = "expandable_segments" in RELEASES[release]["keys"]
    assert ("expandable_segments" in keys) == expandable
    assert ("max_split_size_mb" in keys) == (not expandable)
    # Handed to the release's runtime setter; from 2.9 the environment is
    # never written, before that it holds the
    # string while torch's libraries load and is given back afterwards: the
    # configuration holds it, children inherit the user's environment.
    written = rep["env_at_load"][RELEASES[release]["env"][-1]]
    assert written == (None if setter_configures(release) else conf)
    setter = [c for c in rep["calls"] if c[0] in ("_accelerator_setAllocatorSettings",
                                                  "_cuda_cudaCachingAllocator_set_allocator_settings")]
    legacy = "_cuda_cudaCachingAllocator_set_allocator_settings" in RELEASES[release]["c"]
    assert setter == [[("_cuda_cudaCachingAllocator_set_allocator_settings" if legacy
                        else "_accelerator_setAllocatorSettings"), conf]]
    assert set(rep["env_now"].values()) == {None}


@pytest.mark.parametrize("release", ["2.9.0", "2.9.1", "2.14.1"])
def test_the_legacy_precision_getters_are_never_read_where_the_new_api_exists(
        venv, tmp_path, release):
    # 2.9.0 warns on them (-W error turns that into a failure); on every 2.9+
    # they raise once a program mixed the two APIs.
    rep, _ = run_release(venv, tmp_path, release)
    assert not {"_get_cublas_allow_tf32", "_get_float32_matmul_precision",
                "_get_cudnn_allow_tf32"} & set(names(rep))
    assert ["_get_fp32_precision_getter", "cuda", "matmul"] in rep["calls"]


@pytest.mark.parametrize("release,var", [("2.4.1", "PYTORCH_CUDA_ALLOC_CONF"),
                                         ("2.11.0", "PYTORCH_ALLOC_CONF"),
                                         ("2.14.1", "PYTORCH_CUDA_ALLOC_CONF")])
def test_user_allocator_keys_win(venv, tmp_path, release, var):
    user = "max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2,>:4]"
    rep, _ = run_release(venv, tmp_path, release, env={var: user})
    conf = rep["conf_read"]
    assert conf.startswith(user)                       # the user's keys, untouched
    assert conf.count("max_split_size_mb") == 1
    assert "garbage_collection_threshold:0.8" in conf  # outofcuda's default fills the gap
    assert "expandable_segments" not in conf           # not beside the user's max_split_size_mb
    assert rep["env_at_load"][var] == (user if setter_configures(release) else conf)
    assert rep["env_now"][var] == user                 # given back as the user set it
    alloc = rep["status"]["optimizations"]["allocator"]
    assert alloc["code"] == ("runtime_setter" if setter_configures(release) else "env_written")
    assert "user_keys_kept" in alloc["notes"]


@pytest.mark.parametrize("release", ["2.4.1", "2.14.1"])
def test_an_empty_variable_counts_as_set(venv, tmp_path, release):
    # torch >= 2.11 stops at the first variable that is set, empty or not; up
    # to 2.10 only PYTORCH_CUDA_ALLOC_CONF is read.
    rep, _ = run_release(venv, tmp_path, release, env={"PYTORCH_CUDA_ALLOC_CONF": ""})
    opts = rep["status"]["optimizations"]
    assert opts["allocator"]["applied"]
    assert rep["conf_read"] == opts["allocator"]["value"]
    assert rep["env_at_load"]["PYTORCH_CUDA_ALLOC_CONF"] == (
        "" if release == "2.14.1" else rep["conf_read"])
    assert rep["env_now"]["PYTORCH_CUDA_ALLOC_CONF"] == ""
    assert rep["env_at_load"]["PYTORCH_ALLOC_CONF"] is None


@pytest.mark.parametrize("release", ["2.4.1", "2.14.1"])
@pytest.mark.parametrize("env", [
    {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},   # the user's choice of backend
    {"OUTOFCUDA_ALLOC_CONF": "backend:cudaMallocAsync,max_split_size_mb:128"},
])
def test_cuda_malloc_async_gets_no_native_keys(venv, tmp_path, release, env):
    rep, r = run_release(venv, tmp_path, release, env=env)
    assert r.stderr == ""                              # torch warns about native keys beside it
    assert rep["conf_read"] == "backend:cudaMallocAsync"
    alloc = rep["status"]["optimizations"]["allocator"]
    # The keys left out beside cudaMallocAsync are named.
    assert "native_keys_left_out" in alloc["notes"] and "max_split_size_mb" in alloc["left_out"]


def test_unknown_keys_are_left_out_and_named(venv, tmp_path):
    rep, _ = run_release(venv, tmp_path, "2.4.1",
                         env={"OUTOFCUDA_ALLOC_CONF": "per_process_memory_fraction:0.5,backend:native"})
    assert rep["conf_read"] == "backend:native"
    alloc = rep["status"]["optimizations"]["allocator"]
    assert "unknown_keys_left_out" in alloc["notes"]
    assert alloc["left_out"] == ["per_process_memory_fraction"], alloc


def test_malformed_user_variable_is_left_whole(venv, tmp_path):
    rep, _ = run_release(venv, tmp_path, "2.4.1", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments"},
                         code=REPORT.replace("import json, os, torch", "import json, os\ntry:\n import torch\nexcept RuntimeError: raise SystemExit(3)\nimport torch"))
    assert rep["env_at_load"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments"
    alloc = rep["status"]["optimizations"]["allocator"]
    assert not alloc["applied"]
    assert (alloc["state"], alloc["code"]) == ("skipped", "not_understood")


def test_cpu_build_changes_nothing_readable(venv, tmp_path):
    # Every flag a CPU-only build has (cuDNN and SDPA included) stays torch's
    # default: libraries and users' tests read them.
    rep, _ = run_release(venv, tmp_path, "2.14.1", cuda=False)
    assert [c for c in rep["calls"] if c[0] != "_get_cudnn_benchmark"] == []
    assert rep["env_at_load"] == {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_HIP_ALLOC_CONF": None,
                                  "PYTORCH_ALLOC_CONF": None}
    assert set(rep["env_now"].values()) == {None}
    opts = rep["status"]["optimizations"]
    assert_records(opts)
    for name in ("tf32", "cudnn_benchmark", "cudnn_deterministic", "sdpa", "allocator"):
        assert not opts[name]["applied"], name
        assert (opts[name]["state"], opts[name]["code"]) == ("skipped", "no_cuda"), name


def test_tf32_override_and_off_switch_are_respected(venv, tmp_path):
    rep, _ = run_release(venv, tmp_path, "2.14.1", env={"NVIDIA_TF32_OVERRIDE": "0"})
    assert "_set_cublas_allow_tf32" not in names(rep)
    assert rep["status"]["optimizations"]["tf32"]["code"] == "tf32_override"
    rep, _ = run_release(venv, tmp_path / "b", "2.14.1", env={"OUTOFCUDA_TF32": "0"})
    assert not {"_set_cublas_allow_tf32", "_set_cudnn_allow_tf32"} & set(names(rep))
    assert rep["status"]["optimizations"]["tf32"]["off_by"] == "OUTOFCUDA_TF32"
    assert rep["status"]["optimizations"]["tf32"]["code"] == "off"


LATE = """
import sys
sys.path.append({site!r})
import json, torch
torch.backends.disable_global_flags()
import _outofcuda
_outofcuda.install()                               # torch already imported: applies at once
print('REPORT=' + json.dumps({{'calls': [list(map(str, c)) for c in torch._C.calls],
                               'status': _outofcuda.status()}}))
"""


def test_frozen_flags_are_respected(venv, tmp_path):
    # disable_global_flags() can only come before outofcuda's callback when
    # the hook installs after torch (python -S, then install()).
    rep, _ = run_release(venv, tmp_path, "2.14.1", args=("-S",),
                         code=LATE.format(site=str(venv.site)))
    called = names(rep)
    assert not {"_set_cublas_allow_tf32", "_set_cudnn_allow_tf32", "_set_cudnn_benchmark"} & set(called)
    opts = rep["status"]["optimizations"]
    for name in ("tf32", "cudnn_benchmark"):
        assert (opts[name]["state"], opts[name]["code"]) == ("skipped", "flags_frozen"), name
    # Only the frozen flags are left: the memory fraction is still queued.
    assert opts["memory_fraction"]["queued"] and not opts["memory_fraction"]["applied"]


def test_a_failing_setter_is_one_warning_and_torch_still_imports(venv, tmp_path):
    code = """
import torch._C as C
def broken(flag):
    raise RuntimeError("cudnn setter exploded")
C._set_cudnn_benchmark = broken
""" 
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    # Make the setter fail inside the real import: patch _C before torch/__init__ finishes.
    init = root / "torch" / "__init__.py"
    init.write_text(init.read_text().replace("from torch import _C\n", "from torch import _C\n" + code.replace("import torch._C as C\n", "C = _C\n")))
    r = venv.run("import torch, json, _outofcuda\nprint('ok', json.dumps(_outofcuda.status()['hook']))",
                 env={"PYTHONPATH": str(root)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok")
    hook = json.loads(r.stdout.split("ok ", 1)[1])
    assert "cudnn setter exploded" in hook["error"]
    assert r.stderr.count("UserWarning") == 1 and "cudnn setter exploded" in r.stderr


CHILD = """
import json, os, subprocess, sys, torch, _outofcuda
child = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps("
                        "{k: v for k, v in os.environ.items() if k.endswith('ALLOC_CONF')}))"],
                       capture_output=True, text=True, check=True)
print('REPORT=' + json.dumps({'child': json.loads(child.stdout), 'conf_read': torch._alloc_conf()}))
"""


@pytest.mark.parametrize("env", [{}, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
                                 {"PYTORCH_ALLOC_CONF": ""}])
def test_children_inherit_the_users_allocator_environment(venv, tmp_path, env):
    rep, _ = run_release(venv, tmp_path, "2.14.1", env=env, code=CHILD)
    assert rep["child"] == env
    assert "garbage_collection_threshold:0.8" in rep["conf_read"]


RETRY = """
import json, sys, torch_paths
try:
    import torch
except RuntimeError:
    pass
sys.path.remove(torch_paths.BROKEN)
for name in [n for n in sys.modules if n.startswith("torch.")]:
    del sys.modules[name]                          # the broken copy's submodules
import torch, _outofcuda
torch.cuda._fake_cuda_init()
print('REPORT=' + json.dumps({'status': _outofcuda.status(), 'conf_read': torch._alloc_conf(),
                             'version': torch.__version__}))
"""


def test_a_retried_import_reads_the_good_torchs_facts(venv, tmp_path):
    # A broken copy first on the path (here a CPU-only 2.4.1 whose __init__
    # raises), then the real one: outofcuda must judge the one that imported.
    broken = make_fake_torch(tmp_path / "broken", "2.4.1", cuda=False)
    init = broken / "torch" / "__init__.py"
    init.write_text(init.read_text() + "\nraise RuntimeError('broken copy')\n")
    good = make_fake_torch(tmp_path / "good", "2.14.1")
    (tmp_path / "torch_paths.py").write_text(f"BROKEN = {str(broken)!r}\n")
    r = venv.run(RETRY, env={"PYTHONPATH": f"{broken}:{good}:{tmp_path}"}, args=("-W", "error"),
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rep = last_json(r, "REPORT=")
    opts = rep["status"]["optimizations"]
    assert rep["version"] == "2.14.1"
    assert opts["tf32"]["applied"] and opts["memory_fraction"]["applied"]
    assert opts["allocator"]["applied"] and opts["allocator"]["code"] == "runtime_setter"
    assert opts["allocator"]["variable"] == "PYTORCH_ALLOC_CONF"  # the variable read
    assert rep["conf_read"] == opts["allocator"]["value"]


AHEAD = """
import importlib.machinery, json, sys
class Ahead:
    # A finder placed before outofcuda's after it installed (lazy importers,
    # editable installs and vendoring tools do this).
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.PathFinder.find_spec(name, path) if name == "torch" else None
sys.meta_path.insert(0, Ahead())
import torch, _outofcuda
print('REPORT=' + json.dumps(_outofcuda.status()))
"""


def test_status_says_when_another_finder_loaded_torch(venv, tmp_path):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    r = venv.run(AHEAD, env={"PYTHONPATH": str(root)}, args=("-W", "error"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    st = last_json(r, "REPORT=")
    assert st["hook"]["installed"] and not st["hook"]["fired"]
    assert_records(st["optimizations"])
    for name, e in st["optimizations"].items():
        assert (e["state"], e["code"]) == ("pending", "import_bypassed"), (name, e)


def test_bridge_has_no_branch_the_build_never_compiles():
    # outofcuda targets Linux (pyproject classifiers; dlopen, pthreads): a Windows branch
    # in the bridge is never compiled, so never tested.
    src = (Path(__file__).resolve().parent.parent / "src" / "bridge.c").read_text()
    assert "_WIN32" not in src


def test_a_variable_torch_removed_itself_is_no_error(venv, tmp_path):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    init = root / "torch" / "__init__.py"
    init.write_text(init.read_text() + "\nos.environ.pop('PYTORCH_ALLOC_CONF', None)\n")
    r = venv.run("import torch, _outofcuda, os\n"
                 "print(_outofcuda.status()['hook']['error'], os.environ.get('PYTORCH_ALLOC_CONF'))",
                 env={"PYTHONPATH": str(root)}, args=("-W", "error"), cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.split() == ["None", "None"]


def test_a_torch_without_the_cuda_init_queue_says_why_in_each_step(venv, tmp_path):
    """No torch.cuda._lazy_call: nothing can run when CUDA starts, and every step
    that would have waited for it gives that one code; the words reach stderr."""
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    cuda = root / "torch" / "cuda" / "__init__.py"
    cuda.write_text(cuda.read_text().replace("def _lazy_call(", "def _not_lazy_call("))
    r = venv.run("import torch, json, sys, _outofcuda\nprint(json.dumps(dict(_outofcuda.status(), "
                 "own_hooks=sys.excepthook is sys.__excepthook__)))",
                 env={"PYTHONPATH": str(root), "OUTOFCUDA_OOM_SNAPSHOT": str(tmp_path / "s.pickle")},
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    opts = json.loads(r.stdout)["optimizations"]
    assert json.loads(r.stdout)["own_hooks"]  # Python's exception hooks left alone
    why = "this torch has no torch.cuda._lazy_call"
    for name in ("tf32", "memory_fraction", "oom_handler"):
        assert (opts[name]["state"], opts[name]["code"]) == ("skipped", "no_queue"), opts[name]
        assert not opts[name]["applied"] and opts[name]["notes"] == [], opts[name]
    assert f"no snapshot can be written ({why})" in r.stderr


# ---- the user's own memory fraction (torch's allocator key) ----

FRACTION_KEY = sorted(r for r in RELEASES if "per_process_memory_fraction" in RELEASES[r]["keys"])


@pytest.mark.parametrize("release", FRACTION_KEY)
@pytest.mark.parametrize("var", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
@pytest.mark.parametrize("ours", [None, "1"])
def test_the_users_per_process_memory_fraction_wins(venv, tmp_path, release, var, ours):
    # torch applies the key when CUDA initialises, before the lazy-init queue
    # runs: a fraction set from the queue would overwrite it (0.95, or no cap
    # at all with OUTOFCUDA_MEMORY_FRACTION=1).
    rep, r = run_release(venv, tmp_path, release, env={
        var: "per_process_memory_fraction:0.5", "OUTOFCUDA_MEMORY_FRACTION": ours})
    assert r.stderr == ""
    assert "per_process_memory_fraction:0.5" in rep["conf_read"]
    assert "_cuda_setMemoryFraction" not in names(rep)
    opts = rep["status"]["optimizations"]
    assert not opts["memory_fraction"]["applied"]
    assert opts["memory_fraction"]["code"] == "program_chose"
    # Which variable holds the user's fraction, and its value.
    assert (opts["memory_fraction"]["variable"], opts["memory_fraction"]["chosen"]) == (var, 0.5)
    assert opts["allocator"]["applied"] and "user_keys_kept" in opts["allocator"]["notes"]
    assert rep["status"]["hook"]["error"] is None


@pytest.mark.parametrize("release", FRACTION_KEY)
def test_a_fraction_the_program_gives_torch_before_cuda_starts_wins(venv, tmp_path, release):
    # Through the runtime setter after import, on releases with the settings
    # getter (2.12+) and without it (2.10, 2.11): the fraction torch's
    # allocator took when it started is read at CUDA's start.
    code = REPORT.replace("torch.cuda._fake_cuda_init()",
                          "torch._C._accelerator_setAllocatorSettings("
                          "'per_process_memory_fraction:0.25')\ntorch.cuda._fake_cuda_init()")
    rep, r = run_release(venv, tmp_path, release, code=code)
    assert r.stderr == ""
    assert "_cuda_setMemoryFraction" not in names(rep)
    frac = rep["status"]["optimizations"]["memory_fraction"]
    assert (frac["state"], frac["code"]) == ("skipped", "program_chose"), frac
    assert frac["chosen"] == 0.25 and frac["variable"] is None, frac


def test_outofcuda_s_own_fraction_is_not_taken_for_the_program_s(venv, tmp_path):
    # A Ctrl-C inside torch's setter after it set outofcuda's fraction: the
    # step runs again when torch runs its queue again, and the fraction torch
    # holds then is outofcuda's own, not one the program chose.
    code = REPORT.replace("torch.cuda._fake_cuda_init()", """
C = torch._C
real = C._cuda_setMemoryFraction
def cut_short(fraction, device):
    real(fraction, device)
    C._cuda_setMemoryFraction = real
    raise KeyboardInterrupt
C._cuda_setMemoryFraction = cut_short
try:
    torch.cuda._fake_cuda_init()
except KeyboardInterrupt:
    pass
torch.cuda._fake_cuda_init()""")
    rep, r = run_release(venv, tmp_path, "2.11.0", code=code)
    frac = rep["status"]["optimizations"]["memory_fraction"]
    assert (frac["state"], frac["code"]) == ("applied", "at_cuda_init"), frac


# ---- children spawned while torch imports ----

# Every import inside `import torch` passes this audit hook, on the importing
# thread: what it sees in the environment is what a child spawned then (a
# thread's subprocess.run) would inherit.
WATCH_ENV = """
import os, sys
SEEN_WHILE_IMPORTING = set()
def _watch(event, args):
    if event == "import":
        for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            if os.environ.get(k) is not None:
                SEEN_WHILE_IMPORTING.add(k + "=" + os.environ[k])
sys.addaudithook(_watch)
"""


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_environment_is_never_written_where_a_runtime_setter_configures(venv, tmp_path,
                                                                            release):
    code = WATCH_ENV + REPORT.replace("'status':", "'seen': sorted(SEEN_WHILE_IMPORTING), 'status':")
    rep, r = run_release(venv, tmp_path, release, code=code)
    assert r.stderr == ""
    alloc = rep["status"]["optimizations"]["allocator"]
    assert alloc["applied"] and rep["conf_read"] == alloc["value"]
    if setter_configures(release):
        assert rep["seen"] == [], rep["seen"]
        assert alloc["code"] == "runtime_setter"
    else:
        # Before 2.9 the variable holds the string while torch imports (the
        # window the README names), and is given back right after.
        assert rep["seen"] == [f"PYTORCH_CUDA_ALLOC_CONF={alloc['value']}"]
        assert alloc["code"] == "env_written"
        assert "restored_for_children" in alloc["notes"]
    assert set(rep["env_now"].values()) == {None}


def test_a_backend_outofcuda_adds_is_written_for_the_import_alone(venv, tmp_path):
    # `backend` is read only while torch's libraries load.
    code = WATCH_ENV + REPORT.replace("'status':", "'seen': sorted(SEEN_WHILE_IMPORTING), 'status':")
    rep, _ = run_release(venv, tmp_path, "2.14.1", code=code,
                         env={"OUTOFCUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert rep["env_at_load"]["PYTORCH_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert rep["seen"] == ["PYTORCH_ALLOC_CONF=backend:cudaMallocAsync"]
    assert set(rep["env_now"].values()) == {None}


def test_a_failing_lazy_call_leaves_nothing_saying_queued(venv, tmp_path):
    root = make_fake_torch(tmp_path / "fake", "2.14.1")
    cuda = root / "torch" / "cuda" / "__init__.py"
    cuda.write_text(cuda.read_text().replace(
        "def _lazy_call(callable, **kwargs):\n",
        "def _lazy_call(callable, **kwargs):\n    raise RuntimeError('queue refused')\n"))
    r = venv.run("import json, torch, _outofcuda\nprint(json.dumps(_outofcuda.status()))",
                 env={"PYTHONPATH": str(root)}, cwd=tmp_path)
    st = last_json(r)
    opts = st["optimizations"]
    for name in ("tf32", "memory_fraction", "oom_handler"):
        assert not opts[name]["applied"] and not opts[name].get("queued"), (name, opts[name])
        assert (opts[name]["state"], opts[name]["code"]) == ("failed", "queue_failed"), opts[name]
    assert "queue refused" in st["hook"]["error"]


# ---- off values: every setting's off word leaves torch's own default ----

OFF_STEPS = {"tf32": "OUTOFCUDA_TF32", "cudnn_benchmark": "OUTOFCUDA_CUDNN_BENCHMARK",
             "cudnn_deterministic": "OUTOFCUDA_CUDNN_DETERMINISTIC",
             "allocator": "OUTOFCUDA_ALLOC_CONF", "memory_fraction": "OUTOFCUDA_MEMORY_FRACTION",
             "amp_dtype": "OUTOFCUDA_AMP_DTYPE"}
OFF_REPORT = REPORT.replace("'status': _outofcuda.status(),",
                            "'status': _outofcuda.status(), 'autocast': "
                            "_outofcuda._api_autocast_dtype('cuda'), 'plan': "
                            "_outofcuda._api_loader_plan(False, 2),")


@pytest.mark.parametrize("word", ["0", "off", " None "])
@pytest.mark.parametrize("cuda", [True, False])
def test_an_off_word_turns_each_step_off_and_status_says_by_what(venv, tmp_path, word, cuda):
    """The same off word for every setting: no warning, nothing of outofcuda's
    reaches torch (no allocator string, no fraction, no flag, no dtype), and
    status() names the variable in each step's off_by, before any other
    reason (a CPU build's "no CUDA" included); the verbose table says "off"."""
    env = {name: word for name in OFF_STEPS.values()}
    env.update({"OUTOFCUDA_PREFETCH_FACTOR": word, "OUTOFCUDA_OOM_SNAPSHOT": word,
                "OUTOFCUDA_COMPILE_MODE": word, "OUTOFCUDA_VERBOSE": "1"})
    rep, r = run_release(venv, tmp_path, "2.14.1", env=env, cuda=cuda, code=OFF_REPORT)
    assert "Warning" not in r.stderr, r.stderr
    st = rep["status"]
    assert st["config_warnings"] == [] and st["hook"]["error"] is None
    opts = st["optimizations"]
    assert_records(opts)
    for name, var in OFF_STEPS.items():
        assert opts[name]["off_by"] == var and opts[name]["applied"] is False, (name, opts[name])
        assert (opts[name]["state"], opts[name]["code"]) == ("skipped", "off"), opts[name]
    assert opts["sdpa"]["off_by"] is None and opts["oom_handler"]["off_by"] is None
    called = set(names(rep))
    assert not called & {"_cuda_setMemoryFraction", ACCEL, "set_autocast_dtype",
                         "_cuda_cudaCachingAllocator_set_allocator_settings",
                         "_set_cublas_allow_tf32", "_set_cudnn_benchmark",
                         "_set_cudnn_deterministic"}, called
    assert set(rep["env_at_load"].values()) == {None} and rep["conf_read"] in ("", None)
    assert rep["autocast"][0] is None  # torch's own autocast dtype
    assert rep["plan"]["prefetch_factor"] is None and rep["plan"]["num_workers"] == 2
    if cuda:
        assert opts["oom_handler"]["value"]["snapshot"] is None  # no file named "0"
    table = {ln.split()[0]: ln.split()[1] for ln in r.stderr.splitlines()
             if ln.startswith("  ") and not ln.startswith("   ") and len(ln.split()) > 1}
    assert {name: table[name] for name in OFF_STEPS} == {name: "off" for name in OFF_STEPS}


def test_without_off_words_nothing_says_off(venv, tmp_path):
    rep, _ = run_release(venv, tmp_path, "2.14.1")
    assert {e["off_by"] for e in rep["status"]["optimizations"].values()} == {None}


# ---- the stand-ins against what was recorded from the real wheels ----

RECORD_PROBE = """
import json, warnings, torch
warnings.simplefilter("ignore")  # 2.4+'s deprecated autocast getter is only looked up
try:
    import torch.distributed.fsdp as fsdp
    fsdp = getattr(fsdp, "FSDPModule", None)
except ImportError:
    fsdp = None
setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
    torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings")
keys = []
for key in %r:  # each key its parser knows; an unknown one raises
    try:
        setter(key + ":1")
        keys.append(key)
    except RuntimeError:
        pass
print('REPORT=' + json.dumps({
    'allocator_keys': keys, 'cuda': torch.version.cuda,
    'allocator': sorted(n for n in dir(torch._C) if n in (%r)),
    'cudnn': torch.backends.cudnn.version(),
    'fsdp': None if fsdp is None else (
        'divide_factor' if hasattr(fsdp, 'set_reduce_scatter_divide_factor')
        or hasattr(fsdp, 'set_gradient_divide_factor')
        else 'no_divide_factor'),
    'autocast_getter': 'get_autocast_dtype' if hasattr(torch, 'get_autocast_dtype')
                       else 'get_autocast_gpu_dtype' if hasattr(torch, 'get_autocast_gpu_dtype')
                       else None,
}))
"""
# The allocator keys the records were read for (buildsys/record_releases.py).
KNOWN_KEYS = runpy.run_path(str(Path(__file__).parents[1] / "buildsys" / "record_releases.py"))[
    "KEYS"]
ALLOCATOR_FNS = ("_cuda_cudaCachingAllocator_set_allocator_settings", ACCEL,
                 "_accelerator_getAllocatorSettings")


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_each_stand_in_is_what_its_release_was_recorded_as(tmp_path, release):
    import subprocess
    import sys
    from fake_torch import RECORDS, record_of
    root = make_fake_torch(tmp_path / "fake", release, wheels=True)
    keys = KNOWN_KEYS + ("not_a_key",)
    r = subprocess.run([sys.executable, "-W", "error", "-c",
                        RECORD_PROBE % (keys, ALLOCATOR_FNS)],
                       env={"PYTHONPATH": str(root)}, cwd=tmp_path, capture_output=True,
                       text=True)
    got = last_json(r, "REPORT=")
    rec = record_of(release)
    assert got == {k: (sorted(rec[k]) if k == "allocator" else rec[k]) for k in (
        "allocator", "cudnn", "fsdp", "autocast_getter", "cuda", "allocator_keys")}, (release, got)
    # NCCL: the nvidia-nccl wheel pip installs beside torch, where outofcuda reads it.
    assert [p.name for p in root.glob("nvidia_nccl_*")] == [
        f"nvidia_nccl_cu{rec['cuda'].split('.')[0]}-{rec['nccl']}.dist-info"]
    assert RECORDS["recorded"] == "2026-12-07" and "real CUDA wheels" in RECORDS["source"]
