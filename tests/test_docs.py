"""The documentation against the tree: the README stays a short front door,
docs/ covers every source file and names only files and tests that exist,
every relative link resolves, and CHANGELOG.md's newest release is the version
the code states. Pure file reads: no build, no virtual environment."""
import re
from pathlib import Path

from kit import oc_h_table, oc_headers

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 150
# The two commands (install, test) end within the first screen.
README_COMMANDS_BY_LINE = 40

# Where the source files live.
SOURCE_GLOBS = ["src/*.c", "src/*.h", "outofcuda/*.py", "outofcuda/*.pyi", "outofcuda/py.typed",
                "tests/*.py", "tests/*/*.py", "tests/*/*.c", "tests/README.md",
                "benchmarks/*.py", "benchmarks/*.sh", "fuzz/*.c", "fuzz/*.sh"]
# A backticked path whose first folder is one of these is this repository's.
OWN_FOLDERS = ("src", "outofcuda", "tests", "benchmarks", "fuzz", "docs", ".ci")


def doc_files():
    return [README, ROOT / "CHANGELOG.md", ROOT / "tests" / "README.md",
            *sorted(DOCS.glob("*.md"))]


def test_readme_is_a_short_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    headings = [ln for ln in lines if ln.startswith("## ")]
    for needed in ("## Two commands", "## What it changes", "## Turning it off"):
        assert needed in headings, (needed, headings)
    fences = [i for i, ln in enumerate(lines, 1) if ln.startswith("```sh")]
    assert len(fences) >= 2 and fences[1] + 1 <= README_COMMANDS_BY_LINE, fences
    assert "pip install outofcuda" in " ".join(lines[:README_COMMANDS_BY_LINE])


def test_every_docs_file_is_listed_in_the_index_and_the_readme():
    """One topic a file: a file nobody links to is a topic nobody finds."""
    index = (DOCS / "README.md").read_text()
    readme = README.read_text()
    topics = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    assert topics, "docs/ holds no topic"
    assert [t for t in topics if f"]({t})" not in index] == [], "missing from docs/README.md"
    assert [t for t in topics if f"](docs/{t})" not in readme] == [], "missing from README.md"


