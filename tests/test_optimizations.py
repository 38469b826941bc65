"""What a plain `import torch` gets, read back through torch's public getters
(torch 2.13.0 CPU build; each scenario a fresh interpreter, no `import outofcuda`).
On a CPU-only build every flag stays torch's default; the CUDA build's flags are
checked in tests/test_cuda_build.py."""
import json

from kit import flags_script

FLAGS = flags_script("""
    'excepthook': getattr(sys.excepthook, '__name__', ''),
    'alloc_env': sorted(k for k in os.environ if k.startswith('PYTORCH_')),
""")


def flags(venv, workdir, env=None):
    r = venv.check(FLAGS, env=env, cwd=workdir)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("FLAGS=")][-1]
    return json.loads(line[6:]), r


def test_defaults_applied_through_torch_getters(venv, workdir):
    f, r = flags(venv, workdir)
    # A CPU-only build keeps torch's defaults for every flag: TF32 would only
    # slow float32 matmuls, and cuDNN/SDPA flags are read by libraries
    # (Lightning's Trainer(benchmark=None)) and by users' tests.
    assert f == {"matmul_tf32": False, "cudnn_tf32": True, "benchmark": False, "deterministic": False,
                 "flash": True, "mem_efficient": True, "math": True,
                 "excepthook": "excepthook", "cuda_initialized": False,
                 "cudnn_sdp": True, "matmul_precision": "highest", "alloc_env": []}
    assert r.stderr == ""


def test_cpu_build_flags_equal_torchs_own(venv, workdir):
    with_hook, _ = flags(venv, workdir)
    without, _ = flags(venv, workdir, env={"OUTOFCUDA_DISABLE": "1"})
    assert with_hook == without


def test_switches_on_a_cpu_build_change_nothing_readable(venv, workdir):
    base, _ = flags(venv, workdir, env={"OUTOFCUDA_DISABLE": "1"})
    for env in ({"OUTOFCUDA_CUDNN_DETERMINISTIC": "1"},
                {"OUTOFCUDA_TF32": "0", "OUTOFCUDA_CUDNN_BENCHMARK": "off",
                 "OUTOFCUDA_FLASH_ATTN": "0", "OUTOFCUDA_MEM_EFF_ATTN": "no",
                 "OUTOFCUDA_MATH_ATTN": "false"}):
        f, _ = flags(venv, workdir, env=env)
        assert f == base, env


def test_tf32_off_switch_is_recorded(venv, workdir):
    r = venv.check("import torch, _outofcuda; print(_outofcuda.status()['optimizations']['tf32'])",
                   env={"OUTOFCUDA_TF32": "0"}, cwd=workdir)
    assert "'applied': False" in r.stdout and "'off_by': 'OUTOFCUDA_TF32'" in r.stdout


def test_tf32_skipped_on_a_cpu_build_with_the_reason(venv, workdir):
    r = venv.check("import torch, _outofcuda; print(_outofcuda.status()['optimizations']['tf32'])",
                   cwd=workdir)
    assert "'applied': False" in r.stdout and "no CUDA" in r.stdout


def test_verbose_table_names_every_optimisation(venv, workdir):
    r = venv.check("import torch", env={"OUTOFCUDA_VERBOSE": "1"}, cwd=workdir)
    lines = r.stderr.splitlines()
    assert lines[0].startswith("outofcuda 0.3.0: torch 2.13.0")
    for name in ("tf32", "cudnn_benchmark", "cudnn_deterministic", "allocator", "memory_fraction",
                 "sdpa", "amp_dtype", "oom_handler"):
        row = next(ln for ln in lines if ln.split()[:1] == [name])
        assert row.split()[1] in ("yes", "no")
    assert "this torch build has no CUDA" in r.stderr


def test_status_is_json_and_importing_outofcuda_changes_nothing(venv, workdir):
    r = venv.check("""
import json, torch, _outofcuda
before = json.dumps(_outofcuda.status(), sort_keys=True)
torch.backends.cudnn.benchmark = False           # the user's own setting after import
import outofcuda
after = json.dumps(outofcuda.status(), sort_keys=True)
print(before == after, torch.backends.cudnn.benchmark)
""", cwd=workdir)
    assert r.stdout.split() == ["True", "False"]


def test_oom_handler_leaves_the_earlier_hook_on_a_cpu_build(venv, workdir):
    # No CUDA here: the program's hook stays in place and sees the error alone
    # (tests/test_oom.py covers the report and the chaining once CUDA starts).
    r = venv.run("""
import sys
def mine(t, v, tb):
    print('earlier hook saw', t.__name__, sys.excepthook is mine)
sys.excepthook = mine
import torch
raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')
""", cwd=workdir)
    assert r.returncode == 1
    assert "earlier hook saw OutOfMemoryError True" in r.stdout
    assert "outofcuda" not in r.stderr


def test_non_oom_exception_is_untouched(venv, workdir):
    r = venv.run("import torch\nraise ValueError('plain')", cwd=workdir)
    assert r.returncode == 1 and "ValueError: plain" in r.stderr and "outofcuda" not in r.stderr
