"""benchmarks/gpu_check.sh --dry-run: every step of the GPU check (the install
without network, `outofcuda status`, tests/gpu, the gain benchmark, the
summary) runs here on the CPU with tiny shapes and the stand-ins, so the first
run on a lent GPU cannot die of a typo, a missing import or a wrong path."""
import ast
import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT, SANITIZE, _clean_env

SCRIPT = ("benchmarks", "gpu_check.sh")


def _checkout(tmp_path):
    # A copy, so the build leaves nothing in the checkout; started from
    # another folder, so the script must find its own paths.
    src = tmp_path / "checkout"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "*.so", ".venv*", "__pycache__", ".pytest_cache",
        "gpu-check-out"))
    return src


def _gpu_tests():
    """Every test function of tests/gpu (parametrized ones count once)."""
    names = []
    for f in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        names += [n.name for n in ast.parse(f.read_text()).body
                  if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    return names


def _run(tmp_path, python, *args, env=None, timeout=120):
    src = _checkout(tmp_path)
    out = tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # TMPDIR: the script's own folder and its pytest's go with this test's.
    r = subprocess.run(["bash", str(src.joinpath(*SCRIPT)), *args], cwd=elsewhere,
                       env=_clean_env(dict({"OUT": str(out), "PYTHON": str(python),
                                            "TMPDIR": str(elsewhere)}, **(env or {}))),
                       capture_output=True, text=True, timeout=timeout)
    return r, out


def test_dry_run_runs_every_step(venv, wheel, tmp_path, notebook_dir):
    # The GPU machine's interpreter holds torch, pytest and setuptools: here
    # the test environment's (torch, setuptools) with this runner's packages
    # (pytest) on PYTHONPATH. IPython comes from the folder
    # OUTOFCUDA_TEST_NOTEBOOK_DIR names, as it may on the GPU machine. The
    # session's wheel, built from this checkout by the same setuptools hook,
    # is unpacked rather than built a second time.
    runner = [p for p in sys.path if p.endswith("site-packages")]
    env = {"PYTHONPATH": os.pathsep.join(runner), "OUTOFCUDA_TEST_NOTEBOOK_DIR": notebook_dir,
           "GPU_CHECK_WHEEL": None if SANITIZE else str(wheel)}
    r, out = _run(tmp_path, venv.python, "--dry-run", env=env, timeout=1500)
    log = (out / "gpu_tests.log").read_text() if (out / "gpu_tests.log").exists() else ""
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n--- gpu_tests.log ---\n{log[-6000:]}"
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("DRY RUN")
    for line in ("outofcuda status exit 0", "gpu tests exit 0", "gain benchmark exit 0",
                 "gpu check exit 0"):
        assert line in summary, summary
    # The package imported is the one the script installed, not the checkout's.
    installed = next(ln for ln in summary.splitlines() if ln.startswith("installed: "))
    assert str(tmp_path / "checkout") not in installed and "/venv/" in installed, installed
    assert not re.search(r"\d+ (failed|errors?)\b", log.splitlines()[-1]), log
    # Every GPU test ran (-v names each with its outcome); none skipped
    # before its body started (the fixture fails there).
    outcomes = {}
    for m in re.finditer(r"::(test_\w+)(?:\[[^\]]*\])? (PASSED|SKIPPED|XFAIL|FAILED|ERROR)", log):
        outcomes.setdefault(m.group(1), set()).add(m.group(2))
    assert set(outcomes) == set(_gpu_tests()), (sorted(outcomes), log[-4000:])
    assert all(o <= {"PASSED", "SKIPPED", "XFAIL"} for o in outcomes.values()), outcomes
    # The IPython check ran its scenarios (a skip would have no figures).
    assert "ipython failed cell:" in summary, summary
    for name in ("status.txt", "install.log", "gain.log", "gain.json", "gain.md",
                 "ipython_oom.json"):
        assert (out / name).exists(), name
    assert "cpu-smoke" in (out / "gain.json").read_text()
    # Every figures file of the GPU checks was written and summarised
    # (benchmarks/gpu_figures.py): none missing, none unreadable.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_figures
    finally:
        sys.path.pop(0)
    for name, _, _ in gpu_figures.FILES:
        assert (out / name).exists(), name
    assert not re.search(r"\.json (missing|unreadable)", summary), summary
    for line in ("outside the allocator, small CNN step:", "largest gpt batch that fits:",
                 "cuda ipc: outofcuda works", "cnn step by autocast dtype",
                 "  float16/channels_last:", "cudnn-sdpa-nan-grad-sm90: applies",
                 "sm100 cuDNN-attention rows:"):
        assert line in summary, (line, summary)


def test_without_a_gpu_the_real_check_fails_before_installing(venv, tmp_path):
    r, out = _run(tmp_path, venv.python)
    assert r.returncode == 1
    assert "FAIL: torch.cuda.is_available() is False" in (out / "summary.txt").read_text()
    assert not (out / "install.log").exists()


def test_an_unknown_argument_is_refused(venv, tmp_path):
    r, _ = _run(tmp_path, venv.python, "--dryrun")
    assert r.returncode == 2 and "usage: gpu_check.sh [--dry-run]" in r.stderr
