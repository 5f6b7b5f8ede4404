"""The seccomp programs built with the package (nsbox/profiles/programs.py): what they are, who
reads them, and that a missing or damaged one is compiled again, never replaced by less."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import Runner, require

import nsbox
from nsbox.errors import PolicyError
from nsbox.host import landlock_filter, seccomp_compile
from nsbox.host import seccomp as sc
from nsbox.policy.policy import Bind, Policy, Seccomp, SeccompArg, SeccompRule
from nsbox.profiles import programs

SHIPPED = Path(sc.SHIPPED_DIR)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    # An editable install and a wheel build them (setup.py); CI installs so.
    require(SHIPPED.is_dir() and any(SHIPPED.glob("*.json")),
            f"no seccomp programs built in {SHIPPED} (pip install -e . builds them)")


def _entries() -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(SHIPPED.glob("*.json"))]


def _seccomp(source: dict) -> Seccomp:
    rules = tuple(SeccompRule(rule["syscall"], rule["action"],
                              tuple(SeccompArg(**arg) for arg in rule["args"]))
                  for rule in source["rules"])
    return Seccomp(enabled=source["enabled"], default_action=source["default_action"],
                   rules=rules, log_denied=source["log_denied"])


def test_the_shipped_programs_are_what_the_compiler_makes_now() -> None:
    entries = _entries()
    assert entries
    for stored in entries:
        if stored["source"].get("setid"):
            key = sc.setid_key()
            fresh = seccomp_compile.compile_setid(key)
        elif stored["source"].get("landlock"):
            key = landlock_filter.filter_key()
            fresh = landlock_filter.compile_filter(key)
        else:
            policy = _seccomp(stored["source"]["seccomp"])
            key = sc.cache_key(policy)
            fresh = seccomp_compile.compile_program(policy, key)
        assert stored["key"] == key, stored["source"]  # the key of what it was built from
        assert (SHIPPED / f"{key}.json").is_file()
        assert bytes.fromhex(stored["bpf"]) == fresh.bpf, stored["source"]
        assert (stored["listener"], stored["notify"]) == (fresh.listener, fresh.notify)


def test_every_shipped_profile_has_its_programs_in_learning_mode_too() -> None:
    from nsbox.profiles import load_profile, shipped_profiles

    wanted = {sc.setid_key(), landlock_filter.filter_key()}
    for name in shipped_profiles():
        policy = load_profile(name).seccomp
        wanted |= {sc.cache_key(policy),
                   sc.cache_key(dataclasses.replace(policy, log_denied=True))}
    assert {path.stem for path in SHIPPED.glob("*.json")} == wanted
    for key in wanted:
        assert sc.read_shipped(key) is not None, key


def test_the_key_changes_with_the_policy_the_rules_and_the_architecture(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plain = sc.cache_key(Seccomp())
    assert sc.cache_key(Seccomp(log_denied=True)) != plain
    assert sc.cache_key(Seccomp(rules=(SeccompRule("getppid", "errno:EACCES"),))) != plain
    monkeypatch.setattr(sc, "BUILTIN_DIGEST", "0" * 64)
    assert sc.cache_key(Seccomp()) != plain
    monkeypatch.undo()
    monkeypatch.setattr(sc, "architecture", lambda: "aarch64-64")
    assert sc.cache_key(Seccomp()) != plain
    monkeypatch.undo()
    monkeypatch.setattr("nsbox.version.VERSION", "0.0.0-other")
    assert sc.cache_key(Seccomp()) != plain


RUN_AND_COUNT = r'''
import sys
sys.path.insert(0, sys.argv[1])
import nsbox
from nsbox.host import seccomp
probe = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
         "print(libc.unshare(0x10000000), ctypes.get_errno())")
out = []
for policy in (nsbox.Policy(), nsbox.Policy(seccomp=nsbox.Seccomp(log_denied=True))):
    result = nsbox.run(["python3", "-c", probe], policy, timeout=30)
    out.append(result.stdout.decode().strip())
s = seccomp.stats
print(s.compiled, s.setid_compiled, s.shipped_hits, "pyseccomp" in sys.modules, *out, sep="|")
'''


@pytest.mark.parametrize("uid", [None, 65534])
def test_a_run_of_a_shipped_profile_neither_imports_pyseccomp_nor_compiles(
        public_tree: Path, uid: int | None) -> None:
    """For root and for a regular user alike (in a fresh process, no disk cache)."""
    if uid is not None and os.geteuid() != 0:
        pytest.skip("this process is already unprivileged: the other case covers it")
    user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] if uid else []
    proc = subprocess.run([*user, "/usr/bin/python3", "-I", "-c", RUN_AND_COUNT,
                           str(public_tree)], capture_output=True, text=True, timeout=120,
                          cwd="/", env={"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    compiled, setid, shipped, imported, default, learning = proc.stdout.strip().split("|")
    assert (compiled, setid, shipped, imported) == ("0", "0", "3", "False")
    assert default == learning == f"-1 {errno.EPERM}"  # the filter is there and denies


LANDLOCK_RUN = r'''
import sys
sys.path.insert(0, sys.argv[1])
import nsbox
from nsbox.host import seccomp
result = nsbox.run(["true"], nsbox.Policy(isolation="landlock"), timeout=30)
assert result.ok and result.isolation == "landlock", result
print(seccomp.stats.compiled + seccomp.stats.setid_compiled, seccomp.stats.shipped_hits,
      "pyseccomp" in sys.modules)
'''


def test_the_landlock_modes_filter_comes_with_the_package(public_tree: Path) -> None:
    """The Landlock mode loads its own filter beside the set-id filter and the policy's: all
    three from the package, none compiled."""
    from test_landlock import require_landlock

    require_landlock()
    proc = subprocess.run(["/usr/bin/python3", "-I", "-c", LANDLOCK_RUN, str(public_tree)],
                          capture_output=True, text=True, timeout=120, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "3", "False"]


@pytest.fixture
def shipped_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    copy = tmp_path / "programs"
    shutil.copytree(SHIPPED, copy)
    monkeypatch.setattr(sc, "SHIPPED_DIR", str(copy))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sc._memory.clear()  # the programs of this process: read again
    yield copy
    sc._memory.clear()


def test_without_shipped_programs_the_same_filter_is_compiled(shipped_copy: Path) -> None:
    """A build without libseccomp, or nsbox.pyz: compiled at run time, the same bytes."""
    shipped = sc.read_shipped(sc.cache_key(Seccomp()))
    assert shipped is not None
    shutil.rmtree(shipped_copy)
    before = sc.stats.compiled, sc.stats.setid_compiled
    assert sc.load(Seccomp()).bpf == shipped.bpf
    probe = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
             "print(libc.unshare(0x10000000), ctypes.get_errno())")
    result = nsbox.run(["python3", "-c", probe])
    assert result.stdout.decode().split() == ["-1", str(errno.EPERM)], result
    assert (sc.stats.compiled, sc.stats.setid_compiled) == (before[0] + 1, before[1] + 1)


def test_a_damaged_or_misfiled_shipped_program_is_compiled_instead(shipped_copy: Path) -> None:
    key = sc.cache_key(Seccomp())
    path = shipped_copy / f"{key}.json"
    good = sc.read_shipped(key)
    assert good is not None
    stored = json.loads(path.read_text())
    stored["bpf"] = stored["bpf"][:-16] + "0600000000007fff"  # the last instruction: allow
    path.write_text(json.dumps(stored))
    assert sc.read_shipped(key) is None
    # Another policy's program under this key: its own key inside gives it away.
    other = json.loads((shipped_copy / f"{sc.cache_key(Seccomp(log_denied=True))}.json")
                       .read_text())
    path.write_text(json.dumps(other))
    assert sc.read_shipped(key) is None
    path.write_bytes(b"\x00not json")
    assert sc.read_shipped(key) is None
    before = sc.stats.compiled
    assert sc.load(Seccomp()).bpf == good.bpf
    assert sc.stats.compiled == before + 1


def test_no_sandbox_may_bind_the_programs_writable(sandbox: Runner) -> None:
    """Rule nsbox-code, which is what lets every caller trust them."""
    tree = SHIPPED if sandbox.mode == "caller" else (
        sandbox.tree / "nsbox" / "host" / "seccomp_programs")
    for source in (tree, tree.parent):
        with pytest.raises(PolicyError) as info:
            sandbox.run(["/bin/true"], binds=[(str(source), "/x", True)])
        assert info.value.rule == "nsbox-code", info.value


def test_build_writes_one_program_per_policy_and_removes_stale_ones(tmp_path: Path) -> None:
    (tmp_path / "stale.json").write_text("{}")
    keys = programs.build(str(tmp_path))
    assert sorted(path.stem for path in tmp_path.glob("*.json")) == sorted(keys)
    assert len(keys) == len(set(keys)) == 2 + len(programs.shipped_policies())
    assert oct(tmp_path.stat().st_mode & 0o777) == oct(0o755)
    assert all(path.stat().st_mode & 0o777 == 0o644 for path in tmp_path.glob("*.json"))


def test_the_policy_of_a_bind_is_not_in_the_key() -> None:
    """The key is the seccomp policy's alone: a profile's mounts do not give a new program."""
    policy = Policy(mounts=Policy().mounts + (Bind("/usr/share", "/share"),))
    assert sc.cache_key(policy.seccomp) == sc.cache_key(Seccomp())
