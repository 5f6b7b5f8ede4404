"""What nsbox builds at install time: the native launch core, nsbox._native (nsbox/native/*.c),
and the seccomp programs of the shipped profiles (nsbox/profiles/programs.py).

Everything else is in pyproject.toml. Both are optional: where no C compiler or Python headers
are installed, nsbox installs without the extension and launches with the Python core, and
``nsbox doctor`` says so (docs/performance.md, "The native core"); where libseccomp is missing
at build time, the programs are compiled at run time instead (docs/seccomp.md).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))

NATIVE = Extension(
    "nsbox._native",
    sources=[f"nsbox/native/{name}.c" for name in ("module", "plan", "child", "mounts", "report",
                                                    "spawner", "pooled", "devproc")],
    depends=["nsbox/native/plan.h", "nsbox/native/child.h", "nsbox/native/spawner.h"],
    extra_compile_args=["-Wall", "-Wextra", "-O2"],
    optional=True,
)


# The launch engine (nsbox/native/engine.c): a standalone executable, no Python in it, linked
# with the native core's child. Installed in the package directory, which no sandbox may write
# (rule nsbox-code).
ENGINE = "nsbox-engine"
ENGINE_SOURCES = [f"nsbox/native/{name}.c" for name in (
    "engine", "engine_msg", "engine_cgroup", "engine_spare", "spawner", "plan", "child",
    "mounts", "report", "pooled", "devproc")]


class BuildWithPrograms(build_ext):
    """build_ext, then what the shipped profiles need at run time (their seccomp programs, their
    parsed values), in the tree the extension goes to (the source tree for an editable install
    or --inplace, the build directory for a wheel)."""

    def run(self) -> None:
        super().run()
        self._programs = []
        root = HERE if self.inplace else self.build_lib
        self._build_engine(os.path.join(root, "nsbox"))
        directory = os.path.join(root, "nsbox", "host", "seccomp_programs")
        parsed = os.path.join(root, "nsbox", "profiles", "parsed.json")
        sys.path.insert(0, HERE)  # the nsbox being built, not one installed elsewhere
        try:
            from nsbox.profiles import programs

            keys = programs.build(directory)
            self._programs += [os.path.join(directory, key + ".json") for key in keys]
        except Exception as exc:  # noqa: BLE001 - any failure: compiled at run time instead
            print(f"nsbox: seccomp programs not built ({type(exc).__name__}: {exc}); they "
                  "are compiled at run time", file=sys.stderr)
        if not self.inplace:
            # The commit for `nsbox --version`: a wheel's copy has no checkout to ask.
            from nsbox.version import build_info

            info = os.path.join(root, "nsbox", "_build_info.py")
            with open(info, "wb") as f:
                f.write(build_info(HERE))
            self._programs.append(info)
        try:
            programs.build_parsed(parsed)
            self._programs.append(parsed)
        except Exception as exc:  # noqa: BLE001 - any failure: parsed at run time instead
            print(f"nsbox: profiles not parsed ahead ({type(exc).__name__}: {exc}); they are "
                  "parsed at run time", file=sys.stderr)
        finally:
            sys.path.remove(HERE)

    def _build_engine(self, package: str) -> None:
        """The engine, or a note why not: launches then take the Python helper."""
        try:
            if self.compiler is None or isinstance(self.compiler, str):
                from setuptools._distutils.ccompiler import new_compiler
                from setuptools._distutils.sysconfig import customize_compiler

                compiler = new_compiler()
                customize_compiler(compiler)
            else:
                compiler = self.compiler
            objects = compiler.compile(
                [os.path.join(HERE, s) for s in ENGINE_SOURCES],
                output_dir=os.path.join(self.build_temp, "engine"),
                extra_postargs=["-std=gnu11", "-Wall", "-Wextra", "-O2"])
            compiler.link_executable(objects, ENGINE, output_dir=package)
            self._programs.append(os.path.join(package, ENGINE))
        except Exception as exc:  # noqa: BLE001 - any failure: the Python helper instead
            print(f"nsbox: the launch engine is not built ({type(exc).__name__}: {exc}); "
                  "launches take the Python helper", file=sys.stderr)

    def get_outputs(self) -> list:
        return [*super().get_outputs(), *getattr(self, "_programs", [])]


setup(ext_modules=[NATIVE], cmdclass={"build_ext": BuildWithPrograms})
