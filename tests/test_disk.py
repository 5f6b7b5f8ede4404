"""Limits as users write them: `none` for the options whose profile key takes it, the line that
names a full /tmp or /workspace, and a host-directory workspace reported as not limited on disk.

Real sandboxes, as this process's user and as an unprivileged uid, through both cores where the
init is involved (the init names the full places when the command ends).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON
from sessiontools import UserRunner, user_runner

import nsbox

DOORS = {
    "fast": ["-m", "nsbox"],
    "click": ["-c",
              "import sys; from nsbox.cli.commands import main; sys.argv[0] = 'nsbox'; main()"],
}


@pytest.fixture(params=["caller", "unprivileged"])
def user(request: pytest.FixtureRequest, public_tree: Path) -> UserRunner:
    return user_runner(request, public_tree)


def nsbox_cli(user: UserRunner, door: str, args: list[str], cwd: Path,
              core: str = "") -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(user.tree), "HOME": "/tmp",
           "NSBOX_NATIVE": core}
    return subprocess.run([*user.prefix(), PYTHON, *DOORS[door], *args], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, env=env, cwd=cwd, timeout=60)


@pytest.mark.parametrize("door", DOORS)
def test_none_lifts_a_limit_where_the_profile_key_takes_it(door: str, public_tree: Path,
                                                           tmp_path: Path) -> None:
    caller = UserRunner("caller", public_tree)
    done = nsbox_cli(caller, door, [
        "run", "-q", "--file-size", "none", "--memory", "none", "--pids", "none", "--cpu-time",
        "none", "--cpus", "none", "--time", "none", "--", "sh", "-c", "ulimit -f; ulimit -t"],
        tmp_path)
    assert (done.returncode, done.stdout) == (0, "unlimited\nunlimited\n"), done.stderr
    shown = nsbox_cli(caller, door, ["run", "--memory", "NONE", "--time", "none",
                                     "--print-profile"], tmp_path)
    assert 'memory = "none"' in shown.stdout and 'wall_time = "none"' in shown.stdout
    capped = nsbox_cli(caller, door, ["run", "-q", "--file-size", "1M", "--", "sh", "-c",
                                      "ulimit -f"], tmp_path)
    assert capped.stdout == "2048\n"  # dash's ulimit -f counts 512-byte blocks


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(("option", "reason"), [
    ("--tmp-size", "/tmp is a tmpfs"), ("--open-files", "always has an open-files limit"),
    ("--output-limit", "the output is always capped")])
def test_none_is_a_usage_error_where_a_limit_always_holds(door: str, option: str, reason: str,
                                                          public_tree: Path,
                                                          tmp_path: Path) -> None:
    done = nsbox_cli(UserRunner("caller", public_tree), door,
                     ["run", option, "none", "--", "true"], tmp_path)
    assert done.returncode == 2 and reason in done.stderr, done.stderr
    assert "'none' is not allowed" in done.stderr and "Traceback" not in done.stderr


def test_none_for_a_tmpfs_workspace_is_refused_with_the_way_out() -> None:
    policy = nsbox.Policy().with_limits(workspace_size=None)
    with pytest.raises(nsbox.PolicyError) as caught:
        nsbox.run(["true"], policy)
    assert caught.value.key == "limits.workspace_size"
    assert "--workspace DIR" in (caught.value.hint or "")


@pytest.mark.parametrize("core", ["", "0"], ids=["native", "python"])
def test_a_full_tmp_or_workspace_is_named_and_the_status_stays_the_programs(
        user: UserRunner, core: str) -> None:
    out = user.script("""
fill = "dd if=/dev/zero of={} bs=64K count=4000 status=none"
tmp = nsbox.run(["sh", "-c", fill.format("/tmp/fill")])
ws = nsbox.run(["sh", "-c", fill.format("fill") + "; exit 7"],
               nsbox.Policy().with_limits(workspace_size=2 << 20, file_size=None))
