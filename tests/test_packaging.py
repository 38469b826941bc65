"""The wheel: one cp39-abi3 file with the .pth hook at its root (and its
cp318-abi3 twin with the .start hook, which pip picks on 3.18 and later),
clean install and uninstall (regular and editable), and the same binary on
Python 3.9 to 3.13; the source distribution builds and installs; sanitizer
builds never reuse a plain build's objects; a user's build has no -Werror."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, WERROR, _clean_env

# What the cp39-abi3 wheel (Python 3.9-3.17) puts at the root of
# site-packages; the .start file is only in the cp318-abi3 one.
HOOK_FILES = {"outofcuda_hook.pth"}
START = "outofcuda_hook.start"
START_MODULE = "outofcuda_hook_start.py"  # the module the .start file names
WATCHING = ("import sys, _outofcuda; print(sum(type(f).__name__ == 'TorchImportWatcher' "
            "for f in sys.meta_path), _outofcuda.status()['hook']['installed'])")


def make_venv(python, path):
    subprocess.run([str(python), "-m", "venv", str(path)], check=True, env=_clean_env())
    return path / "bin" / "python"


def pip(py, *args):
    subprocess.run([str(py), "-m", "pip", "-q", "--disable-pip-version-check", *args],
                   check=True, env=_clean_env())


def site_files(py):
    out = subprocess.run([str(py), "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    return {p.name for p in Path(out).iterdir()}


def test_wheel_is_one_abi3_file_with_hook_at_root(wheel):
    assert wheel.name.endswith("-cp39-abi3-linux_x86_64.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record = zf.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
        wheel_meta = zf.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert HOOK_FILES <= names and START not in names
    for name in HOOK_FILES:
        assert any(line.startswith(name + ",sha256=") for line in record.splitlines())
    assert {"_outofcuda.abi3.so", "outofcuda_hook.abi3.so"} <= names
    assert "Root-Is-Purelib: false" in wheel_meta


def test_extension_links_nothing_of_torch_or_cuda(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as zf:
        zf.extract("_outofcuda.abi3.so", tmp_path)
    needed = subprocess.run(["readelf", "-d", str(tmp_path / "_outofcuda.abi3.so")],
                            check=True, capture_output=True, text=True).stdout
    libs = [ln for ln in needed.splitlines() if "NEEDED" in ln]
    assert libs and all(not any(x in ln for x in ("torch", "c10", "cuda", "nvidia")) for ln in libs)


def test_install_then_uninstall_leaves_nothing(wheel, tmp_path):
    py = make_venv(sys.executable, tmp_path / "v")
    before = site_files(py)
    pip(py, "install", "--no-deps", str(wheel))
    added = site_files(py) - before
    assert HOOK_FILES <= added and "outofcuda" in added and START not in added
    r = subprocess.run([str(py), "-c", WATCHING], capture_output=True, text=True, env=_clean_env())
    assert r.stdout.split() == ["1", "True"], r.stderr
    pip(py, "uninstall", "-y", "outofcuda")
    assert site_files(py) == before


def install_watching(tmp_path, *spec):
    """A fresh venv with `pip install *spec`: the .pth hook files land (no
    .start) and the finder is watching once. Returns (python, site files
    before the install)."""
    py = make_venv(sys.executable, tmp_path / "v")
    before = site_files(py)
    pip(py, "install", *spec)
    added = site_files(py) - before
    assert HOOK_FILES <= added and START not in added, added
    r = subprocess.run([str(py), "-c", WATCHING], capture_output=True, text=True,
                       env=_clean_env(), cwd=tmp_path)
    assert r.stdout.split() == ["1", "True"], r.stderr
    return py, before


def build_wheel(src, out, **env):
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "-w", str(out), "."], cwd=src,
                          capture_output=True, text=True, env=_clean_env(env), timeout=600)


@pytest.fixture(scope="module")
def start_wheel(tmp_path_factory):
    """The wheel for Python 3.18 and later, built here on demand."""
    tmp = tmp_path_factory.mktemp("start")
    r = build_wheel(clean_copy(tmp / "src"), tmp / "out", OUTOFCUDA_BUILD_HOOK_FILE="start", **WERROR)
    assert r.returncode == 0, r.stderr[-4000:]
    (whl,) = (tmp / "out").glob("outofcuda-*.whl")
    return whl


def test_start_wheel_is_cp318_with_the_start_file_alone(start_wheel):
    """3.18 ignores a .pth's import lines (PEP 829): its wheel carries the
    .start file and no .pth, and the same abi3 binary."""
    assert start_wheel.name.endswith("-cp318-abi3-linux_x86_64.whl"), start_wheel.name
    with zipfile.ZipFile(start_wheel) as zf:
        root = {n for n in zf.namelist() if "/" not in n}
        record = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))).decode()
        start = zf.read(START).decode()
    assert root == {START, START_MODULE, "outofcuda_hook.abi3.so", "_outofcuda.abi3.so",
                    "_outofcuda.pyi"}, root
    assert start == (ROOT / START).read_text() and start.strip() == "outofcuda_hook_start:install"
    for name in (START, START_MODULE):
        assert any(line.startswith(name + ",sha256=") for line in record.splitlines()), name


START_ENTRY = """
import importlib, json, sys
sys.path.append(SITE)
module, func = open(SITE + '/outofcuda_hook.start').read().strip().split(':')
for _ in range(2):
    getattr(importlib.import_module(module), func)()
