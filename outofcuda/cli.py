"""The ``outofcuda`` command line: status, doctor, report, bench.

Every sub-command prints aligned text for people, or JSON with ``--json``.
The CLI process never imports torch: what the hook does is observed in a
fresh interpreter (the same Python) that imports torch, which is what a
user's program would see.

Example::

    $ outofcuda status --json | python -c "import json,sys; print(json.load(sys.stdin)['hook'])"
    $ outofcuda doctor; echo "exit $?"     # 0 healthy, 1 needs attention, 2 bad arguments
"""
import argparse
import json
import os
import re
import shlex
import site
import subprocess
import sys
import warnings
from pathlib import Path

from . import _origin
from ._native import core

HOOK_NAME = "outofcuda_hook.pth"
START_NAME = "outofcuda_hook.start"
MIN_TORCH = (2, 0)
PROBE_TIMEOUT_S = 180
# The hook file's fast path: the boot it loads and the size it loads it at
# (buildsys/hookfiles.py writes both into the template's line).
_BOOT_AT = re.compile(r"p=(sitedir\+)?'([^']*)'.*?st_size==(\d+)")

# Runs in a fresh interpreter of the same Python. The working directory is
# dropped from sys.path so a stray torch.py or _outofcuda.py there cannot
# stand in for the installed ones.
_PROBE = r"""
import json, os, sys
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
out = {"torch": None, "cuda": None, "torch_error": None, "extension": None,
       "extension_error": None, "status": None, "cuda_initialized": None}
torch = None
try:
    import torch
    out["torch"] = str(torch.__version__)
    out["cuda"] = getattr(torch.version, "cuda", None)
except BaseException as e:
    out["torch_error"] = "%s: %s" % (type(e).__name__, e)
try:
    import _outofcuda
    out["extension"] = getattr(_outofcuda, "__file__", None)
    out["status"] = _outofcuda.status()
except BaseException as e:
    out["extension_error"] = "%s: %s" % (type(e).__name__, e)
if torch is not None:
    try:
        out["cuda_initialized"] = bool(torch.cuda.is_initialized())
    except BaseException as e:
        out["cuda_initialized"] = None
# The known-bugs table decided in full for doctor: this probe may load cuDNN
# to read its version (the hook itself waits for CUDA's start to do that).
out["known_bugs_check"] = None
try:
    cudnn = None
    if torch is not None and getattr(torch.version, "cuda", None):
        cudnn = torch._C._cudnn.getVersionInt()
    out["known_bugs_check"] = _outofcuda._known_bugs_check(
        out["torch"], None if torch is None else (out["cuda"] or False), cudnn,
        _outofcuda._visible_ccs(), dict(os.environ))
except Exception:
    pass
sys.stdout.write("\n@@OUTOFCUDA@@" + json.dumps(out, default=str) + "\n")
"""


# ---------------------------------------------------------------- probes


def _real_site_dirs():
    """The directories whose .pth files `site` processes at start-up."""
    dirs = []
    try:
        dirs += list(site.getsitepackages())
    except AttributeError:  # some virtualenv-patched site modules lack it
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:
        pass
    return dirs


def _site_dirs():
    """site-packages directories, then the rest of sys.path, without repeats."""
    dirs = _real_site_dirs() + [p for p in sys.path if p]
    seen, result = set(), []
    for d in dirs:
        key = os.path.realpath(d)
        if key not in seen and os.path.isdir(d):
            seen.add(key)
            result.append(d)
    return result


def hook_files():
    """Every outofcuda_hook.pth / .start on this interpreter's site dirs.

    >>> [f["path"].rsplit("/", 1)[-1] for f in hook_files()]  # one, .pth up to 3.17
    ['outofcuda_hook...']
    """
    found = []
    real = {os.path.realpath(d) for d in _real_site_dirs()}
    for d in _site_dirs():
        for name in (HOOK_NAME, START_NAME):
            p = Path(d) / name
            if p.is_file():
                found.append({"path": str(p), "kind": name.rsplit(".", 1)[1],
                              "site_dir": os.path.realpath(d) in real,
                              "loadable": _hook_line_ok(p), "boot": _boot_of(p)})
    return found


