"""Finds outofcuda's C extension (the engine, ``_outofcuda``).

The engine is loaded by path from the directory that holds this package, never
by name: the working directory and PYTHONPATH are on ``sys.path`` and a file
called ``_outofcuda.py`` there must not be picked up. When the start-up hook
already loaded it (on ``import torch``), that module is used. When the hook's
boot of this install is loaded, its check comes first, as on ``import torch``:
a partly written file would kill the process when mapped.

Only modules that are already imported are used here (``os`` and importlib's
own bootstrap): ``import outofcuda`` stays cheap in a process without torch.
"""
import sys
from os import path as _path

import _frozen_importlib as _bootstrap  # what importlib.util.module_from_spec is
import _frozen_importlib_external as _external  # what importlib.machinery exports

_NAME = "_outofcuda"
_BOOT = "outofcuda_hook"  # the start-up hook's boot
_ENTRY = "_find_torch_spec"  # a function only the engine has


class ShadowedError(ImportError):
    """A module named ``_outofcuda`` that is not outofcuda's engine was imported
    first; ``import outofcuda`` fails with this rather than half-work."""


def _check(mod):
    if getattr(mod, _ENTRY, None) is None:
        where = getattr(mod, "__file__", None) or repr(mod)
        raise ShadowedError(
            f"outofcuda: the module {_NAME!r} already imported in this process is {where}, "
            f"not outofcuda's C extension; a file of that name on sys.path (PYTHONPATH or the "
            f"working directory) was imported first: rename it"
        )
    return mod


def _reinstall():
    """How to reinstall this copy from where it came from (outofcuda._origin,
    imported only on this error path: it reads files and imports json)."""
    try:
        from ._origin import advice
    except Exception:  # an error message must not become another error
        return "reinstall outofcuda from the checkout or the wheel you installed it from"
    return advice()


def _shadowed_by_checkout(root):
    """The message for a package imported from a source checkout that holds
    no built extension: the checkout's outofcuda/ came first on sys.path."""
    installed = [
        d for d in sys.path
        if d and _path.realpath(d) != root and _path.isfile(_path.join(d, "outofcuda", "__init__.py"))
    ]
    where = f" (installed in {installed[0]})" if installed else ""
    return (
        f"outofcuda: the package was imported from the source tree {root}, which holds no "
        f"built extension: its outofcuda/ folder shadows the installed package{where} because "
        "the working directory (or the script's folder) comes first on sys.path. Run from "
        f"another directory, or build the checkout in place: pip install -e {root}"
    )


def _load():
    mod = sys.modules.get(_NAME)
    if mod is not None:
        return _check(mod)
    root = _path.dirname(_path.dirname(_path.realpath(__file__)))
    for suffix in _external.EXTENSION_SUFFIXES:
        path = _path.join(root, _NAME + suffix)
        if _path.isfile(path):
            break
    else:
        if _path.isfile(_path.join(root, "setup.py")) and _path.isfile(
                _path.join(root, "src", "oc.h")):
            raise ImportError(_shadowed_by_checkout(root))
        raise ImportError(f"outofcuda's C extension ({_NAME}) is missing from {root}; "
                          + _reinstall())
    # The boot's check (a partly written file would kill the process when
    # mapped), where the hook loaded the boot of this install.
    boot = sys.modules.get(_BOOT)
    boot_file = getattr(boot, "__file__", None)
    if boot_file and _path.dirname(_path.realpath(boot_file)) == root:
        why = getattr(boot, "_incomplete", lambda _: None)(path)
        if why is not None:
            raise ImportError(f"outofcuda: {why} ({_reinstall()})")
    loader = _external.ExtensionFileLoader(_NAME, path)
    spec = _external.spec_from_file_location(_NAME, path, loader=loader)
    try:
        mod = _bootstrap.module_from_spec(spec)
        loader.exec_module(mod)
    except (ImportError, OSError) as exc:
        raise ImportError(
            f"outofcuda's C extension at {path} is present but cannot be loaded "
            f"in this interpreter ({exc}). outofcuda works only in the main "
            "interpreter, not in a subinterpreter; in the main interpreter this "
            "means a damaged file or one built for another platform: " + _reinstall()
        ) from exc
    return _check(sys.modules.setdefault(_NAME, mod))


core = _load()
