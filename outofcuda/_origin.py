"""Where this copy of outofcuda came from, and the command that reinstalls it
from there.

pip records the source of an install from a folder, a file or a VCS URL, and
of an editable install, in the dist-info's ``direct_url.json`` (PEP 610). An
install from a package index records none; the name ``outofcuda`` on PyPI
belongs to another project, so advice never names the package by name: it
names the source this copy came from, or says to reinstall from the checkout
or wheel it was installed from.

Only the error paths and the command line import this module (it reads files
and imports json): ``import outofcuda`` never pays for it.
"""
import json
import os
import shlex
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

DIST = "outofcuda"
# Said where no source is recorded (an index, another installer, a copy).
UNKNOWN = ("reinstall outofcuda from the checkout or the wheel you installed it from "
           "(python3 -m pip install --force-reinstall --no-deps <checkout folder or .whl file>); "
           "the package named outofcuda on PyPI is another project")


def _package_dir():
    return Path(__file__).resolve().parent


def _local_path(url):
    """The local path of a file:// URL, else None."""
    parts = urlsplit(url or "")
    if parts.scheme != "file":
        return None
    return unquote(parts.path)


def _read_direct_url(info):
    try:
        data = json.loads((info / "direct_url.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("url"), str) else None


def dist_info():
    """(dist-info folder, its direct_url.json dict or None) of this copy, or
    (None, None). A regular install keeps its dist-info beside the package;
    an editable one keeps it in site-packages and records the checkout
    that holds the package."""
    pkg = _package_dir()
    # Leftovers of another project's `outofcuda` may sit there too: this
    # project's RECORD lists its engine.
    for info in sorted(pkg.parent.glob(DIST + "-*.dist-info")):
        try:
            record = (info / "RECORD").read_text(encoding="utf-8")
        except OSError:
            continue
        if "_outofcuda." in record:
            return info, _read_direct_url(info)
    checkout = str(pkg.parent)
    seen = set()
    for d in sys.path:
        if not d or d in seen or not os.path.isdir(d):
            continue
        seen.add(d)
        for info in sorted(Path(d).glob(DIST + "-*.dist-info")):
            data = _read_direct_url(info)
            path = _local_path(data["url"]) if data else None
            if path and os.path.realpath(path) == os.path.realpath(checkout):
                return info, data
    return None, None


def origin(python=None):
    """Where this copy came from, as a dict:

    - ``source``: ``"editable"`` (``pip install -e`` of a checkout), ``"folder"``
      (a checkout installed as a copy), ``"file"`` (a wheel or sdist file),
      ``"url"`` (an archive URL), ``"vcs"`` (a VCS URL at a commit), or
      ``"unknown"`` (no ``direct_url.json``: an index, another installer);
    - ``url``: what pip recorded (None for unknown); ``path``: the local folder
      or file, where there is one; ``exists``: whether that path is still there;
    - ``command``: the argument list that reinstalls from there with this
      Python's pip, or None where there is none to give;
    - ``advice``: one sentence saying the same, for people.

    >>> origin()["source"]  # how this copy was installed decides  # doctest: +SKIP
    'editable'
    """
    python = python or sys.executable or "python3"
    info, data = dist_info()
    out = {"source": "unknown", "url": None, "path": None, "exists": None, "command": None,
           "dist_info": str(info) if info else None, "advice": UNKNOWN}
    if not data:
        return out
    url = data["url"]
    path = _local_path(url)
    pip = [python, "-m", "pip", "install"]
    out.update(url=url, path=path, exists=bool(path and os.path.exists(path)))
    dir_info, archive, vcs = data.get("dir_info"), data.get("archive_info"), data.get("vcs_info")
    if isinstance(dir_info, dict) and path:
        editable = bool(dir_info.get("editable"))
        out["source"] = "editable" if editable else "folder"
        what = "the checkout " + path + (" (editable)" if editable else "")
        command = pip + (["--no-deps", "-e", path] if editable
                         else ["--force-reinstall", "--no-deps", path])
    elif isinstance(vcs, dict) and vcs.get("vcs"):
        out.update(source="vcs", exists=None)
        target = f"{vcs['vcs']}+{url}"
        if vcs.get("commit_id"):
            target += "@" + str(vcs["commit_id"])
        if data.get("subdirectory"):
            target += "#subdirectory=" + str(data["subdirectory"])
        what = target
        command = pip + ["--force-reinstall", "--no-deps", target]
    elif isinstance(archive, dict) or path is None:
        out["source"] = "file" if path else "url"
        if not path:
            out["exists"] = None
        what = path or url
        command = pip + ["--force-reinstall", "--no-deps", path or url]
    else:
        return out
    if out["exists"] is False:
        out["advice"] = (f"this copy was installed from {path}, which no longer exists: "
                         + UNKNOWN)
        return out
    out["command"] = command
    out["advice"] = f"reinstall outofcuda from {what}: {join(command)}"
    return out


def join(command):
    """The argument list as one shell line."""
    return " ".join(shlex.quote(str(a)) for a in command)


def advice():
    """One sentence: how to reinstall this copy from where it came from."""
    try:
        return origin()["advice"]
    except Exception:  # advice must never turn an error message into another error
        return UNKNOWN
