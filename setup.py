"""Build outofcuda: one abi3 C extension (Limited API, Python 3.9 floor) plus
the start-up hook files placed at the root of site-packages."""
import os
import re
import sys
from glob import glob
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

HERE = Path(__file__).resolve().parent
HOOK_FILES = ("outofcuda_hook.pth", "outofcuda_hook.start")
# Files at the wheel's root: the hook, and the engine's type stubs beside the
# engine (a top-level module, outside the package).
ROOT_FILES = HOOK_FILES + ("_outofcuda.pyi",)
VERSION = re.search(r'#define OC_VERSION "([^"]+)"', (HERE / "src" / "oc.h").read_text()).group(1)


class build_py_with_hook(build_py):
    """Copies the root files into build_lib so they land at the wheel's root
    and in its RECORD (pip uninstall then removes them)."""

    def run(self):
        super().run()
        for name in ROOT_FILES:
            self.copy_file(str(HERE / name), os.path.join(self.build_lib, name))


class editable_wheel_with_hook(editable_wheel):
    """setuptools' editable wheels carry no root files: add the hook, or
    `pip install -e .` would silently install no hook at all."""

    def _create_wheel_file(self, bdist_wheel):
        wheel_path = str(super()._create_wheel_file(bdist_wheel))
        import zipfile
        import hashlib
        import base64

        with zipfile.ZipFile(wheel_path) as zf:
            record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
            record = zf.read(record_name).decode()
        # A zip cannot replace a member in place: rebuild it with the hook
        # files added and RECORD extended.
        tmp = wheel_path + ".tmp"
        with zipfile.ZipFile(wheel_path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for item in src.infolist():
                if item.filename != record_name:
                    dst.writestr(item, src.read(item.filename))
            lines = [record.rstrip("\n")]
            for name in ROOT_FILES:
                data = (HERE / name).read_bytes()
                dst.writestr(name, data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                lines.append(f"{name},sha256={digest},{len(data)}")
            dst.writestr(record_name, "\n".join(lines) + "\n")
        os.replace(tmp, wheel_path)
        return wheel_path


def refuse_free_threaded_build(config_var=None):
    """A free-threaded interpreter (3.13t, 3.14t, 3.15t) gets one sentence
    instead of a compiler error from headers without its Limited API."""
    import sysconfig

    if (config_var or sysconfig.get_config_var)("Py_GIL_DISABLED"):
        raise SystemExit(
            "outofcuda cannot be installed on free-threaded Python ({}t): its C extension is "
            "built for the stable ABI of the GIL-enabled interpreter, which a free-threaded "
            "build cannot load, so install it into the regular interpreter of the same version "
            "(python{} rather than python{}t), where torch gets outofcuda's settings."
            .format(*[sysconfig.get_python_version()] * 3))


# OUTOFCUDA_SANITIZE=1: an AddressSanitizer + UndefinedBehaviorSanitizer build.
SANITIZE = os.environ.get("OUTOFCUDA_SANITIZE", "") not in ("", "0")


def extra_compile_args():
    args = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"]
    if SANITIZE:
        args += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]
    return args


def extra_link_args():
    if SANITIZE:
        return ["-fsanitize=address,undefined"]
    return []


def extension(name, sources):
    return Extension(
        name,
        sources=sources,
        depends=["src/oc.h"],
        define_macros=[("Py_LIMITED_API", "0x03090000"), ("_GNU_SOURCE", "1")],
        py_limited_api=True,
        extra_compile_args=extra_compile_args(),
        extra_link_args=extra_link_args(),
        libraries=["dl", "pthread"] if sys.platform.startswith("linux") and name == "_outofcuda"
        else [],
    )


# Two extensions: the boot that every Python process of the environment loads
# at start-up (one small file, nothing linked), and the engine it loads when
# torch is imported (everything else).
BOOT_SOURCES = ["src/boot.c"]
ext_modules = [
    extension("outofcuda_hook", BOOT_SOURCES),
    extension("_outofcuda", sorted(set(glob("src/*.c")) - set(BOOT_SOURCES))),
]

options = {"bdist_wheel": {"py_limited_api": "cp39"}}
if SANITIZE:
    # A build folder of its own: setuptools keeps object files and the linked
    # extension that are newer than their sources whatever flags made them, so
    # a sanitizer build over an existing build/ (or a plain one over a
    # sanitizer build) would silently ship the other kind.
    options["build"] = {"build_base": os.path.join("build", "sanitize")}

refuse_free_threaded_build()
setup(
    version=VERSION,
    ext_modules=ext_modules,
    cmdclass={"build_py": build_py_with_hook, "editable_wheel": editable_wheel_with_hook},
    options=options,
)
