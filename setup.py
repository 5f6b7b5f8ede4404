"""The native launch core, nsbox._native (nsbox/native/*.c), built at install time.

Everything else is in pyproject.toml. The extension is optional: where no C compiler or Python
headers are installed, nsbox installs without it and launches with the Python core, and
``nsbox doctor`` says so (docs/performance.md, "The native core").
"""

from setuptools import Extension, setup

NATIVE = Extension(
    "nsbox._native",
    sources=[f"nsbox/native/{name}.c" for name in ("module", "plan", "child", "mounts", "report",
                                                    "spawner", "pooled", "devproc")],
    depends=["nsbox/native/plan.h", "nsbox/native/child.h", "nsbox/native/spawner.h"],
    extra_compile_args=["-Wall", "-Wextra", "-O2"],
    optional=True,
)

setup(ext_modules=[NATIVE])
