"""What a pip-installed copy (a wheel's files, no source tree) and the one-file nsbox.pyz list
and run: the commands of `nsbox --help`, the bench among them, and the seccomp programs built
with the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PYTHON, REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nsbox installed from a wheel built from this tree into a directory of its own (its
    dependencies are this environment's)."""
    target = tmp_path_factory.mktemp("installed")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--target", str(target), str(REPO)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _nsbox(target: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(target / "bin" / "nsbox"), *args], capture_output=True, text=True,
                          timeout=120, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(target)})


def test_the_installed_copy_has_no_source_tree_and_runs(installed: Path) -> None:
    assert not (installed / "bench").exists() and not (installed / "tests").exists()
    run = _nsbox(installed, "run", "--", "sh", "-c", "echo inside")
    assert (run.returncode, run.stdout) == (0, "inside\n"), run.stderr


def test_the_installed_copy_names_its_commit(installed: Path) -> None:
    """The commit is written into the wheel at build time (setup.py): the copy has no
    checkout to ask."""
    assert (installed / "nsbox" / "_build_info.py").is_file()
    proc = _nsbox(installed, "--version")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True)
    assert "unknown" not in proc.stdout
    if head.returncode == 0:
        assert proc.stdout == f"nsbox 0.1.0 (commit {head.stdout.strip()})\n"
    else:  # no git, or not a checkout: the version alone
        assert proc.stdout == "nsbox 0.1.0\n"


def test_every_command_nsbox_help_lists_answers_help(installed: Path) -> None:
    helped = _nsbox(installed, "--help")
    assert helped.returncode == 0, helped.stderr
    commands = []
    listing = helped.stdout.split("Commands:", 1)[1]
    for line in listing.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            commands.append(line.split()[0])
    assert "bench" in commands and "run" in commands
    for command in commands:
        proc = _nsbox(installed, command, "--help")
        assert proc.returncode == 0, (command, proc.stderr)
        assert "usage" in proc.stdout.lower(), command


def test_the_installed_bench_runs(installed: Path, tmp_path: Path) -> None:
    proc = _nsbox(installed, "bench", "--quick", "--rounds", "1", "--soak", "0", "--seconds",
                  "0.1", "--cpu-launches", "2", "--no-peers", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [report] = tmp_path.glob("bench-*.json")
    assert "nsbox API cold" in json.loads(report.read_text())["latency"]["/bin/true"]


def test_the_installed_copy_reads_its_seccomp_programs(installed: Path) -> None:
    programs = installed / "nsbox" / "host" / "seccomp_programs"
    assert len(list(programs.glob("*.json"))) >= 3
    code = ("import sys, nsbox; from nsbox.host import seccomp; "
            "assert nsbox.run(['/bin/true']).ok; "
            "print(nsbox.__file__, seccomp.stats.compiled, seccomp.stats.shipped_hits, "
            "'pyseccomp' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd="/", env={**os.environ, "PYTHONPATH": str(installed)})
    assert proc.returncode == 0, proc.stderr
    where, compiled, shipped, imported = proc.stdout.split()
    assert where.startswith(str(installed))
    assert (compiled, shipped, imported) == ("0", "2", "False")


def test_the_one_file_cli_lists_and_runs_the_bench(tmp_path: Path) -> None:
    out = tmp_path / "nsbox.pyz"
    subprocess.run([sys.executable, str(REPO / "tools" / "build_pyz.py"), "--output", str(out)],
                   check=True, capture_output=True)
    listed = subprocess.run([PYTHON, "-I", str(out), "--help"], capture_output=True, text=True,
                            timeout=60)
    assert "bench" in listed.stdout
    helped = subprocess.run([PYTHON, "-I", str(out), "bench", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    assert "--quick" in helped.stdout


def test_the_installed_copy_carries_the_launch_engine(installed: Path) -> None:
    # Built with the package, executable, inside the package directory (rule nsbox-code keeps
    # every sandbox from writing it), and a one-shot run goes through it.
    binary = installed / "nsbox" / "nsbox-engine"
    assert binary.is_file() and os.access(binary, os.X_OK)
    code = ("import nsbox; from nsbox.host import engine; r = nsbox.run(['true']); "
            "print(r.status.value, engine.client.sent, engine.PATH)")
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd="/", env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(installed)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["OK", "1", str(binary)]
