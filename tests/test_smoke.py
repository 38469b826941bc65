"""The wheel installs and the hook fires on a plain `import torch`."""
import json


def test_hook_fires_on_plain_import(venv, workdir):
    r = venv.check("""
        import json, sys, torch
        import _outofcuda
        print(json.dumps(_outofcuda.status()))
    """, cwd=workdir)
    st = json.loads(r.stdout)
    assert st["hook"] == {"installed": True, "fired": True, "error": None}
    assert st["torch"].startswith("2.13.0")
    assert r.stderr == ""
