"""outofcuda's PEP 517 build backend: setuptools.build_meta, with the hook
files added to editable wheels.

setuptools' editable wheels carry only what its editable strategy maps (the
package, the extensions built in place), not files at the wheel's root, so
`pip install -e .` would install no hook at all. build_editable takes the
wheel setuptools made through the PEP 517 hook and adds the root files, their
lines in RECORD included (pip uninstall then removes them)."""
import base64
import hashlib
import os
import zipfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every other hook as setuptools has it)

import hookfiles


def _add_files(wheel_path, files):
    """Rewrites the wheel with files ({name: text}) added at its root and in
    RECORD (a zip member cannot be replaced in place)."""
    with zipfile.ZipFile(wheel_path) as src:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        record = src.read(record_name).decode().rstrip("\n").splitlines()
        tmp = wheel_path.with_name(wheel_path.name + ".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for item in src.infolist():
                if item.filename != record_name and item.filename not in files:
                    dst.writestr(item, src.read(item.filename))
            record = [ln for ln in record if ln.split(",", 1)[0] not in files]
            for name, text in files.items():
                data = text.encode()
                dst.writestr(name, data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                record.append(f"{name},sha256={digest.decode()},{len(data)}")
            dst.writestr(record_name, "\n".join(record) + "\n")
    os.replace(tmp, wheel_path)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    # The extensions were built in place, beside setup.py: the hook loads the
    # boot from there.
    root = Path.cwd().resolve()
    boot = root / hookfiles.BOOT_FILE
    files = hookfiles.root_files(boot.stat().st_size, hookfiles.start_kind(), boot_dir=root)
    _add_files(Path(wheel_directory) / name, files)
    return name
