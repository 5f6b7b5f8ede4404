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


class BuildWithPrograms(build_ext):
    """build_ext, then what the shipped profiles need at run time (their seccomp programs, their
    parsed values), in the tree the extension goes to (the source tree for an editable install
    or --inplace, the build directory for a wheel)."""

    def run(self) -> None:
        super().run()
        self._programs = []
        root = HERE if self.inplace else self.build_lib
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

    def get_outputs(self) -> list:
        return [*super().get_outputs(), *getattr(self, "_programs", [])]


setup(ext_modules=[NATIVE], cmdclass={"build_ext": BuildWithPrograms})