def test_relative_links_resolve():
    broken = []
    for doc in doc_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (doc.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken


def _cited_paths(text):
    """Backticked paths of this repository (first folder one of OWN_FOLDERS),
    with a pytest node id's test name when one is given (path::name)."""
    for token in re.findall(r"`([^`\s]+)`", text):
        path, _, name = token.partition("::")
        path = path.rstrip(",.:;")
        if path.split("/", 1)[0] in OWN_FOLDERS and "/" in path and "*" not in path:
            yield path, name


def test_docs_cite_only_files_and_tests_that_exist():
    missing = []
    for doc in doc_files():
        for path, name in _cited_paths(doc.read_text()):
            target = ROOT / path
            if not target.exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
            elif name and not re.search(rf"^def {re.escape(name)}\(", target.read_text(), re.M):
                missing.append(f"{doc.relative_to(ROOT)}: {path}::{name}")
    assert not missing, missing


def test_layout_names_every_folder():
    """docs/layout.md is by folder: each folder of the repository that holds
    source has its row, and no row names a folder that is gone."""
    rows = set(re.findall(r"^\| `([^`]+)/` \|", (DOCS / "layout.md").read_text(), re.M))
    folders = {p.split("/", 1)[0] for g in SOURCE_GLOBS for p in
               (str(q.relative_to(ROOT)) for q in ROOT.glob(g))} | {"buildsys", ".ci", "docs"}
    assert rows == folders, (sorted(rows), sorted(folders))


def test_changelog_names_the_version_the_code_states():
    version = re.search(r'#define OC_VERSION "([^"]+)"', oc_headers())[1]
    releases = re.findall(r"^## (\d+\.\d+\.\d+)\b", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == version, (releases, version)


def test_testing_doc_shows_the_readme_test_command():
    """docs/testing.md repeats the README's test command (which .ci/run runs,
    tests/test_packaging.py): the two stay one command."""
    section = README.read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    test_command = re.findall(r"```sh\n(.*?)\n```", section, re.S)[1]
    assert f"```sh\n{test_command}\n```" in (DOCS / "testing.md").read_text()


def test_every_test_variable_the_tests_read_is_documented():
    """An OUTOFCUDA_TEST_* variable changes what the suite does: each one the
    tests (or the scripts that run them) read has its row in environment.md."""
    read = set()
    for pattern in ("tests/*.py", "tests/*/*.py", "benchmarks/*.sh", "benchmarks/*.py", ".ci/*"):
        for path in ROOT.glob(pattern):
            if path.is_file():
                read |= set(re.findall(r"OUTOFCUDA_TEST_[A-Z_]*[A-Z]", path.read_text()))
    documented = set(re.findall(r"`(OUTOFCUDA_TEST_[A-Z_]*[A-Z])`",
                                (DOCS / "environment.md").read_text()))
    assert len(read) >= 10 and read - documented == set(), sorted(read - documented)


def test_every_record_code_and_state_is_documented():
    """status()'s `code` words are an interface: docs/python-api.md's table
    lists exactly the codes of src/oc_core.h's OC_REC_CODES, in its order, and
    names every state of OC_REC_STATES."""
    codes = oc_h_table("OC_REC_CODES")
    states = oc_h_table("OC_REC_STATES")
    assert len(codes) > 20 and "program_chose" in codes and states[0] == "pending", (codes, states)
    text = (DOCS / "python-api.md").read_text()
    table = text[text.index("| code | meaning |"):]
    documented = re.findall(r"^\s*\| `(\w+)` \|", table, re.M)
    assert documented == codes
    for state in states:
        assert f"`{state}`" in text, state
    # The notes' codes, named where python-api.md says they are.
    stub = (ROOT / "_outofcuda.pyi").read_text()
    notes = oc_h_table("OC_REC_NOTES")
    assert len(notes) > 10 and [n for n in notes if f" {n}" not in stub] == [], notes


def test_the_record_table_reader_reads_what_it_should():
    """tests/kit.py's reader takes a table's names and stops at its end."""
    assert oc_h_table("OC_OPTIMISATIONS")[:2] == ["tf32", "cudnn_benchmark"]
    assert "framework" not in oc_h_table("OC_OPTIMISATIONS")  # a CUDA step, not an optimisation
    # status()["cuda_init"]'s keys and status()["optimizations"]'s are public:
    # spelled out here, so that a change in oc.h shows in a test.
    assert oc_h_table("OC_CUDA_STEPS") == ["framework", "tf32", "memory_fraction", "known_bugs",
                                           "oom_handler", "summary"]
    assert oc_h_table("OC_OPTIMISATIONS") == ["tf32", "cudnn_benchmark", "cudnn_deterministic",
                                              "allocator", "memory_fraction", "sdpa", "amp_dtype",
                                              "oom_handler"]


def doc_cuda_steps(text):
    """The steps docs/how-the-hook-works.md lists, in its order: the
    backticked names after "gives it:" up to the sentence's end, asides in
    parentheses left out."""
    listed = re.search(r'`status\(\)\["cuda_init"\]` gives it: (.*?)\. A step', text, re.S)[1]
    while (shorter := re.sub(r"\([^()]*\)", "", listed)) != listed:
        listed = shorter
    return re.findall(r"`(\w+)`", listed)


def test_the_doc_gives_the_cuda_init_steps_in_the_order_they_run():
    steps = oc_h_table("OC_CUDA_STEPS")
    assert steps[:2] == ["framework", "tf32"] and "summary" in steps, steps
    assert doc_cuda_steps((DOCS / "how-the-hook-works.md").read_text()) == steps
    swapped = ('`status()["cuda_init"]` gives it: `tf32` (`x`), `framework` ([a](b.md)), '
               '`memory_fraction`. A step')
    assert doc_cuda_steps(swapped) == ["tf32", "framework", "memory_fraction"]