boot = sys.modules.get('outofcuda_hook')
print(json.dumps([getattr(boot, '__file__', None),
                  sum(type(f).__name__ == 'TorchImportWatcher' for f in sys.meta_path)]))
"""


def test_start_entry_reads_disable_and_the_size_before_it_loads_the_boot(start_wheel, tmp_path):
    """The .start wheel's entry point (site calls it on 3.15+; here site's
    call under -S on 3.11, the wheel installed under a cp311 name) loads the
    boot as the .pth line does: by path, once however often it is called,
    only at the size it was built with, and not with OUTOFCUDA_DISABLE=1, so
    that a boot damaged at its size leaves that way out on 3.18+ too."""
    from kit import damage_code

    renamed = tmp_path / start_wheel.name.replace("-cp318-", "-cp311-")
    shutil.copy(start_wheel, renamed)
    py = make_venv(pyenv_python("3.11"), tmp_path / "v")
    pip(py, "install", "--no-deps", str(renamed))
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True,
                               text=True).stdout.strip())
    boot = site / "outofcuda_hook.abi3.so"
    good = boot.read_bytes()

    def entry(**env):
        r = subprocess.run([str(py), "-S", "-c", START_ENTRY.replace("SITE", repr(str(site)))],
                           capture_output=True, text=True, env=_clean_env(env), cwd=tmp_path)
        assert (r.returncode, r.stderr) == (0, ""), (r.returncode, r.stderr)
        return json.loads(r.stdout)

    assert entry() == [str(boot), 1]
    assert entry(OUTOFCUDA_DISABLE="1") == [None, 0]
    damage_code(boot, "zero")
    assert entry(OUTOFCUDA_DISABLE="1") == [None, 0]
    boot.write_bytes(good[:8000])
    assert entry() == [None, 0]


def test_pip_picks_the_pth_wheel_before_318_and_the_start_wheel_after(wheel, start_wheel):
    """pip installs the compatible wheel whose tag ranks first among the
    interpreter's supported tags (packaging.tags, which pip uses)."""
    from packaging import tags
    from packaging.utils import parse_wheel_filename

    wheels = {w.name: next(iter(parse_wheel_filename(w.name)[3])) for w in (wheel, start_wheel)}
    for minor in range(9, 21):
        supported = list(tags.cpython_tags(python_version=(3, minor), abis=[f"cp3{minor}"],
                                           platforms=["linux_x86_64"]))
        ranked = sorted((supported.index(t), name) for name, t in wheels.items() if t in supported)
        chosen = ranked[0][1]
        want = start_wheel.name if minor >= 18 else wheel.name
        assert chosen == want, (minor, ranked)