def _boot_of(path):
    """The boot a .pth line loads: {"path", "expected_size" (the size the line
    loads it at), "size" (what the file has now, None when it is missing)},
    or None for a .start file or a line of another form."""
    if path.suffix != ".pth":
        return None
    try:
        m = _BOOT_AT.search(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
    if m is None:
        return None
    boot = str(path.parent) + m.group(2) if m.group(1) else m.group(2)
    try:
        size = os.stat(boot).st_size
    except OSError:
        size = None
    return {"path": boot, "expected_size": int(m.group(3)), "size": size}


def _hook_line_ok(path):
    """True when the hook file holds what site can run: one import line
    (.pth) or one module:callable entry (.start)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    if len(lines) != 1:
        return False
    if path.suffix == ".start":
        return re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", lines[0].strip()) is not None
    if not lines[0].startswith(("import ", "import\t")):
        return False
    try:
        compile(lines[0], str(path), "exec")
    except SyntaxError:
        return False
    return True


def probe(timeout=PROBE_TIMEOUT_S):
    """What a fresh interpreter of this Python sees when it imports torch.

    Returns the probe dict (torch/cuda versions, the extension's status(),
    whether CUDA got initialised) plus ``exit_code`` and ``stderr``.

    >>> probe()["status"]["hook"]["fired"]
    True
    """
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the probe interpreter did not finish within {timeout} s",
                "exit_code": None, "stderr": ""}
    marker = r.stdout.rfind("@@OUTOFCUDA@@")
    if marker < 0:
        return {"error": "the probe interpreter printed no result", "exit_code": r.returncode,
                "stderr": r.stderr[-2000:]}
    data = json.loads(r.stdout[marker + len("@@OUTOFCUDA@@"):])
    data.update(error=None, exit_code=r.returncode, stderr=r.stderr[-2000:])
    return data


def gpus():
    """(list of GPUs from NVML, reason or None). Never creates a CUDA context."""
    devices, reason = core.nvml_devices()
    return list(devices), reason


def outofcuda_installs():
    """Directories on sys.path that hold an outofcuda package or extension."""
    found = []
    for d in _site_dirs():
        p = Path(d)
        if (p / "outofcuda" / "__init__.py").is_file() or any(p.glob("_outofcuda*.so")):
            found.append(str(p))
    return found


def _config():
    """core.config() without its warnings: the CLI shows bad OUTOFCUDA_*
    values itself (doctor's outofcuda_env check), once."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return core.config()


def _torch_tuple(version):
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


# What the engine escapes in text from outside the process (oc_escape_text,
# src/config.c): control characters as \xNN, characters that reorder or hide
# the text around them (bidi controls, zero-width ones) as \uXXXX, and the
# bytes os.environ could not decode (surrogate escapes) as \xNN.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u180e\u200b-\u200f\u2028-\u202e"
                     "\u2060-\u206f\ufeff\ufff9-\ufffb\udc80-\udcff]")


def _escape(m):
    c = ord(m.group())
    c = c - 0xdc00 if c >= 0xdc80 else c
    return ("\\x%02x" if c < 0x100 else "\\u%04x") % c


def escaped(text):
    r"""text as a terminal may get it: a variable's name or value, a path,
    anything outofcuda did not write itself.

    >>> escaped("OUTOFCUDA_X\x1b[2J\u202e")
    'OUTOFCUDA_X\\x1b[2J\\u202e'
    """
    return _UNSAFE.sub(_escape, str(text))


# ---------------------------------------------------------------- status


def status_data():
    """Everything `outofcuda status` shows, as a JSON-ready dict."""
    files = hook_files()
    pr = probe()
    st = pr.get("status") or {}
    devices, nvml_reason = gpus()
    hook = st.get("hook") or {}
    optimizations = st.get("optimizations") or {}
    known_bugs = st.get("known_bugs") or []
    state, ok, message, _fix, _command = _hook_verdict(files, pr)
    if pr.get("torch") is None and pr.get("torch_error"):
        # The probe's import failed: "not imported yet", what the engine can
        # say from inside, would contradict the header's "not importable".
        optimizations = {name: dict(e, reason="torch is not importable: nothing was applied")
                         for name, e in optimizations.items()}
        known_bugs = [dict(e, reason="torch is not importable: nothing was decided")
                      for e in known_bugs]
    return {
        "version": core.__version__,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "hook": {
            "files": files,
            "present": any(f["kind"] == "pth" and f["site_dir"] for f in files),
            "disabled_by_env": core._disabled_by_env(),
            "installed": bool(hook.get("installed")),
            "fired": bool(hook.get("fired")),
            "error": hook.get("error") or pr.get("extension_error") or pr.get("error"),
            # doctor's hook_file verdict: "fires", "disabled_by_env" (installed
            # and turned off), or what keeps the hook from loading
            "state": state,
            "problem": None if ok else message,
        },
        "torch": pr.get("torch"),
        "torch_error": pr.get("torch_error"),
        "cuda": pr.get("cuda"),
        "cuda_initialized_by_import": pr.get("cuda_initialized"),
        "optimizations": optimizations,
        "known_bugs": known_bugs,
        "cuda_init": st.get("cuda_init"),
        "config_warnings": st.get("config_warnings") or [],
        "gpus": devices,
        "nvml_error": nvml_reason,
    }


# Text output fits 80 columns and cuts nothing: long values wrap onto
# continuation lines, broken as the engine's status table (which `status` and
# `report --bug` print as the engine renders it) by the engine's own rule.
WIDTH = 80
LABEL = 16  # "hook fires      yes"


def _wrap(text, first, indent):
    """Lines of at most ``first`` characters (the first) and WIDTH - indent
    (the rest, prefixed with indent spaces), broken only at blanks."""
    return core._wrap(text, first, indent)


def _row(label, value):
    return _wrap(f"{label:<{LABEL}}{value}", WIDTH, LABEL)


def _mib(n):
    return f"{n / 2**20:,.0f} MiB"


def _render_gpus(d):
    if not d["gpus"]:
        return _row("GPUs", f"none ({d['nvml_error']})")
    # GPU 4, name 30, cc 5, memory 25, driver 16 = 80.
    lines = [f"{'GPU':<4}{'name':<30}{'cc':<5}{'memory used / total':<25}driver"]
    for g in d["gpus"]:
        cc = ".".join(str(x) for x in g["compute_capability"])
        mem = f"{_mib(g['used'])} / {_mib(g['total'])}"
        name = _wrap(g["name"], 29, 0)
        lines.append(f"{g['index']:<4}{name[0]:<30}{cc:<5}{mem:<25}{g['driver']}")
        lines += [" " * 4 + part for part in name[1:]]
    return lines


def _render_status(d):
    h = d["hook"]
    lines = [f"outofcuda {d['version']}"]
    lines += _row("Python", f"{d['python']}, {d['executable']}")
    files = [f["path"] for f in h["files"]] or ["not found"]
    for i, path in enumerate(files):
        lines += _row("hook file" if i == 0 else "", path)
    fires = "yes" if h["fired"] else "no"
    if h["state"] == "disabled_by_env":
        fires += ": installed, off by OUTOFCUDA_DISABLE"
    lines += _row("hook fires", fires)
    if h["error"]:
        lines += _row("hook error", h["error"])
    elif h["problem"]:
        lines += _row("hook problem", h["problem"])
    lines += _row("torch", d["torch"] or f"not importable ({d['torch_error']})")
    lines += _row("CUDA (torch)", d["cuda"] or "none (CPU build)" if d["torch"] else "-")
    if d["cuda_initialized_by_import"] is not None:
        lines += _row("CUDA at import", "initialised (unexpected)"
                      if d["cuda_initialized_by_import"] else "not initialised")
    lines.append("")
    # The engine's table (the verbose table's): each row's reason, and the
    # known bugs that cannot apply here counted on one line.
    lines += core._status_text({k: d[k] for k in ("optimizations", "known_bugs", "cuda_init")
                                if d.get(k) is not None}).rstrip("\n").split("\n")
    for w in d["config_warnings"]:
        lines += _wrap(f"warning: {w}", WIDTH, 9)
    lines.append("")
    lines += _render_gpus(d)
    return "\n".join(lines)


# ---------------------------------------------------------------- doctor


def _check(name, ok, message, fix="", code=None, commands=()):
    """One check: ``code`` is the verdict in a word, for machines (the
    hook_file check always has one); ``commands`` are the shell commands the
    fix gives, each written whole in it, which the text prints on lines of
    their own. Text from outside (paths, values) is escaped."""
    return {"name": name, "ok": bool(ok), "message": escaped(message),
            "fix": "" if ok else escaped(fix), "code": code,
            "commands": [] if ok else [escaped(c) for c in commands if c]}


def _hook_kinds():
    """The hook files site runs on this Python: from 3.18 on it ignores a
    .pth's import lines; 3.15 to 3.17 run either; before 3.15 site knows no
    .start file."""
    if sys.version_info >= (3, 18):
        return ("start",)
    return ("pth", "start") if sys.version_info >= (3, 15) else ("pth",)


def _reinstall(build_env=""):
    """(fix, command): how to reinstall this copy from where it came from
    (PEP 610), and the shell command that ends it (None where there is
    none), with build_env (e.g. ``OUTOFCUDA_BUILD_HOOK_FILE=pth``) before the
    command where it is built from source."""
    o = _origin.origin()
    command = _origin.join(o["command"]) if o["command"] else None
    if command and build_env:
        if o["source"] in ("editable", "folder", "vcs") or str(o["path"] or "").endswith(
                (".tar.gz", ".zip")):
            command = f"{build_env} {command}"
            return f"reinstall outofcuda from {o['path'] or o['url']}: {command}", command
        return ("install the cp39-abi3 wheel (built without OUTOFCUDA_BUILD_HOOK_FILE=start) "
                "instead of " + (o["path"] or o["url"])), None
    return o["advice"], command


def _hook_verdict(files, pr):
    """(code, ok, message, fix, command) of the hook file: what site would run
    at the next start of this Python and whether the hook would install; the
    fix's shell command or None."""
    if sys.flags.no_site:
        return ("site_disabled", False, "site is disabled (Python runs with -S): this "
                "interpreter runs no hook file, whichever is installed",
                "start Python without -S, or call `outofcuda.apply()` before importing torch",
                None)
    kinds = _hook_kinds()
    name = START_NAME if kinds == ("start",) else HOOK_NAME
    runs = [f for f in files if f["kind"] in kinds and f["site_dir"]]
    version = "%d.%d" % sys.version_info[:2]
    if not runs:
        unread = [f["path"] for f in files if f["site_dir"] and f["kind"] not in kinds]
        if unread and unread[0].endswith(".start"):
            return ("start_file_unread", False,
                    f"{unread[0]} is installed, but Python {version} never runs a .start file "
                    "(3.15 and later do): it was built with OUTOFCUDA_BUILD_HOOK_FILE=start, "
                    "so the hook never loads",
                    *_reinstall("OUTOFCUDA_BUILD_HOOK_FILE=pth"))
        if unread:
            return ("pth_file_unread", False,
                    f"{unread[0]} is installed, but Python {version} runs no import line of a "
                    ".pth file: it needs the .start kind (the cp318-abi3 wheel)",
                    *_reinstall("OUTOFCUDA_BUILD_HOOK_FILE=start"))
        elsewhere = [f["path"] for f in files if f["kind"] in kinds]
        where = (f" (only in {elsewhere[0]}, where site does not run hook files)"
                 if elsewhere else "")
        return ("missing", False, f"{name} is not in any site-packages directory{where}",
                *_reinstall())
    bad = [f for f in runs if not f["loadable"]]
    if bad:
        what = "one module:function entry" if bad[0]["kind"] == "start" else "one import line"
        return ("damaged", False, f"{bad[0]['path']} is damaged (not {what})", *_reinstall())
    for f in runs:
        boot = f.get("boot")
        if boot and boot["size"] is None:
            return ("boot_missing", False, f"the boot {boot['path']} that {f['path']} loads is "
                    "missing, so the hook loads nothing", *_reinstall())
        if boot and boot["size"] != boot["expected_size"]:
            return ("boot_size_changed", False,
                    f"the boot's size changed: {boot['path']} is {boot['size']} bytes, and "
                    f"{f['path']} loads it only at {boot['expected_size']} bytes (the C files "
                    "were rebuilt or replaced after the install), so the hook loads nothing "
                    "until outofcuda is installed again",
                    *_reinstall())
    if core._disabled_by_env():
        return ("disabled_by_env", True, f"{runs[0]['path']} is installed and off by "
                "OUTOFCUDA_DISABLE: torch imports as without outofcuda", "", None)
    st = pr.get("status") or {}
    if not (st.get("hook") or {}).get("installed"):
        fix, command = _reinstall()
        return ("not_installed", False,
                f"{runs[0]['path']} is present but the hook did not install in a fresh "
                "interpreter", "run `outofcuda status` for the error; " + fix, command)
    return ("fires", True, f"{runs[0]['path']} loads and installs the watcher", "", None)


def _check_hook(files, pr):
    code, ok, message, fix, command = _hook_verdict(files, pr)
    return _check("hook_file", ok, message, fix, code=code, commands=[command])
def _check_extension(pr):
    if pr.get("extension_error") or pr.get("error"):
        fix, command = _reinstall()
        return _check("extension", False, "the C extension does not load in a fresh "
                      f"interpreter: {pr.get('extension_error') or pr.get('error')}", fix,
                      commands=[command])
    err = ((pr.get("status") or {}).get("hook") or {}).get("error")
    if err:
        return _check("extension", False, f"outofcuda recorded an error: {err}",
                      "report it with the output of `outofcuda status --json`")
    if pr.get("cuda_initialized"):
        return _check("extension", False, "CUDA was initialised during `import torch`",
                      "find what initialises CUDA at import (OUTOFCUDA_DISABLE=1 to compare)")
    return _check("extension", True, f"loads from {pr.get('extension') or core.__file__}")


def _check_torch(pr):
    version = pr.get("torch")
    if version is None:
        return _check("torch", False, f"torch is not importable: {pr.get('torch_error')}",
                      "pip install torch (outofcuda acts only when torch is imported)")
    t = _torch_tuple(version)
    if t is None or t < MIN_TORCH:
        return _check("torch", False, f"torch {version} is older than 2.0",
                      "pip install -U 'torch>=2.0'")
    return _check("torch", True, f"torch {version} is supported")


def _check_alloc_conf(torch_version=None, allocator=None):
    # allocator: status()'s allocator record from the probe, whose value is
    # the string outofcuda gave this torch (its defaults as this release takes them)
    cfg = _config()
    platform = core._platform()
    # outofcuda's defaults as this platform has them (none of expandable
    # segments where they cannot work), those that join only without
    # expandable segments too
    own, no_expandable = platform["alloc_defaults"], cfg["alloc_conf_no_expandable"]
    own_items, own_split = core._alloc_items(own)
    defaults = dict(core._alloc_items(no_expandable)[0], **dict(own_items))
    notes, malformed, fails_here, paired = [], [], [], []
    if not platform["expandable_segments_work"]:
        notes.append(f"no expandable segments: {platform['why']}")
    if own_split == "inside_expandable":
        paired.append("OUTOFCUDA_ALLOC_CONF")
    # The one variable this torch reads, by the engine's rule (allocconf.c);
    # the others it ignores.
    read, _value = core._alloc_var(torch_version)
    notes += [f"{var} is set but torch {torch_version or '(unknown)'} reads {read}"
              for var in core._alloc_vars() if var != read and var in os.environ]
    for var in (read,):
        user = os.environ.get(var)
        if user is None:
            continue
        try:
            merged, _dropped = core._merge_alloc_conf(own, user, no_expandable=no_expandable)
        except ValueError as e:
            malformed.append(f"{var} is malformed ({e})")
            continue
        # A key set to outofcuda's own value changes nothing; another value is
        # the user's choice (expandable_segments:False is the documented way
        # out) and wins by design: both are notes, never something to fix.
        items, split = core._alloc_items(user)
        items = dict(items)
        if split == "inside_expandable":
            paired.append(var)
        if not platform["expandable_segments_work"] and items.get("expandable_segments") == "True":
            fails_here.append(f"{var} sets expandable_segments:True, which fails on this "
                              f"platform: {platform['why']}")
        kept = [f"{k}:{v} (default {defaults[k]})" for k, v in items.items()
                if k in defaults and v != defaults[k]]
        same = [k for k, v in items.items() if k in defaults and v == defaults[k]]
        note = f"{var}={user}"
        if kept:
            note += f" keeps {', '.join(kept)} over outofcuda's defaults"
        if same:
            note += f"; {', '.join(same)} as outofcuda's defaults"
        if split == "no_expandable":
            note += "; no expandable segments beside its max_split_size_mb"
        notes.append(f"{note} (effective: {merged})")
    if malformed or fails_here:
        return _check("alloc_conf", False, "; ".join(malformed + fails_here),
                      "fix the value (torch would raise on it) or unset the variable" if malformed
                      else "remove expandable_segments:True on this platform")
    if paired:
        names = " and ".join(paired)
        return _check("alloc_conf", False,
                      f"{names} sets max_split_size_mb beside expandable_segments:True: inside "
                      "expandable segments freed blocks above max_split_size are not reused, so "
                      "reserved memory keeps growing (pytorch issue 123548)",
                      f"remove max_split_size_mb from {names} (expandable segments already "
                      "avoid most fragmentation), or set expandable_segments:False there if you "
                      "need max_split_size_mb")
    if read not in os.environ:
        effective = (allocator or {}).get("value")
        if not isinstance(effective, str):
            effective = core._merge_alloc_conf(own, "", no_expandable=no_expandable)[0]
        notes.insert(0, f"no user allocator settings (defaults: {effective or 'none'})")
    return _check("alloc_conf", True, "; ".join(notes))


def _check_tf32_override():
    v = os.environ.get("NVIDIA_TF32_OVERRIDE")
    if core._tf32_forced_off():
        return _check("nvidia_tf32_override", False,
                      f"NVIDIA_TF32_OVERRIDE={v!r} turns TF32 off in every CUDA library",
                      "unset NVIDIA_TF32_OVERRIDE unless you need full float32 precision")
    return _check("nvidia_tf32_override", True,
                  "not set" if v is None else f"NVIDIA_TF32_OVERRIDE={v} (does not force off)")


def _check_amp_dtype(pr):
    # The autocast dtype the hook chose, in the record's own words (its cost
    # and the ways back among them); information, never a fault.
    e = ((pr.get("status") or {}).get("optimizations") or {}).get("amp_dtype") or {}
    return _check("amp_dtype", True, f"{e.get('value') or 'not set'}: {e.get('reason', '-')}",
                  code=(e.get("cost") or {}).get("id"))


def _check_visible_devices():
    # The engine reads the variable as CUDA does (nvml.c): CUDA stops at the
    # first entry it cannot resolve and shows only the devices before it.
    vis = core.visible_devices()
    v, stop = vis["value"], vis["stop"]
    if v is None:
        return _check("cuda_visible_devices", True, "not set: every GPU is visible")
    if vis["visible"] == 0 and stop in (None, "", "-1"):
        return _check("cuda_visible_devices", False,
                      f"CUDA_VISIBLE_DEVICES={v!r} hides every GPU",
                      "unset CUDA_VISIBLE_DEVICES or list the GPUs to use (e.g. 0,1)")
    if stop is not None:
        n = vis["devices"]
        if stop.isdigit() and n is not None:
            why = f"CUDA_VISIBLE_DEVICES names GPU {stop} but NVML sees {n}"
            fix = f"use indices 0..{n - 1}" if n else "unset CUDA_VISIBLE_DEVICES"
        elif stop.startswith(("GPU-", "MIG-")):
            why = f"CUDA_VISIBLE_DEVICES={v!r}: {stop!r} matches no device NVML sees"
            fix = "use the UUIDs `nvidia-smi -L` lists"
        else:
            why = f"CUDA_VISIBLE_DEVICES={v!r}: {stop!r} is neither an index nor a UUID"
            fix = "use comma-separated indices or GPU-/MIG- UUIDs"
        shown = vis["visible"]
        return _check("cuda_visible_devices", False,
                      f"{why}; CUDA stops there and shows {shown} GPU{'s' if shown != 1 else ''}",
                      fix)
    if vis["indices"] is None:
        return _check("cuda_visible_devices", True,
                      f"CUDA_VISIBLE_DEVICES={v} (NVML unavailable: entries not matched to GPUs)")
    return _check("cuda_visible_devices", True, f"CUDA_VISIBLE_DEVICES={v}: NVML GPUs "
                  f"{', '.join(map(str, vis['indices']))}")


def _check_shm(cuda_available):
    # The plan smart_dataloader follows (api.c): the same worker count and the
    # same /dev/shm threshold.
    plan = core._api_loader_plan(cuda_available)
    workers, size, need = plan["num_workers"], plan["shm_bytes"], plan["shm_min_bytes"]
    if workers <= 0:
        return _check("dev_shm", True, "DataLoader workers disabled (OUTOFCUDA_NUM_WORKERS=0)")
    if not plan["shm_present"]:
        return _check("dev_shm", False, f"/dev/shm is missing; {workers} DataLoader workers "
                      "need shared memory", "mount /dev/shm or set OUTOFCUDA_NUM_WORKERS=0")
    if not plan["shm_enough"]:
        return _check("dev_shm", False, f"/dev/shm is {_mib(size)}, small for {workers} "
                      f"DataLoader workers (want >= {_mib(need)})",
                      "docker run --shm-size=8g (or --ipc=host), or OUTOFCUDA_NUM_WORKERS=0")
    return _check("dev_shm", True, f"/dev/shm is {_mib(size)} for {workers} workers "
                  f"(want >= {_mib(need)})")


def _check_installs():
    found = outofcuda_installs()
    if len(found) > 1:
        return _check("multiple_installs", False, "outofcuda found in more than one sys.path "
                      f"directory: {', '.join(found)}",
                      "remove the extra copies; the first on sys.path wins")
    return _check("multiple_installs", True, f"one install: {found[0] if found else '?'}")


# Another project's pure-Python package published as `outofcuda` 0.1.0, with
# the same import name. pip replaces it cleanly on upgrade; what a partial
# removal leaves (its .pth line importing outofcuda._hook, its modules inside
# this package's folder, its metadata) would run, or fail, at every start-up.
OLDER_PACKAGE_MODULES = ("_hook.py", "config.py", "optimizer.py")


def _recorded_files(dist_info):
    """Paths (relative to site-packages) listed in a dist-info's RECORD."""
    try:
        text = (dist_info / "RECORD").read_text(encoding="utf-8")
    except OSError:
        return set()
    return {line.split(",", 1)[0] for line in text.splitlines() if line}


def older_package_leftovers():
    """Files of the older, unrelated `outofcuda` package found on the site dirs."""
    found = []
    for d in _site_dirs():
        site_dir = Path(d)
        for pth in sorted(site_dir.glob("*.pth")):
            try:
                text = pth.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            # This project's hook loads `outofcuda_hook` (the boot); a line
            # importing the package `outofcuda` is the older one's.
            if re.search(r"(?<![\w.])outofcuda\b", text):
                found.append(str(pth))
        ours = set()
        for info in sorted(site_dir.glob("outofcuda-*.dist-info")):
            if info.name == f"outofcuda-{core.__version__}.dist-info":
                ours = _recorded_files(info)
            else:
                found.append(str(info))
        for name in OLDER_PACKAGE_MODULES:
            path = site_dir / "outofcuda" / name
            if path.is_file() and f"outofcuda/{name}" not in ours:
                found.append(str(path))
    return found


def _check_older_package():
    found = older_package_leftovers()
    if found:
        remove = "rm -r " + " ".join(shlex.quote(f) for f in found)
        fix, command = _reinstall()
        return _check("older_package", False,
                      "files of an older, unrelated `outofcuda` package (0.1.0, pure Python) "
                      f"are left beside this one: {', '.join(found)}",
                      f"{remove}; then {fix}", commands=[remove, command])
    return _check("older_package", True, "no files of the older `outofcuda` package")


def _check_no_site():
    if sys.flags.no_site:
        return _check("python_no_site", False, "Python runs with -S: no .pth hook runs",
                      "start Python without -S, or call `outofcuda.apply()` before "
                      "importing torch")
    return _check("python_no_site", True, "site runs (.pth hooks are processed)")


def _check_config(pr):
    bad = list(_config()["warnings"])
    if bad:
        return _check("outofcuda_env", False, "; ".join(bad),
                      "fix the OUTOFCUDA_* value(s) named above")
    return _check("outofcuda_env", True, "OUTOFCUDA_* settings are valid")


def _foreign_contexts():
    """Processes NVML lists on a GPU that is not their LOCAL_RANK's (a
    torchrun rank that used CUDA before torch.cuda.set_device): [(pid,
    local_rank, device)], read from NVML and /proc/PID/environ (this user's
    processes only; no CUDA context)."""
    found = []
    try:
        devices, _ = gpus()
        n = len(devices)
        for d in devices:
            for pid, _bytes in core.nvml_processes(d["index"]):
                try:
                    env = dict(item.split("=", 1) for item in
                               Path(f"/proc/{pid}/environ").read_bytes().decode(
                                   "utf-8", "replace").split("\0") if "=" in item)
                except OSError:
                    continue
                rank = env.get("LOCAL_RANK", "")
                if not rank.isdigit() or int(rank) == 0:
                    continue
                visible = env.get("CUDA_VISIBLE_DEVICES")
                if visible is None:
                    order = list(range(n))
                elif all(v.strip().isdigit() for v in visible.split(",")):
                    order = [int(v) for v in visible.split(",")]
                else:
                    continue  # UUIDs or MIG names: which device is the rank's is not told
                if d["index"] in order and len(order) > 1 and int(rank) < len(order) \
                        and order.index(d["index"]) != int(rank):
                    found.append((pid, int(rank), order.index(d["index"])))
    except Exception:
        return []
    return found


def _check_known_bugs(pr):
    """The known-bugs table decided in full by the probe (which reads the
    cuDNN version); what applies, what outofcuda does about it, what could not
    be decided; processes with a context on another rank's GPU."""
    entries = pr.get("known_bugs_check")
    if entries is None:
        return _check("known_bugs", True, "not checked (no torch or no outofcuda engine)")
    disabled = core._disabled_by_env()
    cfg = _config()
    off_all = not cfg.get("known_bugs", True)
    off_ids = set(cfg.get("known_bugs_off") or ())
    parts, unavoided = [], []
    for b in entries:
        if b["applies"] is None:
            parts.append(f"could not decide {b['id']}: {b['reason']}")
            continue
        if b["applies"] is not True:
            continue
        head = f"{b['id']} applies ({b['title']}; {b['reason']}; {b['evidence']}): "
        fixed = f"; fixed in {b['fixed_in']}" if b.get("fixed_in") else ""
        kind = b.get("kind", "guard")
        if kind == "named":
            parts.append(head + f"fix: {b['fix']}{fixed}")
        elif kind == "own":
            parts.append(head + "outofcuda's own settings avoid it: " + b["action"]
                         + (" (off by OUTOFCUDA_DISABLE: outofcuda sets nothing)" if disabled
                            else ""))
        elif disabled:
            parts.append(head + "off by OUTOFCUDA_DISABLE: nothing avoids it")
            unavoided.append(b)
        elif off_all or b["id"] in off_ids:
            parts.append(head + "off by OUTOFCUDA_KNOWN_BUGS: torch's choice kept" + fixed)
            unavoided.append(b)
        else:
            parts.append(head + "outofcuda avoids it: " + b["action"] + fixed)
    for pid, rank, device in _foreign_contexts():
        parts.append(f"torchrun-gpu0-context: process {pid} (LOCAL_RANK {rank}) holds a context "
                     f"on cuda:{device}, not cuda:{rank} "
                     "(https://github.com/pytorch/pytorch/issues/135279): call "
                     "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before its first CUDA "
                     "use")
    if not parts:
        parts = [f"none of the {len(entries)} known bug(s) applies here"]
    return _check("known_bugs", not unavoided, "; ".join(parts),
                  "; ".join(f"{b['id']}: unset OUTOFCUDA_KNOWN_BUGS, or {b['fix']}"
                            for b in unavoided))


def doctor_data():
    """Run every check; returns {"healthy": bool, "checks": [...]}."""
    pr = probe()
    devices, _ = gpus()
    checks = [
        _check_hook(hook_files(), pr),
        _check_extension(pr),
        _check_torch(pr),
        _check_alloc_conf(pr.get("torch"),
                          ((pr.get("status") or {}).get("optimizations") or {}).get("allocator")),
        _check_tf32_override(),
        _check_visible_devices(),
        _check_shm(bool(devices)),
        _check_installs(),
        _check_older_package(),
        _check_no_site(),
        _check_config(pr),
        _check_known_bugs(pr),
        _check_amp_dtype(pr),
    ]
    return {"healthy": all(c["ok"] for c in checks), "checks": checks,
            "scope": _scope(pr, devices),
            # where this copy came from (PEP 610) and the command that
            # reinstalls it from there: what every reinstall advice names
            "reinstall": _origin.origin()}


def _scope(pr, devices):
    """What outofcuda can do where torch has no CUDA or no GPU is usable
    (None where it can do everything)."""
    if pr.get("torch") is None:
        return None
    if not pr.get("cuda"):
        return ("this torch build has no CUDA: outofcuda changes nothing here (memory_report(), "
                "MemoryMonitor and these commands still run); install a CUDA build of torch "
                "for its settings")
    if not devices:
        return ("no NVIDIA GPU is usable here: the allocator string, cuDNN and SDPA flags are "
                "set at import, but TF32, the memory fraction, the OOM handler and the known-bug "
                "guards stay queued for a CUDA that cannot start")
    return None


# A word of a shell command: what a shell keeps together (quotes included).
_SHELL_WORD = re.compile(r"""(?:[^\s'"\\]+|'[^']*'|"(?:[^"\\]|\\.)*"|\\.)+""")


def _command_lines(command, indent):
    """A shell command on lines of its own, from column indent: broken only
    at blanks outside quotes, each line but the last ending in ` \\`, so that
    pasted into a shell the lines run as the one command (a word longer
    than a line stands alone on its line)."""
    words = _SHELL_WORD.findall(command)
    lines = [" " * indent + words[0]] if words else []
    for word in words[1:]:
        if len(lines[-1]) + len(word) + 3 <= WIDTH:  # room for " word \\"
            lines[-1] += " " + word
        else:
            lines[-1] += " \\"
            lines.append(" " * (indent + 2) + word)
    return lines


def _fix_lines(fix, commands):
    """A check's fix from column 27: its words wrapped, each of its commands
    on lines of its own (never wrapped into the sentence around it)."""
    lines, rest, label = [], fix, "fix:"
    for command in commands + [None]:
        before, found, rest = rest.partition(command) if command else (rest, "", "")
        text = before.strip(" ;")
        if text or label:
            lines += _wrap(f"{'':<27}{label:<5}{text}".rstrip(), WIDTH, 32)
            label = ""
        if found:
            lines += _command_lines(found, 32)
    return lines


def _render_doctor(d):
    lines = []
    for c in d["checks"]:
        lines += _wrap(f"{'ok' if c['ok'] else 'FIX':<5}{c['name']:<22}{c['message']}", WIDTH, 27)
        if c["fix"]:
            lines += _fix_lines(c["fix"], c.get("commands") or [])
    lines.append("")
    if not d["healthy"]:
        lines.append("something needs attention (exit code 1)")
    elif d.get("scope"):
        lines += _wrap("nothing to fix, but outofcuda can do little here: " + d["scope"], WIDTH, 0)
    else:
        lines.append("healthy")
    return "\n".join(lines)


# ---------------------------------------------------------------- report / bench


def _render_processes(procs, indent):
    """memory_report()'s `processes` of one device, one line each."""
    lines = []
    for p in procs:
        used = "? GiB" if p["used_gb"] is None else f"{p['used_gb']:.3f} GiB"
        lines.append(f"{' ' * indent}{p['pid']:>8}  {p['name'] or '(unknown)':<20}{used:>14}"
                     + ("  (this process)" if p["this_process"] else ""))
    return lines


def _render_tree(d, indent=0):
    lines = []
    width = max((len(str(k)) for k in d), default=0) + 2
    for k, v in d.items():
        if k == "processes" and (v is None or isinstance(v, list)):
            if v:
                lines.append(" " * indent + f"{k}")
                lines += _render_processes(v, indent + 2)
            else:
                lines.append(" " * indent + f"{k:<{width}}"
                             + ("none" if v == [] else "unknown (NVML cannot list them)"))
        elif isinstance(v, dict):
            lines.append(" " * indent + f"{k}")
            lines += _render_tree(v, indent + 2)
        else:
            lines.append(" " * indent + f"{str(k):<{width}}{v}")
    return lines


def _benchmarks_dir(given):
    """The checkout's benchmarks folder (start-up benchmark), or None."""
    candidates = [Path(given)] if given else [
        Path.cwd() / "benchmarks", Path(__file__).resolve().parent.parent / "benchmarks"]
    for c in candidates:
        if (c / "startup.py").is_file():
            return c
    return None


# ---------------------------------------------------------------- main


def _parser():
    # SUPPRESS in the sub-commands: their default would otherwise overwrite a
    # `--json` given before the sub-command name.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON for machines")
    p = argparse.ArgumentParser(
        prog="outofcuda",
        description="Inspect outofcuda, check the environment, run the benchmarks. "
                    "Without a sub-command: status.")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--version", action="version", version=f"outofcuda {core.__version__}")
    sub = p.add_subparsers(dest="command", metavar="{status,doctor,report,bench}")
    sub.add_parser("status", parents=[common], help="what the hook does in a fresh interpreter",
                   description="Is the hook installed and would it fire; what every "
                   "optimisation does and why; torch/CUDA versions; GPUs (NVML, no CUDA context).")
    sub.add_parser("doctor", parents=[common], help="check the environment (exit 1: attention)",
                   description="Checks with a one-line fix each. Exit 0 healthy, 1 attention.")
    rp = sub.add_parser("report", parents=[common],
                        help="memory figures per GPU (text; JSON with --json)",
                        description="Per-device memory figures from outofcuda.memory_report() "
                        "(NVML, no CUDA context) as text; --json prints the same dict as JSON. "
                        "--bug prints a block for a bug report instead.")
    rp.add_argument("--bug", action="store_true",
                    help="a block to paste into a bug report: outofcuda's version and hook, "
                    "the allocator, TF32, cuDNN and autocast settings torch reports, what "
                    "outofcuda applied or skipped and why")
    from . import bench

    b = sub.add_parser("bench", parents=[common], help="run the gain benchmarks",
                       description="Runs the gain benchmark shipped in the package "
                       "(outofcuda.bench): tiny CPU smoke sizes without a GPU, full sizes on a "
                       "GPU; results go to --out (./bench-results by default). --startup adds "
                       "the start-up tax benchmark of a checkout.")
    bench.add_arguments(b, json=False)
    b.add_argument("--startup", action="store_true",
                   help="also run benchmarks/startup.py of a checkout (builds two venvs; minutes)")
    b.add_argument("--benchmarks-dir", help="checkout folder holding startup.py (default: "
                   "./benchmarks, then the checkout this package runs from)")
    # Each sub-command answers a bad argument with its own usage line.
    p.subcommands = sub.choices
    return p


# ---------------------------------------------------------------- report --bug

# Runs in a fresh interpreter (the hook fires there as in the user's program):
# the settings torch itself says are in effect, each read alone (a read that
# raises is shown, not fatal), and what outofcuda did, with each of its
# optimisations' flags as torch has them now (status()'s "now"). Nothing here
# initialises CUDA: torch's flags and the allocator getter are host-side.
_BUG_PROBE = r"""
import json, os, sys
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
out = {"torch": None, "cuda": None, "torch_error": None, "settings": {}, "status": None,
       "status_error": None, "cuda_initialized": None}

def read(name, fn):
    try:
        v = fn()
        out["settings"][name] = v if isinstance(v, (bool, int, float, type(None))) else str(v)
    except BaseException as e:
        out["settings"][name] = {"error": "%s: %s" % (type(e).__name__, e)}

try:
    import torch
    out["torch"] = str(torch.__version__)
    out["cuda"] = getattr(torch.version, "cuda", None)
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        read("allocator_settings", getter)
    read("float32_matmul_precision", lambda: torch.get_float32_matmul_precision())
    read("cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32)
    read("cudnn.enabled", lambda: torch.backends.cudnn.enabled)
    # 2.4+ has one getter; before it, one per device type
    get = getattr(torch, "get_autocast_dtype", None)
    read("autocast_dtype.cuda", lambda: get("cuda") if get else torch.get_autocast_gpu_dtype())
    read("autocast_dtype.cpu", lambda: get("cpu") if get else torch.get_autocast_cpu_dtype())
    out["cuda_initialized"] = bool(torch.cuda.is_initialized())
except BaseException as e:
    out["torch_error"] = "%s: %s" % (type(e).__name__, e)
try:
    import _outofcuda
    out["status"] = _outofcuda.status()
except BaseException as e:
    out["status_error"] = "%s: %s" % (type(e).__name__, e)
sys.stdout.write("\n@@OUTOFCUDA@@" + json.dumps(out, default=str) + "\n")
"""

# The variables a bug report needs besides torch's own view: outofcuda's, and
# the foreign ones outofcuda acts on.
_BUG_ENV_PREFIXES = ("OUTOFCUDA_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                     "PYTORCH_HIP_ALLOC_CONF", "NVIDIA_TF32_OVERRIDE", "CUDA_VISIBLE_DEVICES",
                     "TORCH_CUDNN_SDPA_DEPRIORITIZED")


def bug_report_data(timeout=PROBE_TIMEOUT_S):
    """What `outofcuda report --bug` shows, as a JSON-ready dict: outofcuda's
    version and hook state, the settings torch reports in effect in a fresh
    interpreter (the allocator's from torch's own getter where torch has
    one), outofcuda's decisions with their reasons, and the environment
    variables that steer them."""
    try:
        r = subprocess.run([sys.executable, "-c", _BUG_PROBE], capture_output=True, text=True,
                           timeout=timeout)
        marker = r.stdout.rfind("@@OUTOFCUDA@@")
        pr = (json.loads(r.stdout[marker + len("@@OUTOFCUDA@@"):]) if marker >= 0 else
              {"error": "the probe interpreter printed no result", "stderr": r.stderr[-2000:]})
    except subprocess.TimeoutExpired:
        pr = {"error": f"the probe interpreter did not finish within {timeout} s"}
    st = pr.get("status") or {}
    hook = st.get("hook") or {}
    settings = pr.get("settings") or {}
    opts = st.get("optimizations") or {}
    return {
        "version": core.__version__,
        "python": sys.version.split()[0],
        "torch": pr.get("torch"),
        "cuda": pr.get("cuda"),
        "torch_error": pr.get("torch_error"),
        "error": pr.get("error") or pr.get("status_error"),
        "hook": {"present": any(f["kind"] == "pth" and f["site_dir"] for f in hook_files()),
                 "disabled_by_env": core._disabled_by_env(),
                 "fired": bool(hook.get("fired")), "error": hook.get("error")},
        "cuda_initialized": pr.get("cuda_initialized"),
        "allocator_getter": "allocator_settings" in settings,
        "settings": settings,
        "optimizations": opts,
        "skipped": {name: e.get("reason") for name, e in opts.items()
                    if not e.get("applied") and not e.get("queued")},
        "known_bugs": [{k: b.get(k) for k in ("id", "applies", "verdict", "code", "done", "reason")}
                       for b in st.get("known_bugs") or []],
        "status": {k: st[k] for k in ("optimizations", "known_bugs", "cuda_init", "hook")
                   if k in st},
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(_BUG_ENV_PREFIXES)},
    }


