"""The command line, run as users run it: `python -m outofcuda ...` in a fresh
interpreter of the test venv (built wheel + real torch)."""
import json

import pytest

STATUS_KEYS = {"version", "python", "executable", "hook", "torch", "torch_error", "cuda",
               "cuda_initialized_by_import", "optimizations", "config_warnings", "gpus",
               "nvml_error"}
CHECKS = ["hook_file", "extension", "torch", "alloc_conf", "nvidia_tf32_override",
          "cuda_visible_devices", "dev_shm", "multiple_installs", "python_no_site",
          "outofcuda_env"]


def cli(venv, *args, env=None, cwd=None):
    return venv.run(None, args=["-m", "outofcuda", *args], env=env, cwd=cwd, timeout=300)


def test_status_json_reports_a_fresh_torch_import(venv, workdir):
    r = cli(venv, "status", "--json", cwd=workdir)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(d) == STATUS_KEYS
    assert d["hook"]["present"] and d["hook"]["installed"] and d["hook"]["fired"]
    assert d["hook"]["error"] is None
    assert d["torch"].startswith("2.13.0")
    assert d["cuda_initialized_by_import"] is False
    assert {"tf32", "allocator", "oom_handler"} <= set(d["optimizations"])
    assert any(f["path"].endswith("outofcuda_hook.pth") for f in d["hook"]["files"])
    assert d["gpus"] == [] and d["nvml_error"]


def test_plain_command_is_status_text(venv, workdir):
    r = cli(venv, cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert "hook fires      yes" in r.stdout
    assert "torch           2.13.0" in r.stdout
    assert "tf32" in r.stdout and "GPUs" in r.stdout


def test_json_before_the_subcommand(venv, workdir):
    r = cli(venv, "--json", "doctor", cwd=workdir)
    assert json.loads(r.stdout)["checks"]


def test_status_when_disabled_says_so(venv, workdir):
    r = cli(venv, "status", "--json", env={"OUTOFCUDA_DISABLE": "1"}, cwd=workdir)
    d = json.loads(r.stdout)
    assert d["hook"]["disabled_by_env"] is True and d["hook"]["fired"] is False


def test_doctor_healthy_environment(venv, workdir):
    r = cli(venv, "doctor", "--json", cwd=workdir)
    d = json.loads(r.stdout)
    assert [c["name"] for c in d["checks"]] == CHECKS
    bad = [c for c in d["checks"] if not c["ok"]]
    assert r.returncode == 0 and d["healthy"], bad
    text = cli(venv, "doctor", cwd=workdir)
    assert text.returncode == 0 and text.stdout.rstrip().endswith("healthy")


def _failed(r):
    return {c["name"]: c for c in json.loads(r.stdout)["checks"] if not c["ok"]}


def test_doctor_notes_user_allocator_override(venv, workdir):
    r = cli(venv, "doctor", "--json", env={"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
            cwd=workdir)
    check = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["alloc_conf"]
    assert check["ok"] and "max_split_size_mb:64 (default 128)" in check["message"]


@pytest.mark.parametrize("value", [
    # outofcuda's own defaults, as a child of an older outofcuda inherited them
    "max_split_size_mb:128,garbage_collection_threshold:0.8,expandable_segments:True",
    "expandable_segments:False",           # the README's way out of expandable segments
])
def test_doctor_accepts_defaults_and_the_documented_fix(venv, workdir, value):
    r = cli(venv, "doctor", "--json", env={"PYTORCH_CUDA_ALLOC_CONF": value}, cwd=workdir)
    assert "alloc_conf" not in _failed(r), r.stdout


def test_doctor_fixes_a_malformed_allocator_variable(venv, workdir):
    r = cli(venv, "doctor", "--json", env={"PYTORCH_ALLOC_CONF": "expandable_segments"},
            cwd=workdir)
    assert r.returncode == 1
    failed = _failed(r)
    assert set(failed) == {"alloc_conf"} and "malformed" in failed["alloc_conf"]["message"]
    assert failed["alloc_conf"]["fix"]


@pytest.mark.parametrize("env,name", [
    ({"NVIDIA_TF32_OVERRIDE": "0"}, "nvidia_tf32_override"),
    ({"CUDA_VISIBLE_DEVICES": ""}, "cuda_visible_devices"),
    ({"OUTOFCUDA_NUM_WORKERS": "many"}, "outofcuda_env"),
])
def test_doctor_flags_environment(venv, workdir, env, name):
    r = cli(venv, "doctor", "--json", env=env, cwd=workdir)
    assert r.returncode == 1
    assert name in _failed(r)


def test_doctor_flags_python_dash_S(venv, workdir):
    # -S: site does not run, so neither does the hook; the CLI still starts
    # when outofcuda is on PYTHONPATH.
    r = venv.run(None, args=["-S", "-m", "outofcuda", "doctor", "--json"], cwd=workdir,
                 env={"PYTHONPATH": str(venv.site)})
    assert r.returncode == 1, r.stderr
    assert "python_no_site" in _failed(r)


def test_doctor_finds_removed_hook_file(venv, workdir):
    hook = venv.site / "outofcuda_hook.pth"
    saved = hook.read_bytes()
    hook.unlink()
    try:
        r = cli(venv, "doctor", "--json", cwd=workdir)
        text = cli(venv, "doctor", cwd=workdir)
    finally:
        hook.write_bytes(saved)
    assert r.returncode == 1
    assert "hook_file" in _failed(r)
    assert "FIX  hook_file" in text.stdout


def test_doctor_finds_second_install(venv, workdir):
    import shutil

    extra = workdir / "extra"
    extra.mkdir()
    (so,) = venv.site.glob("_outofcuda*.so")
    shutil.copy(so, extra / so.name)
    r = cli(venv, "doctor", "--json", env={"PYTHONPATH": str(extra)}, cwd=workdir)
    assert r.returncode == 1
    assert str(extra) in _failed(r)["multiple_installs"]["message"]


def test_report_json(venv, workdir):
    r = cli(venv, "report", "--json", cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {}


@pytest.mark.parametrize("args", [["--bogus"], ["nonsense"], ["status", "--what"],
                                  ["bench", "--smoke", "extra"]])
def test_bad_arguments_exit_2(venv, workdir, args):
    r = cli(venv, *args, cwd=workdir)
    assert r.returncode == 2
    assert "usage: outofcuda" in r.stderr


@pytest.mark.parametrize("args", [[], ["status"], ["doctor"], ["report"], ["bench"]])
def test_help_everywhere(venv, workdir, args):
    r = cli(venv, *args, "--help", cwd=workdir)
    assert r.returncode == 0
    assert "--json" in r.stdout


def test_console_script(venv, workdir):
    import subprocess

    r = subprocess.run([str(venv.path / "bin" / "outofcuda"), "doctor", "--json"],
                       capture_output=True, text=True, cwd=workdir, timeout=300)
    assert [c["name"] for c in json.loads(r.stdout)["checks"]] == CHECKS
