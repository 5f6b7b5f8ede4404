"""nsbox.pyz: one file, no installation, reproducible; and the installed entry points."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, require


@pytest.fixture(scope="module")
def pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("build") / "nsbox.pyz"
    subprocess.run([sys.executable, str(REPO / "tools" / "build_pyz.py"), "--output", str(out)],
                   check=True, capture_output=True)
    return out


def test_pyz_build_is_reproducible(pyz: Path, tmp_path: Path):
    again = tmp_path / "again.pyz"
    subprocess.run([sys.executable, str(REPO / "tools" / "build_pyz.py"), "--output", str(again)],
                   check=True, capture_output=True)
    assert hashlib.sha256(pyz.read_bytes()).digest() == hashlib.sha256(again.read_bytes()).digest()


def test_pyz_alone_sandboxes_a_command_with_a_clean_environment(pyz: Path, tmp_path: Path):
    alone = tmp_path / "empty"
    alone.mkdir()
    shutil.copy(pyz, alone / "nsbox.pyz")
    proc = subprocess.run(
        ["env", "-i", PYTHON, "-I", "nsbox.pyz", "run", "--json", "--", "sh", "-c",
         "id -u; ls /"],
        cwd=alone, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert '"status": "OK"' in proc.stdout
    assert '"stdout": "1000\\nbin\\ndev\\netc' in proc.stdout
    assert sorted(p.name for p in alone.iterdir()) == ["nsbox.pyz"]


def test_pyz_builds_with_the_plain_system_python(tmp_path: Path):
    # The system interpreter has no click (and pip may refuse to add it, PEP 668): the build
    # takes the dependencies from the checkout's virtual environment of the Quick start.
    require((REPO / ".venv").is_dir(), "no .venv in the checkout (README, Quick start)")
    out = tmp_path / "nsbox.pyz"
    proc = subprocess.run([PYTHON, "-I", str(REPO / "tools" / "build_pyz.py"), "--output",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run = subprocess.run([PYTHON, "-I", str(out), "run", "--", "echo", "built"],
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout) == (0, "built\n"), run.stderr


@pytest.mark.slow
def test_pyz_builds_from_a_fresh_clone_fetching_its_dependencies(tmp_path: Path):
    """A clone with no .venv, the system python3 with no click: the build fetches click,
    pyseccomp and cgroupspy with pip into a temporary directory (-S: this interpreter's own
    site-packages are not looked at either, as on a system without them)."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", "*.so", "build", "dist", "*.egg-info"))
    out = tmp_path / "nsbox.pyz"
    proc = subprocess.run([PYTHON, "-I", "-S", str(clone / "tools" / "build_pyz.py"),
                           "--output", str(out)], capture_output=True, text=True, timeout=600)
    require(proc.returncode == 0 or "pip could not fetch" not in proc.stderr,
            f"pip could not reach a package index: {proc.stderr[-500:]}")
    assert proc.returncode == 0, proc.stderr
    assert "build_pyz: fetching click>=8.1 pyseccomp>=0.1.2 cgroupspy>=0.2.2 with pip" in (
        proc.stderr)
    run = subprocess.run([PYTHON, "-I", str(out), "run", "--", "echo", "built"],
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout) == (0, "built\n"), run.stderr
    version = subprocess.run([PYTHON, "-I", str(out), "--version"], capture_output=True,
                             text=True, timeout=60)
    assert version.stdout == "nsbox 0.1.0\n"  # no checkout to name a commit


def test_pyz_runs_sessions(pyz: Path, tmp_path: Path):
    env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(tmp_path)}
    tmp_path.chmod(0o700)

    def nsbox(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PYTHON, "-I", str(pyz), *args], capture_output=True, text=True,
                              env=env, timeout=60)

    start = nsbox("session", "start", "--time", "20")
    assert start.returncode == 0, start.stderr
    session = start.stdout.strip()
    try:
        run = nsbox("session", "exec", session, "--", "sh", "-c", "echo in-session")
        assert (run.returncode, run.stdout) == (0, "in-session\n"), run.stderr
    finally:
        stop = nsbox("session", "stop", session)
    assert stop.returncode == 0, stop.stderr


def test_version_names_the_commit(pyz: Path):
    proc = subprocess.run([PYTHON, "-I", str(pyz), "--version"], capture_output=True, text=True)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True)
    assert "unknown" not in proc.stdout
    if head.returncode == 0:
        assert proc.stdout == f"nsbox 0.1.0 (commit {head.stdout.strip()})\n"
    else:  # built where no commit could be named: the version alone
        assert proc.stdout == "nsbox 0.1.0\n"


def test_pyz_doctor_gives_no_remedy_a_pyz_cannot_take(pyz: Path):
    proc = subprocess.run([PYTHON, "-I", str(pyz), "doctor"], capture_output=True, text=True,
                          timeout=120)
    [core] = [line for line in proc.stdout.splitlines() if "launch core" in line]
    assert "nsbox.pyz: the Python child runs every launch" in core
    assert "reinstall" not in core and "gcc" not in core


def test_pyz_dependencies_are_the_packages(pyz: Path):
    """tools/build_pyz.py fetches what pyproject.toml's dependencies name."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import build_pyz
    finally:
        sys.path.remove(str(REPO / "tools"))
    text = (REPO / "pyproject.toml").read_text()
    listed = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    fetched = [*build_pyz.DEPENDENCIES.values(),
               *(f"{r}; python_version < '3.11'" for r in build_pyz.OPTIONAL_DEPENDENCIES.values())]
    assert [line.strip().strip(",").strip('"') for line in listed.strip().splitlines()] == fetched


def test_python_dash_m_nsbox_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "nsbox", "run", "--", "echo", "ok"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "ok\n")


def test_every_command_has_help_with_an_example():
    import click

    from nsbox.cli.commands import main

    def commands(group: click.Group, prefix: list[str]) -> list[list[str]]:
        found = []
        for name, command in group.commands.items():
            found.append([*prefix, name])
            if isinstance(command, click.Group):
                found.extend(commands(command, [*prefix, name]))
        return found

    missing = []
    for path in commands(main, []):
        proc = subprocess.run([sys.executable, "-m", "nsbox", *path, "--help"],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0 or "Example" not in proc.stdout:
            missing.append(" ".join(path))
    assert missing == []
