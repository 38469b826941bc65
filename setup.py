"""Build outofcuda: two abi3 C extensions (Limited API, Python 3.9 floor), the
start-up boot and the engine, plus the start-up hook file placed at the root
of site-packages."""
import os
import re
import sys
from glob import glob
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "buildsys"))
import hookfiles  # noqa: E402  (buildsys/, shared with the build backend)

# Which hook file the wheel carries, decided (and a bad OUTOFCUDA_BUILD_HOOK_FILE
# refused) before anything is compiled.
START_KIND = hookfiles.start_kind()
VERSION = re.search(r'#define OC_VERSION "([^"]+)"', (HERE / "src" / "oc.h").read_text()).group(1)


class build_ext_abi3(build_ext):
    """Names every extension `<name>.abi3.so`, whichever Python builds it (3.15
    lists `.abi3-x86_64-linux-gnu.so` first, which the .pth line's fast path
    would miss), then writes the hook files for the chosen wheel kind into
    build_lib, where they land at the wheel's root and in its RECORD (pip
    uninstall then removes them). They are written after the boot is linked:
    the .pth line carries the boot's size."""

    def get_ext_filename(self, fullname):
        name = super().get_ext_filename(fullname)
        if sys.platform.startswith("linux") and self.ext_map[fullname].py_limited_api:
            name = os.path.join(os.path.dirname(name), fullname.split(".")[-1] + ".abi3.so")
        return name

    def run(self):
        super().run()
        boot = Path(self.get_ext_fullpath(hookfiles.BOOT))
        Path(self.build_lib).mkdir(parents=True, exist_ok=True)
        hookfiles.write(Path(self.build_lib), boot.stat().st_size, START_KIND)


class bdist_wheel_hook_kind(bdist_wheel):
    """The .start kind is tagged cp318-abi3: pip on 3.18+ prefers it to the
    cp39-abi3 .pth kind, which every older Python gets (the binary is the
    same 3.9 Limited API build)."""

    def get_tag(self):
        impl, abi, plat = super().get_tag()
        if START_KIND:
            impl = hookfiles.START_TAG
        return impl, abi, plat


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


# OUTOFCUDA_BUILD_SANITIZE=1: an AddressSanitizer + UndefinedBehaviorSanitizer build.
SANITIZE = os.environ.get("OUTOFCUDA_BUILD_SANITIZE", "") not in ("", "0")
# OUTOFCUDA_BUILD_WERROR=1 (CI, the tests, development builds): a warning fails the
# build. A user's `pip install` leaves it unset: a warning that a newer
# compiler adds must not break an install.
WERROR = os.environ.get("OUTOFCUDA_BUILD_WERROR", "") not in ("", "0")


def extra_compile_args():
    args = ["-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden"] + (["-Werror"] if WERROR else [])
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
        depends=sorted(glob("src/*.h")),  # oc.h and the headers it includes
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
    cmdclass={"build_ext": build_ext_abi3, "bdist_wheel": bdist_wheel_hook_kind},
    options=options,
)