def _render_bug_report(d):
    s = d["settings"]

    def val(name):
        v = s.get(name, "n/a")
        return f"unreadable ({v['error']})" if isinstance(v, dict) else v

    hook = d["hook"]
    alloc = (f"{val('allocator_settings')!r} (torch._C._accelerator_getAllocatorSettings)"
             if d["allocator_getter"] else
             f"torch {d['torch']} has no getter; outofcuda's entry: "
             f"{(d['optimizations'].get('allocator') or {}).get('value')!r}")
    lines = [
        "```",
        "outofcuda bug-report block (python -m torch.utils.collect_env does not show these)",
        f"outofcuda {d['version']}, Python {d['python']}, torch {d['torch'] or d['torch_error']}"
        f", CUDA {d['cuda'] or 'none (CPU build)'}",
        f"hook: present={hook['present']} fired={hook['fired']} "
        f"disabled_by_env={hook['disabled_by_env']} error={hook['error'] or 'none'}",
        f"CUDA initialised by import torch: {d['cuda_initialized']}",
        f"allocator settings: {alloc}",
        f"TF32: float32_matmul_precision={val('float32_matmul_precision')} "
        f"cudnn.allow_tf32={val('cudnn.allow_tf32')}; cuDNN: enabled={val('cudnn.enabled')}",
        "torch now: " + (" ".join(f"{name}={e['now']}" for name, e in d["optimizations"].items()
                                  if e.get("now") is not None) or "unread"),
        f"autocast dtype: cuda={val('autocast_dtype.cuda')} cpu={val('autocast_dtype.cpu')}",
        "outofcuda's decisions (yes / queued for CUDA's start / off / no):",
    ]
    lines += core._status_text(d["status"]).rstrip("\n").split("\n")
    env = d["environment"]
    lines.append("environment: " + (" ".join(f"{escaped(k)}={escaped(v)}" for k, v in env.items())
                                    or "none set"))
    if d["error"]:
        lines.append(f"error: {d['error']}")
    lines.append("```")
    return "\n".join(lines)