def test_bad_hook_file_choice_is_refused_before_compiling(tmp_path):
    r = build_wheel(clean_copy(tmp_path / "src"), tmp_path / "out", OUTOFCUDA_BUILD_HOOK_FILE="both")
    assert r.returncode != 0
    assert "OUTOFCUDA_BUILD_HOOK_FILE='both': use 'pth'" in r.stdout + r.stderr
    assert "gcc" not in r.stdout + r.stderr


def pyenv_python(version):
    """The newest pyenv CPython `version`. Missing: a skip on a developer's
    machine, a failure under CI (CI=1), where a skip would pass unseen."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    matches = sorted(Path(root, "versions").glob(f"{version}.*/bin/python{version}"))
    if matches:
        return matches[-1]
    why = f"Python {version} is not installed under pyenv ({root}; pyenv install {version})"
    if os.environ.get("CI"):
        pytest.fail(why + ": required in CI")
    pytest.skip(why)


@pytest.mark.parametrize("version", ["3.9", "3.10", "3.11", "3.12", "3.13"])
def test_one_wheel_on_every_python(wheel, tmp_path, version):
    python = pyenv_python(version)
    py = make_venv(python, tmp_path / "v")
    pip(py, "install", "--no-deps", str(wheel))
    r = subprocess.run([str(py), "-c", WATCHING + "; import outofcuda; print(outofcuda.status()['version'])"],
                       capture_output=True, text=True, env=_clean_env(), cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.split()[:2] == ["1", "True"]


def clean_copy(dest):
    """The checkout without its build outputs (as a fresh clone has it)."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "*.so", ".venv*", "__pycache__", ".pytest_cache",
        ".hypothesis"))
    return dest


def test_sdist_builds_installs_and_hooks(tmp_path):
    """`python -m build` makes an sdist and a wheel from that sdist, with no
    setuptools deprecation warning; `pip install outofcuda-*.tar.gz` into a
    fresh venv installs a working hook."""
    try:
        import build  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("the `build` package is required in CI (requirements-test.txt)")
        pytest.skip("the `build` package is not installed (pip install build)")
    src = clean_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "-o", str(dist), str(src)],
                       capture_output=True, text=True, env=_clean_env(WERROR), timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "deprecat" not in out.lower(), [ln for ln in out.splitlines() if "eprecat" in ln]
    (sdist,) = dist.glob("outofcuda-*.tar.gz")
    import tarfile

    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"outofcuda_hook.pth", "outofcuda_hook.start", "src/oc.h", "src/oc_core.h",
            "src/oc_edge.h", "LICENSE",
            "buildsys/backend.py", "buildsys/hookfiles.py"} <= names
    # tests/test_docs.py, which the sdist carries, reads the reference and the changelog.
    assert {"CHANGELOG.md", "docs/README.md", "docs/environment.md", "docs/layout.md"} <= names
    install_watching(tmp_path, "--no-deps", str(sdist))


def _asan_symbols(wheel_dir, tmp):
    (whl,) = Path(wheel_dir).glob("outofcuda-*.whl")
    with zipfile.ZipFile(whl) as zf:
        so = zf.extract("_outofcuda.abi3.so", tmp)
    syms = subprocess.run(["nm", "-D", so], check=True, capture_output=True, text=True).stdout
    return sum("__asan_" in line for line in syms.splitlines())


