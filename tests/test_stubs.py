"""The type stubs (`_outofcuda.pyi`, `outofcuda/__init__.pyi`) match what the
built wheel exports: mypy's stubtest, with the engine's text signatures
(`name(a, b=None, /)\\n--\\n\\n` docstrings) so parameters are checked too."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, _clean_env


def test_stubtest_is_clean(wheel, venv, tmp_path):
    pytest.importorskip("mypy.stubtest")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, env=_clean_env())
    cfg = tmp_path / "mypy.ini"
    # matplotlib is optional (the `plot` extra) and not installed here.
    cfg.write_text("[mypy]\n[mypy-matplotlib.*]\nignore_missing_imports = True\n")
    r = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(cfg),
         "--allowlist", str(ROOT / "tests" / "stubtest_allowlist.txt"), "_outofcuda", "outofcuda"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        # The wheel first, torch from the test environment after it.
        env=_clean_env({"MYPYPATH": str(site), "PYTHONPATH": os.pathsep.join([str(site), str(venv.site)]),
                        "OUTOFCUDA_DISABLE": "1"}))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found" in r.stdout


def test_every_engine_function_has_a_text_signature(venv):
    d = venv.json("""
        import _outofcuda, json
        print(json.dumps(sorted(n for n, f in vars(_outofcuda).items()
                                if callable(f) and type(f).__name__ == "builtin_function_or_method"
                                and f.__text_signature__ is None)))
    """)
    assert d == []
