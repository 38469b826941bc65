"""The files the wheel puts at the root of site-packages: the start-up hook
file (which one depends on the Python the wheel is for) and the engine's type
stubs. Used by setup.py (regular wheels) and by backend.py (editable ones).

Which hook file serves which Python (PEP 829):
- 3.9-3.17: `outofcuda_hook.pth`, one import line. 3.15-3.17 still run import
  lines unless a `.start` of the same name exists, and a `.start` costs every
  process of the environment site's pkgutil.resolve_name and the 27 modules it
  imports, so this wheel (cp39-abi3) carries no `.start`.
- 3.18 and later ignore import lines: `outofcuda_hook.start` names the entry
  point, install() of `outofcuda_hook_start.py`, a module that runs the .pth
  line (so both read OUTOFCUDA_DISABLE and the boot's size before loading it:
  importing the boot by name would map it first). That wheel is tagged
  cp318-abi3, which pip prefers there.
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOT = "outofcuda_hook"
BOOT_FILE = BOOT + ".abi3.so"
PTH = BOOT + ".pth"
START = BOOT + ".start"
START_MODULE = BOOT + "_start"  # the .start file's entry: START_MODULE:install
STUBS = "_outofcuda.pyi"
START_FROM = (3, 18)
# The first Python whose site runs a .start file at all (PEP 829).
START_RUNS_FROM = (3, 15)
START_TAG = "cp318"
# The .pth template's placeholder for the size of the linked boot: the line
# loads the boot only when the file has exactly that size, so a partly
# written file (an interrupted install, a full disk) is never mapped.
SIZE_MARK = "BOOT_SIZE"
SITEDIR_PATH = "sitedir+'/" + BOOT_FILE + "'"


def start_kind():
    """True when the wheel is the .start kind: OUTOFCUDA_BUILD_HOOK_FILE=pth or
    start chooses; unset, the building Python decides."""
    word = os.environ.get("OUTOFCUDA_BUILD_HOOK_FILE", "").strip().lower()
    if word in ("pth", "start"):
        if word == "start" and sys.version_info < START_RUNS_FROM:
            # pip installs what it built from source whatever its tag; the
            # wheel must still be built (a release builds both kinds on one
            # Python), so this warns rather than refuses.
            sys.stderr.write(start_warning(sys.version_info))
        return word == "start"
    if word:
        raise SystemExit(f"OUTOFCUDA_BUILD_HOOK_FILE={word!r}: use 'pth' (a wheel for Python "
                         "3.9-3.17) or 'start' (for 3.18 and later)")
    return sys.version_info >= START_FROM


def start_warning(version):
    """The build's warning where the .start kind is built by a Python that
    never runs a .start file."""
    return (f"warning: OUTOFCUDA_BUILD_HOOK_FILE=start builds the hook file for Python "
            f"{START_FROM[0]}.{START_FROM[1]} and later (the cp318-abi3 wheel); Python "
            f"{version[0]}.{version[1]}, which builds it, never runs a .start file (only "
            f"{START_RUNS_FROM[0]}.{START_RUNS_FROM[1]} and later do), so installed here the hook "
            "never loads: unset OUTOFCUDA_BUILD_HOOK_FILE (or set it to pth) for this Python\n")


def pth_line(boot_size, boot_dir=None):
    """The .pth line for a boot of boot_size bytes, found beside the .pth
    (site's `sitedir`) or, for an editable install, in boot_dir."""
    text = (ROOT / PTH).read_text()
    assert SIZE_MARK in text and SITEDIR_PATH in text, f"{PTH} lost its placeholders"
    text = text.replace(SIZE_MARK, str(int(boot_size)))
    if boot_dir is not None:
        boot_dir = str(boot_dir)
        if any(c in boot_dir for c in "'\"\\\n\r"):
            raise SystemExit(f"an editable install needs a source path without quotes or "
                             f"backslashes: {boot_dir!r}")
        text = text.replace(SITEDIR_PATH, "'" + boot_dir + "/" + BOOT_FILE + "'")
    return text


def start_module(boot_size, boot_dir=None):
    """The module the .start file names: its install() runs the .pth line,
    with the names that line takes from site (sitedir, os, sys) its own."""
    entry = (ROOT / START).read_text().strip()
    assert entry == START_MODULE + ":install", f"{START} names {entry!r}"
    return (f'"""outofcuda\'s start-up hook on Python {START_FROM[0]}.{START_FROM[1]} and later, which '
            f'run no .pth\nimport line: {START} names install() (PEP 829), which runs the\n'
            f'line of {PTH} (written at build time)."""\n'
            "import os\nimport sys\n\nsitedir = os.path.dirname(__file__)\n\n\n"
            "def install():\n    " + pth_line(boot_size, boot_dir))


def root_files(boot_size, start, boot_dir=None):
    """{name: text} of the files at the wheel's root."""
    files = {STUBS: (ROOT / STUBS).read_text()}
    if start:
        files[START] = (ROOT / START).read_text()
        files[START_MODULE + ".py"] = start_module(boot_size, boot_dir)
    else:
        files[PTH] = pth_line(boot_size, boot_dir)
    return files


def write(build_lib, boot_size, start):
    """Puts the root files into build_lib, removing the other kind's hook file
    a previous build left there."""
    for name in (PTH, START, START_MODULE + ".py"):
        (build_lib / name).unlink(missing_ok=True)
    for name, text in root_files(boot_size, start).items():
        (build_lib / name).write_text(text)
