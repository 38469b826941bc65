"""The command line, run as users run it: `python -m outofcuda ...` in a fresh
interpreter of the test venv (built wheel + real torch)."""
import json
import re

import pytest

from conftest import ROOT
from fake_torch import make_fake_torch
from kit import oc_h_table, oc_headers

STATUS_KEYS = {"version", "python", "executable", "hook", "torch", "torch_error", "cuda",
               "cuda_initialized_by_import", "optimizations", "config_warnings", "gpus",
               "nvml_error", "known_bugs", "cuda_init"}
CHECKS = ["hook_file", "extension", "torch", "alloc_conf", "nvidia_tf32_override",
          "cuda_visible_devices", "dev_shm", "multiple_installs", "older_package", "python_no_site",
          "outofcuda_env", "known_bugs", "amp_dtype"]


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
    # Installed and turned off: neither missing nor a problem.
    assert d["hook"]["state"] == "disabled_by_env" and d["hook"]["problem"] is None
    r = cli(venv, "doctor", "--json", env={"OUTOFCUDA_DISABLE": "1"}, cwd=workdir)
    hook = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["hook_file"]
    assert (r.returncode, hook["ok"], hook["code"]) == (0, True, "disabled_by_env"), hook


def test_doctor_under_python_minus_s_says_site_is_disabled(venv, workdir):
    """`python -S` runs no hook file: doctor says so (site disabled), not
    that the hook file is missing, and advises no reinstall."""
    r = venv.run(None, args=("-S", "-m", "outofcuda", "doctor", "--json"),
                 env={"PYTHONPATH": str(venv.site)}, cwd=workdir, timeout=300)
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert r.returncode == 1
    assert (checks["hook_file"]["ok"], checks["hook_file"]["code"]) == (False, "site_disabled")
    assert "reinstall" not in checks["hook_file"]["fix"]
    assert not checks["python_no_site"]["ok"]


def test_doctor_healthy_environment(venv, workdir):
    r = cli(venv, "doctor", "--json", cwd=workdir)
    d = json.loads(r.stdout)
    assert [c["name"] for c in d["checks"]] == CHECKS
    bad = [c for c in d["checks"] if not c["ok"]]
    assert r.returncode == 0 and d["healthy"], bad
    # A CPU-only build: nothing to fix, and doctor says what outofcuda can do there.
    assert d["scope"].startswith("this torch build has no CUDA: outofcuda changes nothing here")
    text = cli(venv, "doctor", cwd=workdir)
    assert text.returncode == 0 and "\nhealthy" not in text.stdout
    assert "nothing to fix, but outofcuda can do little here: this torch build has no CUDA" \
        in " ".join(text.stdout.split())


def _failed(r):
    return {c["name"]: c for c in json.loads(r.stdout)["checks"] if not c["ok"]}