cleaned = nsbox.run(["sh", "-c", fill.format("/tmp/fill") + "; rm /tmp/fill"])
fine = nsbox.run(["sh", "-c", "head -c 1M /dev/zero > /tmp/x"])
with nsbox.Session() as s:
    s.run(["sh", "-c", fill.format("/tmp/fill")])
    session = s.run(["sh", "-c", "echo more >> /tmp/fill"])
    s.run(["rm", "/tmp/fill"])
    after = s.run(["true"])
emit(tmp=[tmp.status.value, tmp.exit_code, tmp.disk_full, tmp.to_dict()["disk_full"]],
     ws=[ws.status.value, ws.exit_code, ws.disk_full], cleaned=cleaned.disk_full,
     fine=[fine.status.value, fine.disk_full], session=[session.status.value,
     session.disk_full], after=after.disk_full, core=tmp.extra.get("core"))
""", env={"NSBOX_NATIVE": core})
    assert out["core"] == ("python" if core == "0" else "native")
    assert out["tmp"] == ["RE", 1, ["/tmp"], ["/tmp"]]
    assert out["ws"] == ["RE", 7, ["/workspace"]]  # the program's own status, named place
    assert out["fine"] == ["OK", []]
    assert out["session"] == ["RE", ["/tmp"]] and out["after"] == []
    # Known and documented: a place emptied again before the command ended is not named.
    assert out["cleaned"] == []


@pytest.mark.parametrize("door", DOORS)
def test_the_cli_says_which_place_was_full(user: UserRunner, door: str,
                                           unprivileged_tmp: Path) -> None:
    fill = ["--", "sh", "-c", "dd if=/dev/zero of=/tmp/fill bs=1M count=100 status=none"]
    done = nsbox_cli(user, door, ["run", "-q", *fill], unprivileged_tmp)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "nsbox: /tmp was full when the command ended; raise its size with --tmp-size")
    as_json = nsbox_cli(user, door, ["run", "--json", *fill], unprivileged_tmp)
    assert json.loads(as_json.stdout)["disk_full"] == ["/tmp"]
    ok = nsbox_cli(user, door, ["run", "-q", "--", "true"], unprivileged_tmp)
    assert ok.stderr == ""


def test_a_host_directory_workspace_is_reported_as_not_limited_on_disk(
        user: UserRunner, unprivileged_tmp: Path) -> None:
    work = unprivileged_tmp / "work"
    work.mkdir()
    os.chown(work, 65534, 65534)
    out = user.script(f"""
plain = nsbox.run(["true"], workspace={str(work)!r})
accepted = nsbox.run(["true"], nsbox.Policy().with_limits(workspace_size=None),
                     workspace={str(work)!r})
tmpfs = nsbox.run(["true"])
with nsbox.Session(workspace={str(work)!r}) as s:
    session = s.run(["true"])
emit(plain=plain.degraded, accepted=accepted.degraded, tmpfs=tmpfs.degraded,
     session=session.degraded)
""")
    disk = [line for line in out["plain"] if line.startswith("disk:")]
    assert len(disk) == 1 and str(work) in disk[0] and "not limited" in disk[0]
    assert [line for line in out["session"] if line.startswith("disk:")] == disk
    for other in (out["accepted"], out["tmpfs"]):
        assert not [line for line in other if line.startswith("disk:")]
    for door in DOORS:
        said = nsbox_cli(user, door, ["run", "-w", str(work), "--", "true"], unprivileged_tmp)
        assert said.returncode == 0, said.stderr
        (line,) = [line for line in said.stderr.splitlines()
                   if line.startswith("nsbox: limits approximated on this host: ")]
        assert "disk (/workspace is a host directory; --workspace-size none accepts that)" in line
        quiet = nsbox_cli(user, door, ["run", "--json", "-w", str(work), "--workspace-size",
                                       "none", "--", "true"], unprivileged_tmp)
        assert not [d for d in json.loads(quiet.stdout)["degraded"] if d.startswith("disk:")]
