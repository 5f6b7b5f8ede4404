"""Build nsbox.pyz: the whole CLI as one file that runs with the host's python3 (3.10+).

    python3 tools/build_pyz.py [--output dist/nsbox.pyz]

It bundles the nsbox package and its pure-Python dependencies (click, pyseccomp, cgroupspy,
and tomli for Python 3.10): from the running interpreter's environment or the checkout's
`.venv` where they are installed, else fetched with pip into a temporary directory (the
system's pip, or one of a temporary virtual environment: no package is installed on the
system). The only host requirement left is the libseccomp2 shared library. The build is
reproducible: entries are sorted, timestamps and permissions fixed, so the same inputs give the
same bytes.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import py_compile
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # nsbox.version, of the tree being built

from nsbox.version import build_info  # noqa: E402

FIXED_TIME = (1980, 1, 1, 0, 0, 0)
# The import names, and what pip fetches when they are missing (pyproject.toml's dependencies;
# tests/test_packaging.py checks that they agree).
DEPENDENCIES = {"click": "click>=8.1", "pyseccomp": "pyseccomp>=0.1.2",
                "cgroupspy": "cgroupspy>=0.2.2"}
OPTIONAL_DEPENDENCIES = {"tomli": "tomli>=2.0"}  # tomllib's backport, for Python 3.10 only
# The same entry as the installed `nsbox` script: `run` without click, the rest through click.
MAIN = "from nsbox.cli.fast import main\nmain()\n"


def places() -> list[str]:
    """Where the dependencies may be installed already: the checkout's virtual environment
    (the README's `.venv`), so that a plain system python3 builds without fetching."""
    return [str(site) for site in sorted(REPO.glob(".venv/lib/python3*/site-packages"))]


def find_spec(name: str, extra: list[str]) -> importlib.machinery.ModuleSpec | None:
    """The module in this interpreter's environment, else in one of the ``extra`` places."""
    spec = importlib.util.find_spec(name)
    if spec is not None:
        return spec
    return importlib.machinery.PathFinder.find_spec(name, extra) if extra else None


def pip_command(tmp: Path) -> list[str]:
    """A pip for this interpreter: its own, else that of a temporary virtual environment
    (Debian's python3 has no pip module; python3-venv brings one for virtual environments)."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    venv = tmp / "venv"
    proc = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit("build_pyz: this python3 has no pip, and cannot make a virtual "
                         "environment to get one: install python3-venv (Debian) or pip, "
                         "then run this again")
    return [str(venv / "bin" / "python"), "-m", "pip"]


def fetch(requirements: list[str], tmp: Path) -> str:
    """pip-install ``requirements`` into a directory of ``tmp`` (--target: nothing on the
    system changes, and PEP 668's externally-managed marker does not apply); that directory."""
    target = tmp / "deps"
    print(f"build_pyz: fetching {' '.join(requirements)} with pip", file=sys.stderr)
    proc = subprocess.run([*pip_command(tmp), "install", "--quiet", "--disable-pip-version-check",
                           "--no-compile", "--target", str(target), *requirements],
                          stdout=sys.stderr,
                          env={**os.environ, "PIP_NO_INPUT": "1", "PIP_ROOT_USER_ACTION": "ignore"})
    if proc.returncode != 0:
        raise SystemExit(f"build_pyz: pip could not fetch {' '.join(requirements)} (its "
                         "message is above); check the network, or install them, then run "
                         "this again")
    return str(target)


def locate(tmp: Path) -> dict[str, importlib.machinery.ModuleSpec]:
    """Where each dependency is, fetching the missing ones with pip. tomli goes in wherever it
    is installed (the archive may run on an older python3 than the one building it), and is
    fetched only for a Python 3.10 build."""
    extra = places()
    wanted = dict(DEPENDENCIES)
    for name, requirement in OPTIONAL_DEPENDENCIES.items():
        if sys.version_info < (3, 11) or find_spec(name, extra) is not None:
            wanted[name] = requirement
    found = {name: find_spec(name, extra) for name in wanted}
    missing = [wanted[name] for name, spec in found.items() if spec is None]
    if missing:
        extra = [fetch(missing, tmp), *extra]
        found = {name: spec or find_spec(name, extra) for name, spec in found.items()}
    specs = {}
    for name, spec in found.items():
        if spec is None or spec.origin is None:
            raise SystemExit(f"build_pyz: {name} is not importable even after pip fetched it")
        specs[name] = spec
    return specs


def module_files(spec: importlib.machinery.ModuleSpec) -> list[tuple[Path, str]]:
    """(file on disk, name inside the archive) for an importable module or package."""
    assert spec.origin is not None
    origin = Path(spec.origin)
    if origin.name != "__init__.py":
        return [(origin, origin.name)]
    package = origin.parent
    return [(path, str(path.relative_to(package.parent)))
            for path in package.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"]


def add(archive: zipfile.ZipFile, arcname: str, data: bytes) -> None:
    info = zipfile.ZipInfo(arcname, FIXED_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    archive.writestr(info, data, compresslevel=9)


def compiled(entries: dict[str, bytes]) -> dict[str, bytes]:
    """Bytecode beside every module, for the interpreter that builds the archive.

    zipimport cannot write a cache, so without these every run compiles each module it imports
    again (about 100 ms for `nsbox run`). The bytecode is hash-based and unchecked: the same
    bytes on every build. An interpreter of another version finds the magic number wrong and
    compiles the source, as before.
    """
    out: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arcname, data in entries.items():
            if not arcname.endswith(".py"):
                continue
            source, cfile = Path(tmp, "m.py"), Path(tmp, "m.pyc")
            source.write_bytes(data)
            py_compile.compile(str(source), str(cfile), dfile=arcname, doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
            out[arcname + "c"] = cfile.read_bytes()
    return out


def build(output: Path) -> Path:
    entries: dict[str, bytes] = {"__main__.py": MAIN.encode()}
    for path in (REPO / "nsbox").rglob("*"):
        # No native core in a zip (zipimport loads no extension module): the one-file CLI
        # launches with the Python child, and says so in `nsbox doctor`.
        if (path.is_file() and "__pycache__" not in path.parts
                and path.suffix not in (".pyc", ".so", ".c", ".h")):
            entries[str(path.relative_to(REPO))] = path.read_bytes()
    entries["nsbox/_build_info.py"] = build_info(str(REPO))
    with tempfile.TemporaryDirectory(prefix="nsbox-pyz-") as tmp:
        for spec in locate(Path(tmp)).values():
            for path, arcname in module_files(spec):
                entries[arcname] = path.read_bytes()
    entries.update(compiled(entries))
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(b"#!/usr/bin/env python3\n")
        with zipfile.ZipFile(f, "w") as archive:
            for arcname in sorted(entries):
                add(archive, arcname, entries[arcname])
    tmp.chmod(0o755)
    tmp.replace(output)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=REPO / "dist" / "nsbox.pyz")
    args = parser.parse_args()
    print(build(args.output))


if __name__ == "__main__":
    main()
