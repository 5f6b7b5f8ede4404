"""Build nsbox.pyz: the whole CLI as one file that runs with the host's python3 (3.10+).

    python3 tools/build_pyz.py [--output dist/nsbox.pyz]

It bundles the nsbox package and its pure-Python dependencies (click, pyseccomp, cgroupspy,
and tomli for Python 3.10) from the running interpreter's environment; the only host
requirement left is the libseccomp2 shared library. The build is reproducible: entries are
sorted, timestamps and permissions fixed, so the same inputs give the same bytes.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import py_compile
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXED_TIME = (1980, 1, 1, 0, 0, 0)
DEPENDENCIES = ("click", "pyseccomp", "cgroupspy")
OPTIONAL_DEPENDENCIES = ("tomli",)  # tomllib's backport, needed on Python 3.10 only
# The same entry as the installed `nsbox` script: `run` without click, the rest through click.
MAIN = "from nsbox.cli.fast import main\nmain()\n"


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """The module in this interpreter's environment, else in the checkout's virtual
    environment (the README's `.venv`), so that a plain system python3 can build too."""
    spec = importlib.util.find_spec(name)
    if spec is not None:
        return spec
    for site in sorted(REPO.glob(".venv/lib/python3*/site-packages")):
        spec = importlib.machinery.PathFinder.find_spec(name, [str(site)])
        if spec is not None:
            return spec
    return None


def module_files(name: str) -> list[tuple[Path, str]]:
    """(file on disk, name inside the archive) for an importable module or package."""
    spec = find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"build_pyz: {name} is found neither in {sys.executable}'s environment "
                         f"nor in {REPO / '.venv'}; set that up first (README, Quick start), "
                         "then run this again")
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
    entries["nsbox/_build_info.py"] = f"COMMIT = {commit()!r}\n".encode()
    for name in DEPENDENCIES:
        for path, arcname in module_files(name):
            entries[arcname] = path.read_bytes()
    for name in OPTIONAL_DEPENDENCIES:
        if find_spec(name) is not None:
            for path, arcname in module_files(name):
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