def _emit(args, data, text):
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        # Whatever reached the text from outside is escaped by now; this is
        # the last guard for the terminal.
        print("\n".join(escaped(line) for line in text.split("\n")))


def _bench(args):
    bdir = _benchmarks_dir(args.benchmarks_dir) if args.startup else None
    if args.startup and bdir is None:
        # Checked first: the gain benchmark takes minutes on a GPU.
        msg = ("--startup: benchmarks/startup.py not found (it builds virtual environments "
               "from a checkout): run from an outofcuda checkout or pass --benchmarks-dir")
        print(f"outofcuda bench: {msg}", file=sys.stderr)
        if args.json:
            _emit(args, {"error": msg}, "")
        return 1
    from . import bench

    rc = bench.main(["--out", args.out, "--workloads", args.workloads,
                     "--timeout", str(args.timeout)]
                    + (["--smoke"] if args.smoke else []) + (["--no-plot"] if args.no_plot else [])
                    + (["--json"] if args.json else []), prog="outofcuda bench")
    if args.startup:
        cmd = [sys.executable, str(bdir / "startup.py"), "--out",
               str(Path(args.out) / "startup.json")] + (["--json"] if args.json else [])
        rc = max(rc, subprocess.run(cmd).returncode)
    return rc


# What a shell reports for a program that SIGPIPE ended (`yes | head -1`).
EXIT_BROKEN_PIPE = 128 + 13
EXIT_NO_OUTPUT = 1  # started with standard output closed


