"""Finds outofcuda's C extension.

The start-up hook imports ``_outofcuda`` before the working directory is on
``sys.path``; when it did not run (``OUTOFCUDA_DISABLE=1``, ``python -S``) the
extension is loaded here from the directory that holds this package, by path,
so a file called ``_outofcuda.py`` in the working directory is never picked up.
"""
import sys
from importlib.machinery import EXTENSION_SUFFIXES, ExtensionFileLoader
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path


def _load():
    mod = sys.modules.get("_outofcuda")
    if mod is not None:
        return mod
    root = Path(__file__).resolve().parent.parent
    for suffix in EXTENSION_SUFFIXES:
        path = root / ("_outofcuda" + suffix)
        if path.is_file():
            spec = spec_from_file_location(
                "_outofcuda", str(path), loader=ExtensionFileLoader("_outofcuda", str(path))
            )
            try:
                mod = module_from_spec(spec)
                spec.loader.exec_module(mod)
            except (ImportError, OSError) as exc:
                raise ImportError(
                    f"outofcuda's C extension at {path} is present but cannot be loaded "
                    f"in this interpreter ({exc}). outofcuda works only in the main "
                    "interpreter, not in a subinterpreter; in the main interpreter this "
                    "means a damaged file or one built for another platform: "
                    "pip install --force-reinstall --no-deps 'outofcuda>=0.2'"
                ) from exc
            sys.modules["_outofcuda"] = mod
            return mod
    raise ImportError(
        f"outofcuda's C extension (_outofcuda) is missing from {root}; reinstall "
        "outofcuda: pip install --force-reinstall --no-deps 'outofcuda>=0.2'"
    )


core = _load()