def test_a_users_build_warns_without_failing_and_sanitize_builds_reuse_no_objects(tmp_path):
    """-Werror belongs to CI and development (OUTOFCUDA_BUILD_WERROR=1, which the
    tests set): a warning the user's compiler adds (-Wpadded stands in for one)
    leaves a user's build working. OUTOFCUDA_BUILD_SANITIZE=1 pip wheel . after
    that plain build in the same folder gives an instrumented extension, and a
    plain build after it an uninstrumented one: neither reuses the other's
    object files."""
    src = clean_copy(tmp_path / "src")
    kinds = [("plain", {"CFLAGS": "-Wpadded"}), ("sanitize", {"OUTOFCUDA_BUILD_SANITIZE": "1"}),
             ("plain-again", {})]
    found = {}
    for name, env in kinds:
        out = tmp_path / name
        r = build_wheel(src, out, **env)
        assert r.returncode == 0, (name, r.stderr[-4000:])
        assert (src / "build").is_dir()
        found[name] = _asan_symbols(out, tmp_path / (name + "-so"))
    assert found["plain"] == 0 and found["plain-again"] == 0, found
    assert found["sanitize"] > 0, found
    shutil.rmtree(src / "build")
    r = build_wheel(src, tmp_path / "dev", CFLAGS="-Wpadded", **WERROR)
    assert r.returncode != 0 and "-Werror=padded" in r.stdout + r.stderr, r.stderr[-2000:]


SUBINTERPRETER = """
try:
    import _interpreters as interpreters  # 3.13+
except ImportError:
    import _xxsubinterpreters as interpreters
code = (
    "import outofcuda\\n"
    "try:\\n"
    "    outofcuda.status()\\n"
    "except ImportError as exc:\\n"
    "    print('ImportError:', exc)\\n"
)
iid = interpreters.create()
interpreters.run_string(iid, code)
interpreters.destroy(iid)
"""


@pytest.mark.parametrize("version", ["3.11", "3.12", "3.13"])
def test_subinterpreter_gets_the_right_message(wheel, tmp_path, version):
    """In a subinterpreter the extension refuses to load (3.12+ own-GIL
    interpreters: CPython's own refusal; shared-GIL ones: outofcuda's). The
    message says why, rather than calling the file missing or damaged."""
    py = make_venv(pyenv_python(version), tmp_path / "v")
    pip(py, "install", "--no-deps", str(wheel))
    r = subprocess.run([str(py), "-c", SUBINTERPRETER], capture_output=True, text=True,
                       env=_clean_env(), cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("ImportError:")]
    assert "is present but cannot be loaded in this interpreter" in line, line
    assert "works only in the main interpreter" in line, line
    assert "missing" not in line, line


MISSING = """
import outofcuda
try:
    outofcuda.status()
except ImportError as exc:
    print(exc)
"""


# ---- advice that reinstalls from where this copy came from (PEP 610) ----


def doctor(py, cwd, *args):
    """`outofcuda doctor --json` (or another sub-command) in the venv:
    (exit code, JSON, {check name: check})."""
    r = subprocess.run([str(py), "-m", "outofcuda", *(args or ("doctor",)), "--json"],
                       capture_output=True, text=True, env=_clean_env(), cwd=cwd, timeout=300)
    d = json.loads(r.stdout)
    return r.returncode, d, {c["name"]: c for c in d.get("checks", [])}