def test_doctor_notes_user_allocator_override(venv, workdir):
    r = cli(venv, "doctor", "--json", env={"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
            cwd=workdir)
    check = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["alloc_conf"]
    assert check["ok"] and "max_split_size_mb:64 (default 128)" in check["message"]


@pytest.mark.parametrize("value", [
    # outofcuda's own defaults, as a child of outofcuda inherits them
    "garbage_collection_threshold:0.8,expandable_segments:True",
    "expandable_segments:False",           # the README's way out of expandable segments
    "max_split_size_mb:512",               # without expandable segments beside it
])
def test_doctor_accepts_defaults_and_the_documented_fix(venv, workdir, value):
    r = cli(venv, "doctor", "--json", env={"PYTORCH_CUDA_ALLOC_CONF": value}, cwd=workdir)
    assert "alloc_conf" not in _failed(r), r.stdout


@pytest.mark.parametrize("env,var", [
    # outofcuda 0.2.0's own default, as its children inherited it
    ({"PYTORCH_CUDA_ALLOC_CONF":
      "max_split_size_mb:128,garbage_collection_threshold:0.8,expandable_segments:True"},
     "PYTORCH_CUDA_ALLOC_CONF"),
    ({"OUTOFCUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:256"},
     "OUTOFCUDA_ALLOC_CONF"),
])
def test_doctor_names_max_split_beside_expandable_segments(venv, workdir, env, var):
    r = cli(venv, "doctor", "--json", env=env, cwd=workdir)
    assert r.returncode == 1
    check = _failed(r)["alloc_conf"]
    assert var in check["message"] and "123548" in check["message"]
    assert f"remove max_split_size_mb from {var}" in check["fix"]
    assert "expandable_segments:False" in check["fix"]


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


def test_doctor_finds_the_older_packages_leftovers(wheel, tmp_path):
    """What another project's pure-Python `outofcuda` 0.1.0 leaves when it is
    not removed cleanly: a .pth importing outofcuda._hook, its modules in the
    package folder, its metadata. doctor names each and how to remove them."""
    import shutil
    import subprocess
    import sys

    from conftest import Venv, _clean_env

    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "v")], check=True,
                   env=_clean_env())
    v = Venv(tmp_path / "v")
    subprocess.run([str(v.python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   check=True, env=_clean_env())
    planted = [v.site / "outofcuda.pth", v.site / "outofcuda" / "_hook.py",
               v.site / "outofcuda" / "optimizer.py", v.site / "outofcuda-0.1.0.dist-info"]
    planted[0].write_text("import outofcuda._hook\n")
    planted[1].write_text('"""The older package\'s start-up hook (stand-in)."""\n')
    planted[2].write_text("")
    planted[3].mkdir()
    (planted[3] / "METADATA").write_text("Metadata-Version: 2.1\nName: outofcuda\nVersion: 0.1.0\n")
    r = cli(v, "doctor", "--json", cwd=tmp_path)
    check = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["older_package"]
    assert r.returncode == 1 and not check["ok"], check
    for path in planted:
        assert str(path) in check["message"] and str(path) in check["fix"], (path, check)
    assert check["fix"].startswith("rm -r ")
    # This package's own files are not named.
    for own in ("outofcuda_hook.pth", "__init__.py", "monitor.py", "cli.py"):
        assert f"/{own}" not in check["message"], check
    # Doing what the fix says clears the check.
    planted[0].unlink(), planted[1].unlink(), planted[2].unlink()
    shutil.rmtree(planted[3])
    r = cli(v, "doctor", "--json", cwd=tmp_path)
    check = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["older_package"]
    assert check["ok"], check


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


@pytest.mark.parametrize("command", ["status", "doctor", "report", "bench"])
def test_bad_option_shows_the_subcommands_usage(venv, workdir, command):
    r = cli(venv, command, "--bogus", cwd=workdir)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"usage: outofcuda {command} "), r.stderr
    assert f"outofcuda {command}: error: unrecognized arguments: --bogus" in r.stderr


def test_version(venv, workdir):
    version = re.search(r'#define OC_VERSION "([^"]+)"', oc_headers())[1]
    r = cli(venv, "--version", cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"outofcuda {version}"


def test_report_text_by_default_json_on_request(venv, workdir):
    """What the help says is what it does: text, JSON with --json."""
    help_text = cli(venv, "--help", cwd=workdir).stdout
    (line,) = [ln for ln in help_text.splitlines() if ln.strip().startswith("report ")]
    assert "text" in line and "--json" in line and "as JSON" not in line, line
    assert "--json prints" in " ".join(cli(venv, "report", "--help", cwd=workdir).stdout.split())
    plain = cli(venv, "report", cwd=workdir)
    # The reason is the one `status` gives under GPUs.
    why = json.loads(cli(venv, "status", "--json", cwd=workdir).stdout)["nvml_error"]
    assert plain.returncode == 0, plain.stderr
    assert " ".join(plain.stdout.split()) == f"no CUDA device ({why})"   # wrapped at 80
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.stdout)
    assert json.loads(cli(venv, "report", "--json", cwd=workdir).stdout) == {}


def test_doctor_names_a_bad_value_once_without_a_raw_warning(venv, workdir):
    env = {"OUTOFCUDA_NUM_WORKERS": "many"}
    r = cli(venv, "doctor", env=env, cwd=workdir)
    assert r.returncode == 1
    assert r.stderr == "", r.stderr
    assert r.stdout.count("OUTOFCUDA_NUM_WORKERS='many'") == 1, r.stdout
    assert "FIX  outofcuda_env" in r.stdout


# ---- the text tables at 80 columns ----

WIDTH = 80
NAME_COL, APPLIED_COL, VALUE_COL, REASON_COL = 2, 23, 32, 6


def _squash(text):
    """Text without the blanks and commas a wrap may add or drop."""
    return re.sub(r"[\s,]", "", text)


def _plain(v):
    return "-" if v is None else str(v)


def parse_table(lines):
    """{name: {applied, value, below}} from the optimisation table: a row
    per optimisation (name, applied, value at fixed columns), the value's
    continuation lines from VALUE_COL, the reason below from REASON_COL."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith("  optimisation "))
    header = lines[start]
    assert header.index("applied") == APPLIED_COL and header.index("value") == VALUE_COL, header
    rows, cur = {}, None
    for ln in lines[start + 1:]:
        if not ln.strip() or ln.startswith("  error:"):
            break
        if ln[NAME_COL] != " ":
            name = ln[NAME_COL:APPLIED_COL].strip()
            assert re.fullmatch(r"\w+", name) and ln[APPLIED_COL - 1] == " ", ln
            assert ln[APPLIED_COL:VALUE_COL].strip() in ("yes", "no", "queued", "off"), ln
            assert ln[VALUE_COL] != " " and ln[VALUE_COL - 1] == " ", ln
            cur = rows[name] = {"applied": ln[APPLIED_COL:VALUE_COL].strip() == "yes",
                                "queued": ln[APPLIED_COL:VALUE_COL].strip() == "queued",
                                "off": ln[APPLIED_COL:VALUE_COL].strip() == "off",
                                "value": [ln[VALUE_COL:]], "below": []}
        elif ln.startswith(" " * VALUE_COL) and not cur["below"]:
            cur["value"].append(ln.strip())
        else:
            assert ln.startswith(" " * REASON_COL) and ln[REASON_COL] != " ", ln
            cur["below"].append(ln[REASON_COL:])
    return rows


def overflows(lines):
    """Lines past WIDTH other than those a word longer than any line holds
    makes: a path or an allocator string is never broken, so it stands whole
    on its line, the one word past a label, the table's columns or the
    line's indentation (all at or before VALUE_COL)."""
    bad = []
    for ln in (ln for ln in lines if len(ln) > WIDTH):
        word = ln.rsplit(" ", 1)[-1]
        start = len(ln) - len(word)
        if start > VALUE_COL or len(word) <= WIDTH - start:
            bad.append(ln)
    return bad


def check_table(lines, optimizations, known_bugs=None):
    """Every line fits (but for a word longer than a line), columns line up,
    and nothing of status() is lost."""
    assert not overflows(lines), overflows(lines)
    rows = parse_table(lines)
    if known_bugs is not None:
        # The known-bugs row, as the README's table has one: the verdicts
        # counted, and a line for each row that is not "not affected".
        row = rows.pop("known_bugs")
        assert row["applied"] is any(b["code"] == "avoided" for b in known_bugs)
        off = sum(b["code"] == "off" for b in known_bugs)
        unaffected = sum(b["verdict"] == "not_affected" for b in known_bugs)
        assert row["value"] == [f"{unaffected} of {len(known_bugs)} not affected"], row
        shown = [b for b in known_bugs if b["verdict"] != "not_affected"]
        said = ([shown[0]["reason"]] if off == len(known_bugs) else
                [f"{b['id']}: {b['verdict']}, {b['code']}: {b['reason']}" for b in shown])
        assert _squash("".join(row["below"])) == _squash("".join(said))
    assert sorted(rows) == sorted(optimizations)
    for name, e in optimizations.items():
        row = rows[name]
        assert row["applied"] is e["applied"], name
        assert row["queued"] is bool(e.get("queued")), name
        assert row["off"] is bool(e.get("off_by")), name
        v = e["value"]
        got = _squash("".join(row["value"]))
        if isinstance(v, dict):
            # In the table's key order (`status --json` sorts the keys).
            assert all(f"{k}=" in got for k in v), (name, row["value"], v)
            want = "".join(f"{k}={_plain(v[k])}" for k in sorted(v, key=lambda k: got.find(f"{k}=")))
        else:
            want = _plain(v)
        assert got == _squash(want), (name, row["value"], v)
        assert _squash("".join(row["below"])) == _squash(e["reason"]), (name, row["below"])
    return rows


def test_verbose_table_fits_80_columns(venv, workdir):
    # A CUDA build (the stand-in torch): on the CPU build most values are
    # empty, and the dict values are what overflowed the column.
    root = make_fake_torch(workdir / "fake", "2.14.1")
    r = venv.run("import json, torch, _outofcuda; print(json.dumps(_outofcuda.status()))",
                 env={"OUTOFCUDA_VERBOSE": "1", "PYTHONPATH": str(root)}, cwd=workdir)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    lines = r.stderr.splitlines()
    table = lines[next(i for i, ln in enumerate(lines) if ln.startswith("outofcuda ")):]
    rows = check_table(table, st["optimizations"], st["known_bugs"])
    # print(outofcuda.status()) shows the same table.
    shown = venv.run("import torch, outofcuda; print(outofcuda.status())",
                     env={"PYTHONPATH": str(root)}, cwd=workdir).stdout.splitlines()
    assert shown == table[1:], shown
    # The allocator string stands whole on one line, never broken.
    assert rows["allocator"]["value"] == [st["optimizations"]["allocator"]["value"]]
    # The dict values are shown as key=value, never as a Python repr.
    starts = [ln.split("=")[0] for ln in rows["oom_handler"]["value"] if "=" in ln]
    assert starts == list(st["optimizations"]["oom_handler"]["value"]), rows["oom_handler"]
    assert not any("{" in ln or "': " in ln for ln in table), table


def test_the_cli_wraps_as_the_verbose_table(venv, workdir):
    """One rule for breaking lines: the CLI's rows break as the engine's
    table (report.c) breaks a reason."""
    got = venv.json("""
import json, _outofcuda
from outofcuda import cli
def table(text):
    row = {"state": "skipped", "code": "c", "value": None, "reason": text}
    return _outofcuda._status_text({"optimizations": {"a": row}})
cases = [("/usr/lib/python3/site-packages/" * 3, 40, 6), ("a " * 50, 80, 16),
         ("expandable_segments:True,garbage_collection_threshold:0.8", 20, 32),
         ("\u00e9" * 100, 48, 32), ("short", 10, 0),
         ("hook file /venv/lib/python3.11/site-packages/outofcuda_hook.pth is present", 40, 40),
         ("      " + "\u00e9" * 40 + " b", 36, 6),
         ("hook file       /" + "a" * 70, 80, 16), ("hook file       /" + "a" * 70, 80, 6)]
print(json.dumps([[cli._wrap(*c) for c in cases], cli.WIDTH,
                  [[table(c[0]).splitlines()[2:], cli._wrap(" " * 6 + c[0], 80, 6)]
                   for c in cases]]))
""", cwd=workdir)
    engine, width, reasons = got
    assert width == WIDTH
    for table, mine in reasons:
        assert table == mine
    path, blanks, alloc, accents, short, sentence, indented, label, early = engine
    # Only at a blank, which is eaten; a word longer than the line (a path,
    # an allocator string) stands whole on its line, past the width.
    assert path == ["/usr/lib/python3/site-packages/" * 3]
    assert blanks == ["a " * 39 + "a", " " * 16 + "a " * 10]
    assert alloc == ["expandable_segments:True,garbage_collection_threshold:0.8"]
    assert accents == ["\u00e9" * 100]
    assert short == ["short"]
    assert sentence == ["hook file", " " * 40 + "/venv/lib/python3.11/site-packages/outofcuda_hook.pth",
                        " " * 40 + "is present"]
    # The leading blanks are no place to break: the word too long for the
    # line stays after them.
    assert indented == ["      " + "\u00e9" * 40, "      b"]
    # A long word right after a label (at or before the continuation
    # column) stays on the label's line: the next line would give it no more
    # room; and the label's padding never ends a line.
    assert label == ["hook file       /" + "a" * 70]
    assert early == ["hook file", "      /" + "a" * 70]


def test_status_text_fits_80_columns(venv, workdir):
    st = json.loads(cli(venv, "status", "--json", cwd=workdir).stdout)
    r = cli(venv, "status", cwd=workdir)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    check_table(lines, st["optimizations"], st["known_bugs"])
    assert len(lines) <= 30 and "..." not in r.stdout, len(lines)  # one screen (CPU build)
    # Hook file paths stand whole on a line (never broken), the NVML reason
    # wraps; nothing is cut.
    for f in st["hook"]["files"]:
        assert any(f["path"] in ln.split() for ln in lines), f["path"]
    assert _squash(st["nvml_error"]) in _squash(r.stdout)
    # The known bugs that cannot apply here are not named (check_table: one
    # count on the known_bugs row).
    for b in st["known_bugs"]:
        assert (f"{b['id']}:" in r.stdout) is (b["verdict"] != "not_affected"), b["id"]


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


# ---- one owner for each fact: doctor and status ask the engine ----


def _checks(r):
    return {c["name"]: c for c in json.loads(r.stdout)["checks"]}


@pytest.mark.parametrize("value,off", [("0", True), (" 0", True), ("0\t", True), ("1", False),
                                       ("00", False)])
def test_tf32_override_is_one_verdict(cuda_venv, workdir, value, off):
    """NVIDIA_TF32_OVERRIDE: what the hook does on a CUDA build and what doctor
    says come from one rule (blanks around "0" still mean off)."""
    env = {"NVIDIA_TF32_OVERRIDE": value}
    st = json.loads(cli(cuda_venv, "status", "--json", env=env, cwd=workdir).stdout)
    tf32 = st["optimizations"]["tf32"]
    assert (tf32["code"] == "tf32_override") is off, tf32
    if off:
        assert tf32["applied"] is False
    check = _checks(cli(cuda_venv, "doctor", "--json", env=env, cwd=workdir))
    assert check["nvidia_tf32_override"]["ok"] is not off, check["nvidia_tf32_override"]


PLAN = """
import json, _outofcuda
print(json.dumps(_outofcuda._api_loader_plan(False)))
"""


def test_doctor_checks_shared_memory_for_the_dataloaders_plan(venv, workdir):
    """doctor names the worker count smart_dataloader would use (capped at the
    CPUs) and the /dev/shm threshold it warns at."""
    env = {"OUTOFCUDA_NUM_WORKERS": "64"}
    plan = json.loads(venv.check(PLAN, env=env, cwd=workdir).stdout)
    check = _checks(cli(venv, "doctor", "--json", env=env, cwd=workdir))["dev_shm"]
    assert f"for {plan['num_workers']} workers" in check["message"], check
    assert f"want >= {plan['shm_min_bytes'] >> 20:,} MiB" in check["message"], check
    assert check["ok"] is plan["shm_enough"]


SHM_SCENARIO = """
mount -t tmpfs -o size={size}m tmpfs /dev/shm || exit 77
{python} -m outofcuda doctor --json > {out}/doctor.json
{python} -W error::RuntimeWarning -c '
import torch, outofcuda
outofcuda.smart_dataloader(torch.utils.data.TensorDataset(torch.zeros(2)), batch_size=1)
' 2> {out}/loader.err
echo $? > {out}/loader.rc
"""


@pytest.mark.parametrize("size_mib", [300, 600])
def test_doctor_and_smart_dataloader_agree_on_a_small_dev_shm(venv, workdir, size_mib):
    """A /dev/shm of its own (a private mount namespace): doctor flags it exactly
    when smart_dataloader warns about it."""
    import shutil
    import subprocess

    from conftest import _clean_env

    if shutil.which("unshare") is None:
        pytest.skip("unshare is missing")
    script = SHM_SCENARIO.format(size=size_mib, python=venv.python, out=workdir)
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                       env=_clean_env({"OUTOFCUDA_NUM_WORKERS": "4"}), cwd=workdir,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here: {r.stderr.strip()[-200:]}")
    check = {c["name"]: c for c in json.loads((workdir / "doctor.json").read_text())["checks"]}
    warned = (workdir / "loader.rc").read_text().strip() != "0"
    assert warned == (size_mib < 512), (workdir / "loader.err").read_text()
    assert check["dev_shm"]["ok"] is not warned, check["dev_shm"]


def test_doctor_reads_the_allocator_variable_torch_reads(venv, workdir):
    """torch 2.13 reads the first allocator variable that is set, an empty one
    included: a malformed value in a variable it does not read is no problem."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments"}
    r = cli(venv, "doctor", "--json", env=env, cwd=workdir)
    check = _checks(r)["alloc_conf"]
    assert check["ok"], check
    assert re.search(r"PYTORCH_ALLOC_CONF is set but torch 2\.13\.0\S* reads "
                     r"PYTORCH_CUDA_ALLOC_CONF", check["message"]), check


OOM_REPORT = """
import json, outofcuda, _outofcuda as core
core._oom_observer(0, 2 << 30, 80 << 30, 1 << 29)
rep = outofcuda.last_oom()
print(json.dumps([rep["allocator_config"], rep["expandable_segments"]]))
"""


@pytest.mark.parametrize("env,conf,expandable", [
    # the empty variable torch reads first hides the other
    ({"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "",
     False),
    # the last entry wins, blanks around the colon are allowed (torch's tokenizer)
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True,expandable_segments:False"},
     "expandable_segments:True,expandable_segments:False", False),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments : True"}, "expandable_segments : True", True),
])
def test_oom_report_reads_the_allocator_as_torch_does(venv, workdir, env, conf, expandable):
    r = venv.check(OOM_REPORT, env=env, cwd=workdir)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [conf, expandable]


@pytest.mark.parametrize("value,disabled", [("\u20031", False), ("\u00a0yes", False),
                                            (" 1\t", True)])
def test_disable_switch_is_read_as_the_boot_reads_it(venv, workdir, value, disabled):
    """OUTOFCUDA_DISABLE with a Unicode blank is not a boolean to the C side (the
    hook fires): status and doctor say the same."""
    env = {"OUTOFCUDA_DISABLE": value}
    d = json.loads(cli(venv, "status", "--json", env=env, cwd=workdir).stdout)
    assert d["hook"]["fired"] is not disabled
    assert d["hook"]["disabled_by_env"] is disabled
    check = _checks(cli(venv, "doctor", "--json", env=env, cwd=workdir))["hook_file"]
    assert check["code"] == ("disabled_by_env" if disabled else "fires"), check


# ---- what a new user ran into ----


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["doctor"],
                                  ["doctor", "--json"], ["report", "--json"]])
def test_a_closed_pipe_ends_quietly(venv, workdir, args):
    """`outofcuda status | head -1`: the reader goes away before the output
    comes; the command stops without a traceback."""
    import subprocess

    from conftest import _clean_env

    with subprocess.Popen([str(venv.python), "-m", "outofcuda", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, cwd=workdir, env=_clean_env()) as p:
        p.stdout.close()
        err = p.stderr.read().decode()
        rc = p.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err == "" and rc == 141


@pytest.mark.parametrize("args", [["status"], ["doctor", "--json"]])
def test_closed_standard_output_is_one_line_not_a_traceback(venv, workdir, args):
    """`outofcuda status >&-`: nowhere to answer; one line on stderr says so."""
    import subprocess

    from conftest import _clean_env

    r = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", str(venv.python), "-m", "outofcuda",
                        *args], capture_output=True, text=True, cwd=workdir, env=_clean_env(),
                       timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr == "outofcuda: standard output is closed; nothing can be shown\n"
    assert r.returncode == 1


def test_bench_accepts_what_its_usage_shows(venv, workdir):
    """Every option bench's usage names is one `outofcuda bench` accepts, and
    --help names the workloads and where results go."""
    help_text = " ".join(cli(venv, "bench", "--help", cwd=workdir).stdout.split())
    for word in ("--timeout", "--no-plot", "gpt_fp32", "mlp", "./bench-results"):
        assert word in help_text, word
    r = cli(venv, "bench", "--smoke", "--no-plot", "--timeout", "0", cwd=workdir)
    assert r.returncode == 2 and "unrecognized arguments" not in r.stderr, r.stderr
    assert "--timeout must be positive" in r.stderr and "--no-plot" in r.stderr


def test_status_without_torch_says_one_thing(venv, workdir, tmp_path):
    """torch that cannot be imported (a broken copy first on the path): the
    header and the table give the same reason."""
    broken = tmp_path / "broken" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this torch is broken')\n")
    r = cli(venv, "status", env={"PYTHONPATH": str(broken.parent)}, cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert "not importable (ImportError: this torch is broken)" in " ".join(r.stdout.split())
    assert "has not been imported" not in r.stdout, r.stdout
    assert "torch is not importable: nothing was applied" in r.stdout, r.stdout


def test_source_tree_shadowing_is_named(venv, tmp_path):
    """`python -m outofcuda` in a checkout: the checkout's outofcuda/ (no built
    extension) comes first on sys.path; the message says so, not "reinstall"."""
    import shutil

    tree = tmp_path / "checkout"
    shutil.copytree(ROOT / "outofcuda", tree / "outofcuda",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (tree / "src").mkdir()
    for header in (ROOT / "src").glob("*.h"):  # oc.h and the headers it includes
        shutil.copy2(header, tree / "src" / header.name)
    shutil.copy2(ROOT / "setup.py", tree / "setup.py")
    r = cli(venv, "status", cwd=tree)
    assert r.returncode == 1
    assert "source tree" in r.stderr and "shadows the installed package" in r.stderr, r.stderr
    assert str(venv.site) in r.stderr and "reinstall" not in r.stderr


def test_report_without_a_driver_fits_80_columns(venv, workdir):
    """No NVIDIA driver here: the one sentence that says so wraps at 80."""
    r = cli(venv, "report", cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("no CUDA device (")
    assert max(len(ln) for ln in r.stdout.splitlines()) <= 80, r.stdout


def test_report_bug_block_has_what_collect_env_does_not(venv, cuda_venv, workdir):
    # The CUDA build (no GPU here): outofcuda sets the allocator through
    # torch's setter at import, which only torch's getter shows.
    env = {"OUTOFCUDA_ALLOC_CONF": "expandable_segments:True"}
    d = json.loads(cli(cuda_venv, "report", "--bug", "--json", env=env, cwd=workdir).stdout)
    assert d["hook"]["fired"] is True and d["version"] and d["error"] is None
    assert d["allocator_getter"] is True and d["cuda_initialized"] is False
    assert "expandable_segments:True" in d["settings"]["allocator_settings"]
    assert d["optimizations"]["allocator"]["applied"] is True
    assert isinstance(d["optimizations"]["cudnn_benchmark"]["now"], bool)
    assert d["settings"]["autocast_dtype.cuda"].startswith("torch.")
    assert d["environment"] == env
    # What was skipped, each with its reason.
    assert all(isinstance(why, str) and why for why in d["skipped"].values())
    # The CPU build: torch's flags, the allocator skipped with its reason.
    d = json.loads(cli(venv, "report", "--bug", "--json", cwd=workdir).stdout)
    assert "allocator" in d["skipped"] and d["cuda"] is None
    text = cli(venv, "report", "--bug", cwd=workdir).stdout
    assert text.startswith("```\n") and text.rstrip().endswith("```")


def _shell_commands(text):
    """The argument lists of the commands a shell runs when text is pasted
    into it: a line each, a line ending in a backslash joined to the next;
    lines a shell could not read (unbalanced quotes in prose) left out."""
    import shlex

    out = []
    for line in text.replace("\\\n", "").splitlines():
        try:
            out.append(shlex.split(line))
        except ValueError:
            pass
    return out


def test_doctors_reinstall_command_pastes_into_a_shell_whole(venv, workdir):
    """A checkout whose path has a blank, installed as a folder, whose hook
    file is the .start kind Python before 3.15 never runs: doctor's fix is
    the reinstall with OUTOFCUDA_BUILD_HOOK_FILE=pth. Pasted into a shell, its
    text runs that one command: the path whole, the assignment on the same
    command (a line of its own would set an unexported shell variable)."""
    import shlex

    if venv.run("import sys; print(sys.version_info >= (3, 15))").stdout.strip() == "True":
        pytest.skip("3.15 and later run the .start file")
    checkout = workdir / "a checkout with a long name" / "and a blank in it"
    checkout.mkdir(parents=True)
    (info,) = [i for i in venv.site.glob("outofcuda-*.dist-info")
               if "_outofcuda." in (i / "RECORD").read_text()]
    url, pth = info / "direct_url.json", venv.site / "outofcuda_hook.pth"
    saved_url, saved_pth = url.read_bytes() if url.exists() else None, pth.read_bytes()
    start = venv.site / "outofcuda_hook.start"
    try:
        # Files of this environment's copy are replaced, never written into
        # (the copy shares them with the master environment).
        url.unlink(missing_ok=True)
        url.write_text(json.dumps({"url": checkout.as_uri(), "dir_info": {}}))
        pth.unlink()
        start.write_text("outofcuda_hook:install\n")
        text = cli(venv, "doctor", cwd=workdir)
        d = json.loads(cli(venv, "doctor", "--json", cwd=workdir).stdout)
    finally:
        start.unlink(missing_ok=True)
        pth.write_bytes(saved_pth)
        url.unlink(missing_ok=True)
        if saved_url is not None:
            url.write_bytes(saved_url)
    argv = ["OUTOFCUDA_BUILD_HOOK_FILE=pth", str(venv.python), "-m", "pip", "install",
            "--force-reinstall", "--no-deps", str(checkout)]
    hook = {c["name"]: c for c in d["checks"]}["hook_file"]
    assert (text.returncode, hook["code"], hook["commands"]) == (1, "start_file_unread",
                                                                [shlex.join(argv)]), hook
    assert argv in _shell_commands(text.stdout), text.stdout
    # On lines of its own, broken at blanks outside quotes (within 80
    # columns where its words allow), each line but the last ending in " \\".
    lines = text.stdout.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith(argv[0]))
    last = next(i for i in range(first, len(lines)) if not lines[i].endswith(" \\"))
    assert last > first and all(len(ln) <= 80 or len(shlex.split(ln.removesuffix(" \\"))) == 1
                                for ln in lines[first:last + 1]), lines[first:last + 1]


def test_names_and_values_from_the_environment_reach_the_terminal_escaped(venv, workdir):
    """An OUTOFCUDA_* name outofcuda does not read, and its value, may hold
    any bytes but '=': the import warning, doctor and `report --bug` (made
    for pasting) show the same escaped text, a terminal gets no escape
    sequence and no character that turns the text after it around."""
    name = "OUTOFCUDA_X\x1b]0;owned\x07\u202eY"
    env = {name: "v\x1b[2J\u2066", "OUTOFCUDA_TF32": "maybe\x1b[31m\u200b"}
    name_shown = "OUTOFCUDA_X\\x1b]0;owned\\x07\\u202eY"
    hostile = {"\x1b", "\x07", "\u202e", "\u2066", "\u200b"}
    r = venv.run("import torch", env=env, cwd=workdir)
    doctor = cli(venv, "doctor", env=env, cwd=workdir)
    bug = cli(venv, "report", "--bug", env=env, cwd=workdir)
    status = cli(venv, "status", env=env, cwd=workdir)
    for out in (r.stderr, doctor.stdout, bug.stdout, status.stdout):
        assert not hostile & set(out), out
    assert f"ignoring {name_shown}:" in r.stderr, r.stderr
    assert "OUTOFCUDA_TF32='maybe\\x1b[31m\\u200b'" in r.stderr, r.stderr
    for out in (doctor.stdout, status.stdout):
        assert f"ignoring {name_shown}:" in " ".join(out.split()), out
    assert f"{name_shown}=v\\x1b[2J\\u2066" in bug.stdout, bug.stdout
    assert "OUTOFCUDA_TF32=maybe\\x1b[31m\\u200b" in bug.stdout, bug.stdout


# ---- one word for each optimisation's state, in every table ----

# Every off switch, each with the row it turns off ("known_bugs": the
# known-bugs row), and OUTOFCUDA_DISABLE, which turns off every row.
OFF_SWITCHES = {"OUTOFCUDA_TF32": ("0", "tf32"), "OUTOFCUDA_CUDNN_BENCHMARK": ("off", "cudnn_benchmark"),
                "OUTOFCUDA_ALLOC_CONF": ("off", "allocator"),
                "OUTOFCUDA_MEMORY_FRACTION": ("off", "memory_fraction"),
                "OUTOFCUDA_AMP_DTYPE": ("off", "amp_dtype"), "OUTOFCUDA_KNOWN_BUGS": ("off", "known_bugs")}


@pytest.mark.parametrize("switches", [{}, {k: v for k, (v, _) in OFF_SWITCHES.items()},
                                      {"OUTOFCUDA_DISABLE": "1"}], ids=["defaults", "off", "disable"])
def test_the_three_tables_say_the_same_word(venv, workdir, switches):
    """The verbose table, `outofcuda status` and `report --bug` give each
    optimisation and the known bugs the same applied word, on the stand-in
    CUDA build: "off" for what a switch turned off, and for everything under
    OUTOFCUDA_DISABLE (where the verbose table is one line)."""
    names = oc_h_table("OC_OPTIMISATIONS") + ["known_bugs"]
    env = dict(switches, PYTHONPATH=str(make_fake_torch(workdir / "fake", "2.14.1")))

    def words(text):
        found = {m[1]: m[2] for m in re.finditer(r"^  (\w+) +(yes|no|queued|off) ", text, re.M)
                 if m[1] in names}
        assert sorted(found) == sorted(names), text
        return found
    verbose = venv.check("import torch", env=dict(env, OUTOFCUDA_VERBOSE="1"), cwd=workdir).stderr
    status = words(cli(venv, "status", env=env, cwd=workdir).stdout)
    assert words(cli(venv, "report", "--bug", env=env, cwd=workdir).stdout) == status
    if "OUTOFCUDA_DISABLE" in switches:
        assert set(status.values()) == {"off"}, status
        assert verbose.splitlines() == ["outofcuda: off by OUTOFCUDA_DISABLE: torch imports as "
                                        "without outofcuda"], verbose
        return
    assert words(verbose) == status, (verbose, status)
    offs = {n for n, w in status.items() if w == "off"}
    assert offs == {row for _, row in OFF_SWITCHES.values() if switches}, status


# ---- the CLI on stand-ins of old releases (tests/releases.json) ----

@pytest.mark.parametrize("release", ["2.0.1", "2.14.1"])
def test_doctor_names_the_allocator_defaults_this_torch_got(venv, workdir, release):
    # 2.0 has no expandable segments: outofcuda gives it max_split_size_mb
    # instead, and doctor says what status() says was given.
    root = make_fake_torch(workdir / f"fake-{release}", release)
    env = {"PYTHONPATH": str(root)}
    status = json.loads(cli(venv, "status", "--json", env=env, cwd=workdir).stdout)
    given = status["optimizations"]["allocator"]["value"]
    assert ("expandable_segments" in given) == (release != "2.0.1"), given
    check = {c["name"]: c for c in json.loads(cli(venv, "doctor", "--json", env=env,
                                                  cwd=workdir).stdout)["checks"]}["alloc_conf"]
    assert check["message"].startswith(f"no user allocator settings (defaults: {given})"), check


@pytest.mark.parametrize("release,version", [("2.0.1", None), ("2.1.0", "2.3.1"),
                                             ("2.4.1", None)])
def test_report_bug_reads_the_autocast_dtype_with_the_releases_getter(venv, workdir, release,
                                                                      version):
    # get_autocast_dtype(device) from 2.4; before it get_autocast_gpu_dtype()
    # and get_autocast_cpu_dtype().
    root = make_fake_torch(workdir / f"fake-{release}", release, version=version)
    d = json.loads(cli(venv, "report", "--bug", "--json", env={
        "PYTHONPATH": str(root), "OUTOFCUDA_AMP_DTYPE": "bfloat16"}, cwd=workdir).stdout)
    assert d["torch"] == (version or release)
    assert d["settings"]["autocast_dtype.cuda"] == "torch.bfloat16", d["settings"]
    assert d["settings"]["autocast_dtype.cpu"] == "torch.bfloat16", d["settings"]
