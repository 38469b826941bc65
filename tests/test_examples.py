"""Every Python example of README.md and docs/ runs as written, on the CPU
build of torch (the `venv` fixture), each in a fresh interpreter and an empty
working directory, with matplotlib on the path for the plot."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [(doc.relative_to(ROOT), i, code) for doc in DOCS
            for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))]


def test_the_docs_hold_at_least_three_examples():
    assert len(EXAMPLES) >= 3, [(str(d), i) for d, i, _ in EXAMPLES]


@pytest.mark.parametrize("doc,index,code", EXAMPLES, ids=[f"{d}#{i}" for d, i, _ in EXAMPLES])
def test_example_runs_as_written(venv, workdir, matplotlib_dir, doc, index, code):
    # TMPDIR: what a DataLoader's workers leave goes with the test's folder.
    r = venv.run(code, cwd=workdir, timeout=300,
                 env={"PYTHONPATH": matplotlib_dir, "TMPDIR": str(workdir)})
    assert r.returncode == 0, f"{doc} example {index}: exit {r.returncode}\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), f"{doc} example {index} printed nothing"