def test_advice_reinstalls_from_the_wheel_file(wheel, tmp_path):
    """Installed from a wheel file, every reinstall advice (doctor's, the
    import error of a damaged install) names that file and this Python's pip,
    never the name on the package index, and the command repairs the install
    (a missing engine is called missing); once the file is gone the advice
    says so and gives no command."""
    whl = tmp_path / "dist" / wheel.name
    whl.parent.mkdir()
    shutil.copy2(wheel, whl)
    py = make_venv(sys.executable, tmp_path / "v")
    pip(py, "install", "--no-deps", str(whl))
    command = [str(py), "-m", "pip", "install", "--force-reinstall", "--no-deps", str(whl)]
    _, d, _ = doctor(py, tmp_path)
    assert {k: d["reinstall"][k] for k in ("source", "path", "exists", "command")} == \
        {"source": "file", "path": str(whl), "exists": True, "command": command}
    site = subprocess.run([str(py), "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (so,) = Path(site).glob("_outofcuda*.so")
    so.unlink()
    r = subprocess.run([str(py), "-c", MISSING], capture_output=True, text=True,
                       env=_clean_env(), cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "is missing from" in r.stdout and "cannot be loaded" not in r.stdout, r.stdout
    assert shlex.join(command) in r.stdout and "outofcuda>=" not in r.stdout, r.stdout
    subprocess.run(command, check=True, capture_output=True, env=_clean_env(), cwd=tmp_path)
    r = subprocess.run([str(py), "-c", WATCHING], capture_output=True, text=True, env=_clean_env())
    assert r.stdout.split() == ["1", "True"], r.stderr
    whl.unlink()
    _, d, _ = doctor(py, tmp_path)
    assert (d["reinstall"]["source"], d["reinstall"]["exists"], d["reinstall"]["command"]) == \
        ("file", False, None)
    assert str(whl) in d["reinstall"]["advice"]
    # What pip records for a VCS URL (PEP 610), and no record at all (an index,
    # another installer): the commit pinned; a sentence and no command.
    (info,) = Path(site).glob("outofcuda-*.dist-info")
    sha = "0123456789abcdef0123456789abcdef01234567"
    (info / "direct_url.json").write_text(json.dumps(
        {"url": "https://example.org/outofcuda.git", "subdirectory": "pkg",
         "vcs_info": {"vcs": "git", "commit_id": sha, "requested_revision": "main"}}))
    _, d, _ = doctor(py, tmp_path)
    assert (d["reinstall"]["source"], d["reinstall"]["command"]) == ("vcs", command[:-1] + [
        f"git+https://example.org/outofcuda.git@{sha}#subdirectory=pkg"])
    (info / "direct_url.json").unlink()
    _, d, checks = doctor(py, tmp_path)
    assert (d["reinstall"]["source"], d["reinstall"]["command"]) == ("unknown", None)
    assert "checkout or the wheel" in d["reinstall"]["advice"]


def test_start_kind_on_an_older_python_is_named_and_reinstalled_from_the_folder(tmp_path):
    """`OUTOFCUDA_BUILD_HOOK_FILE=start pip install <folder>` on a Python
    before 3.15 warns at build time, and doctor names the .start file that
    Python never runs; its fix, run by a shell, reinstalls from that folder
    with the .pth kind, and the hook fires."""
    src = clean_copy(tmp_path / "src")
    py = make_venv(sys.executable, tmp_path / "v")
    start = _clean_env(dict(WERROR, OUTOFCUDA_BUILD_HOOK_FILE="start"))
    r = subprocess.run([str(py), "-m", "pip", "install", "-v", "--no-deps", str(src)], env=start,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Python {sys.version_info[0]}.{sys.version_info[1]}, which builds it, never runs a " \
        ".start file" in r.stdout + r.stderr
    assert START in site_files(py) and "outofcuda_hook.pth" not in site_files(py)
    rc, d, checks = doctor(py, tmp_path)
    command = [str(py), "-m", "pip", "install", "--force-reinstall", "--no-deps", str(src)]
    assert rc == 1 and checks["hook_file"]["code"] == "start_file_unread", checks["hook_file"]
    assert (d["reinstall"]["source"], d["reinstall"]["command"]) == ("folder", command)
    fix = checks["hook_file"]["fix"]
    assert fix.endswith(": OUTOFCUDA_BUILD_HOOK_FILE=pth " + shlex.join(command)), fix
    # The shell the fix is pasted into may still have =start exported.
    subprocess.run(["sh", "-c", fix.split(": ", 1)[1]], env=start, check=True,
                   capture_output=True, cwd=tmp_path, timeout=600)
    assert "outofcuda_hook.pth" in site_files(py) and START not in site_files(py)
    _, _, checks = doctor(py, tmp_path)
    assert checks["hook_file"]["code"] == "fires", checks["hook_file"]


# Appended to the boot's source to rebuild it at another size.
BOOT_CHANGE = '\nconst char oc_rebuilt_in_place[] = "' + "x" * 5000 + '";\n'


def test_editable_install_rebuilt_in_place_is_named_reinstalled_and_uninstalls_clean(tmp_path):
    """An editable install has the hook; once its C files are rebuilt in
    place, the .pth loads the boot only at the size it was built at, so the
    hook stays off; doctor and status say the boot's size changed (not "see
    status for the error"), and the fix is `pip install -e` of that checkout,
    which brings it back. Uninstalling leaves the environment as it was."""
    src = clean_copy(tmp_path / "src")
    py, before = install_watching(tmp_path, "-e", str(src))
    # No private setuptools API: the root files come from the in-tree PEP 517
    # backend's build_editable.
    assert "_create_wheel_file" not in (ROOT / "setup.py").read_text()
    command = [str(py), "-m", "pip", "install", "--no-deps", "-e", str(src)]
    _, d, checks = doctor(py, tmp_path)
    assert (d["reinstall"]["source"], d["reinstall"]["command"]) == ("editable", command)
    assert checks["hook_file"]["code"] == "fires", checks["hook_file"]
    boot_c = src / "src" / "boot.c"
    boot_c.write_text(boot_c.read_text() + BOOT_CHANGE)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=src,
                   check=True, capture_output=True, env=_clean_env(WERROR), timeout=600)
    rc, d, checks = doctor(py, tmp_path)
    assert rc == 1 and checks["hook_file"]["code"] == "boot_size_changed", checks["hook_file"]
    assert checks["hook_file"]["fix"].endswith(shlex.join(command))
    _, st, _ = doctor(py, tmp_path, "status")
    assert st["hook"]["state"] == "boot_size_changed" and st["hook"]["problem"]
    subprocess.run(command, check=True, capture_output=True, env=_clean_env(WERROR), timeout=600)
    _, _, checks = doctor(py, tmp_path)
    assert checks["hook_file"]["code"] == "fires", checks["hook_file"]
    pip(py, "uninstall", "-y", "outofcuda")
    assert site_files(py) == before


def readme_commands():
    """The two shell commands under README's "Two commands": install, test."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)\n```", section, re.S)
    assert len(blocks) == 2, blocks
    return blocks, section


def test_readme_setup_commands_are_what_ci_runs():
    """The test command is the line .ci/run runs; both commands start from a
    fresh clone (they make their own virtual environment, install nothing
    into the system interpreter) and name one interpreter, python3."""
    (install, tests), section = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    ci_lines = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.startswith("#")]
    assert tests in ci_lines, tests
    for cmd in (install, tests):
        assert "\n" not in cmd and cmd.startswith("python3 -m venv "), cmd
        assert not re.search(r"(?<![\w/.-])python(?![\w.])", cmd), cmd
        assert "bin/pip " not in cmd and not re.search(r"(^|&& )pip", cmd), cmd
    venv_dir = tests.split()[3]
    assert all(part.startswith(f"{venv_dir}/bin/python3 ") for part in tests.split(" && ")[1:])
    assert "C compiler" in section and "Python headers" in section
    # Every tool CI installs is named where the README lists them.
    (apt,) = re.findall(r"apt-get install -y -qq ([^>]*)", ci)
    for package in apt.split():
        named = "clang sanitizer runtime" if package.startswith("libclang-rt") else package
        assert named in " ".join(section.split()), package


def test_readme_install_command_works(tmp_path):
    """The README's first command, run as written from a fresh copy of the
    checkout (its venv path moved into tmp_path): the hook reports on stderr,
    and on this CPU-only build torch's autotuner stays at torch's default."""
    (install, _), _ = readme_commands()
    src = clean_copy(tmp_path / "src")
    cmd = install.replace("/tmp/oc", str(tmp_path / "oc"))
    assert cmd != install
    r = subprocess.run(["bash", "-c", cmd], cwd=src, capture_output=True, text=True,
                       env=_clean_env(), timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip() == "cuDNN autotuner: False", r.stdout
    assert "torch 2.13.0" in r.stderr and "cudnn_benchmark" in r.stderr, r.stderr
    assert "this torch build has no CUDA" in r.stderr, r.stderr