def main(argv=None):
    """Entry point of ``outofcuda`` / ``python -m outofcuda``; returns the exit code.

    When whoever reads the output goes away (``outofcuda status | head -1``)
    it stops quietly, as other command-line tools do, with exit code 141.

    >>> main(["doctor", "--json"])  # the whole report; 1 on a machine without a GPU  # doctest: +SKIP
    0
    """
    if sys.stdout is None:
        # Started with standard output closed (`outofcuda status >&-`): there
        # is nowhere to answer, so say that, as other tools do, not a traceback.
        if sys.stderr is not None:
            print("outofcuda: standard output is closed; nothing can be shown", file=sys.stderr)
        return EXIT_NO_OUTPUT
    try:
        try:
            return _main(argv)
        finally:
            # Here, not at exit, so a closed pipe is caught below (also after
            # --help, which ends in SystemExit).
            sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout once more at exit: point it at /dev/null so
        # that flush cannot raise (and print) again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _no_device_reason():
    """Why memory_report() lists no device, in status's words."""
    devices, why = gpus()
    if why:
        return why
    if devices:
        return f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r} hides them"
    return "NVML lists no GPU"


def _main(argv):
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse leaves a sub-command's unknown options to the top-level
        # parser, whose usage line does not name the sub-command.
        which = parser.subcommands.get(args.command, parser)
        which.error(f"unrecognized arguments: {' '.join(extra)}")
    command = args.command or "status"
    if command == "status":
        d = status_data()
        _emit(args, d, _render_status(d))
        return 0
    if command == "doctor":
        d = doctor_data()
        _emit(args, d, _render_doctor(d))
        return 0 if d["healthy"] else 1
    if command == "report" and args.bug:
        d = bug_report_data()
        _emit(args, d, _render_bug_report(d))
        return 0
    if command == "report":
        try:
            import outofcuda

            d = outofcuda.memory_report()
        except (ImportError, AttributeError) as e:
            _emit(args, {"error": str(e)}, f"outofcuda report: {e}")
            return 1
        _emit(args, d, "\n".join(_render_tree(d) or
                                 _wrap(f"no CUDA device ({_no_device_reason()})", WIDTH, 2)))
        return 0
    from . import bench

    problem = bench.argument_error(args)
    if problem:
        # `outofcuda bench`'s own usage line, the one --help shows
        parser.subcommands["bench"].error(problem)
    return _bench(args)
