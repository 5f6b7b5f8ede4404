"""The seccomp filter: denied syscalls answer the documented errno (or kill), real workloads run,
the program is cached, and learning mode reports what was denied without letting it through.

Probes run inside the sandbox; every verdict is read on the host side.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, Runner, require

import nsbox
from nsbox.errors import PolicyError, SetupError
from nsbox.host import seccomp as sc
from nsbox.host import seccomp_compile
from nsbox.policy.policy import Bind, Policy, Seccomp, SeccompArg, SeccompRule

PROBE_SRC = Path(__file__).parent / "probes" / "seccomp_probe.c"
X86_64 = os.uname().machine == "x86_64"


# --- running things in a sandbox --------------------------------------------------------------


class Outcome:
    def __init__(self, result: nsbox.Result) -> None:
        self.result = result
        self.stdout = result.stdout.decode(errors="replace")
        self.stderr = result.stderr.decode(errors="replace")

    @property
    def signal(self) -> int | None:
        return self.result.signal

    def __repr__(self) -> str:
        return (f"<{self.result.status} exit={self.result.exit_code} sig={self.result.signal} "
                f"stdout={self.stdout[-2000:]!r} stderr={self.stderr[-2000:]!r}>")


def clear_memory_cache() -> None:
    """Forget the programs this process compiled, so the next load reads the disk cache."""
    sc._memory.clear()


def program_for(seccomp: Seccomp) -> bytes:
    """The BPF program (bytes of struct sock_filter) for ``seccomp``, from the caches."""
    return sc.load(seccomp).bpf


def launch(runner: Runner, argv: list[str], *, seccomp: Seccomp | None = None,
           binds: tuple[tuple[str, str], ...] = ()) -> Outcome:
    """nsbox.run as the caller or as an unprivileged uid (the conftest's Runner)."""
    kwargs: dict = {"limit_changes": {"wall_time": 60.0, "memory": 1 << 30, "pids": 512}}
    if binds:
        kwargs["binds"] = [list(b) for b in binds]
    if seccomp is not None:
        kwargs["seccomp"] = dataclasses.asdict(seccomp)
    return Outcome(runner.run(argv, **kwargs))


@pytest.fixture(scope="module")
def probe_dir() -> Iterator[Path]:
    """The probe, built here with gcc, in a directory every uid can read (it is bound in)."""
    require(shutil.which("gcc") is not None, "gcc is needed to build the probe")
    out = Path(tempfile.mkdtemp(prefix="nsbox-probe-", dir="/tmp"))
    out.chmod(0o755)
    subprocess.run(["gcc", "-O1", "-Wall", "-o", str(out / "probe"), str(PROBE_SRC)],
                   check=True)
    yield out
    shutil.rmtree(out)


def run_probe(runner: Runner, probe_dir: Path, *specs: str,
              seccomp: Seccomp | None = None) -> Outcome:
    return launch(runner, ["/probe/probe", *specs], seccomp=seccomp,
                  binds=((str(probe_dir), "/probe"),))


def answers(outcome: Outcome) -> dict[str, tuple[int, int]]:
    """The probe's lines "NAME RESULT ERRNO" -> {NAME: (RESULT, ERRNO)}."""
    table = {}
    for line in outcome.stdout.splitlines():
        name, result, err = line.split()
        table[name] = (int(result), int(err))
    return table


def nr(name: str) -> int:
    import pyseccomp

    return int(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name))


# --- the default policy, syscall by syscall ---------------------------------------------------

# The list, with the errno each must answer. Denied outright, whatever the arguments.
DENIED = {
    **{name: errno.EPERM for name in (
        "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
        "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
        "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig",
        "fsmount", "fspick", "mount_setattr", "swapon", "swapoff", "reboot", "acct",
        "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "quotactl",
        "quotactl_fd", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "ioperm",
        "iopl", "vm86", "vm86old", "uselib", "modify_ldt", "syslog", "setns", "unshare",
    )},
    **{name: errno.ENOSYS for name in (
        "io_uring_setup", "io_uring_enter", "io_uring_register", "clone3",
    )},
}

# <linux/sched.h>
CLONE_FLAGS = {
    "NEWNS": 0x00020000, "NEWCGROUP": 0x02000000, "NEWUTS": 0x04000000,
    "NEWIPC": 0x08000000, "NEWUSER": 0x10000000, "NEWPID": 0x20000000,
    "NEWNET": 0x40000000,
}
SIGCHLD = 17
TIOCSTI, TIOCLINUX, TCGETS = 0x5412, 0x541C, 0x5401


def denied_specs() -> tuple[list[str], dict[str, int]]:
    """Probe specs for every denied syscall this architecture has, with the expected errno."""
    specs, expected = [], {}
    for name, err in DENIED.items():
        number = nr(name)
        if number < 0:  # vm86 and friends exist on 32-bit x86 only
            continue
        # Harmless arguments: fds of -1, null pointers. Without the filter they would fail
        # in other ways (EBADF, EFAULT, EINVAL) or need capabilities the sandbox lacks.
        args = {"unshare": "0", "setns": "0xffffffff:0"}.get(name, "0xffffffffffffffff:0:0")
        specs.append(f"{name}:{number}:{args}")
        expected[name] = err
    for flag, bit in CLONE_FLAGS.items():
        specs.append(f"clone_{flag}:{nr('clone')}:{bit | SIGCHLD}:0:0:0:0")
        expected[f"clone_{flag}"] = errno.EPERM
    for label, request in (
        ("ioctl_TIOCSTI", TIOCSTI),
        ("ioctl_TIOCLINUX", TIOCLINUX),
        # The kernel reads the request as 32 bits; upper bits must not get it past the filter.
        ("ioctl_TIOCSTI_hi1", TIOCSTI | 1 << 32),
        ("ioctl_TIOCSTI_sext", 0xFFFFFFFF00000000 | TIOCSTI),
    ):
        specs.append(f"{label}:{nr('ioctl')}:0:{request}:0")
        expected[label] = errno.EPERM
    af_packet, af_alg, af_vsock, netlink_audit, sock_raw = 17, 38, 40, 9, 3
    for label, family, proto in (
        ("socket_AF_PACKET", af_packet, 0),
        ("socket_AF_ALG", af_alg, 0),
        ("socket_AF_VSOCK", af_vsock, 0),
        ("socket_AF_INET_hibits", 0x100000002, 0),  # AF_INET with the upper half set
    ):
        specs.append(f"{label}:{nr('socket')}:{family}:{sock_raw}:{proto}")
        expected[label] = errno.EAFNOSUPPORT
    specs.append(f"socketpair_AF_INET:{nr('socketpair')}:2:1:0:0")
    expected["socketpair_AF_INET"] = errno.EAFNOSUPPORT
    specs.append(f"socket_NETLINK_AUDIT:{nr('socket')}:16:{sock_raw}:{netlink_audit}")
    expected["socket_NETLINK_AUDIT"] = errno.EPROTONOSUPPORT
    for label, persona in (
        ("personality_ADDR_NO_RANDOMIZE", 0x0040000),
        ("personality_READ_IMPLIES_EXEC", 0x0400000),
        ("personality_MMAP_PAGE_ZERO", 0x0100000),
        ("personality_hibits", 1 << 32),
    ):
        specs.append(f"{label}:{nr('personality')}:{persona}")
        expected[label] = errno.EPERM
    return specs, expected


def test_every_denied_syscall_answers_its_errno(sandbox: Runner, probe_dir: Path) -> None:
    specs, expected = denied_specs()
    outcome = run_probe(sandbox, probe_dir, *specs)
    assert outcome.result.exit_code == 0, outcome
    got = answers(outcome)
    assert {name: got.get(name) for name in expected} == {
        name: (-1, err) for name, err in expected.items()
    }


def test_learning_mode_shows_the_filter_denied_each_one(sandbox: Runner, probe_dir: Path) -> None:
    """The same probe with log_denied: the same errnos, and the host-side record names every
    syscall, which proves the filter (not a missing capability) refused each of them."""
    specs, expected = denied_specs()
    outcome = run_probe(sandbox, probe_dir, *specs, seccomp=Seccomp(log_denied=True))
    assert outcome.result.exit_code == 0, outcome
    got = answers(outcome)
    assert {name: got.get(name) for name in expected} == {
        name: (-1, err) for name, err in expected.items()
    }
    reported = set(outcome.result.extra["seccomp_denied"])
    syscalls = {name.split("_")[0] if name.startswith(("clone_", "ioctl_", "socket",
                                                        "personality_")) else name
                for name in expected}
    assert syscalls <= reported, syscalls - reported


def test_allowed_neighbours_still_work(sandbox: Runner, probe_dir: Path) -> None:
    """The argument rules hit only what they target."""
    outcome = run_probe(
        sandbox, probe_dir,
        f"ioctl_TCGETS:{nr('ioctl')}:0:{TCGETS}:0",  # stdin is no terminal: ENOTTY, not EPERM
        f"socket_unix:{nr('socket')}:1:1:0",
        f"socket_inet:{nr('socket')}:2:2:0",
        f"socket_inet6:{nr('socket')}:10:2:0",
        f"socket_netlink_route:{nr('socket')}:16:3:0",
        f"socketpair_unix:{nr('socketpair')}:1:1:0:0",  # passes the filter; no array: EFAULT
        f"personality_query:{nr('personality')}:0xffffffff",
        f"getpid:{nr('getpid')}",
    )
    got = answers(outcome)
    assert got["ioctl_TCGETS"] == (-1, errno.ENOTTY)
    assert got["socketpair_unix"] == (-1, errno.EFAULT)
    for name in ("socket_unix", "socket_inet", "socket_inet6", "socket_netlink_route"):
        assert got[name][0] >= 0 and got[name][1] == 0, (name, got[name])
    assert got["personality_query"] == (0, 0)
    assert got["getpid"][1] == 0 and got["getpid"][0] > 0


@pytest.mark.skipif(not X86_64, reason="int 0x80 and x32 exist on x86_64 only")
def test_int80_from_a_64_bit_process_is_killed(sandbox: Runner, probe_dir: Path) -> None:
    # Without the filter the 32-bit entry works on this kernel (IA32 emulation), so a
    # SIGSYS below comes from the filter's bad-arch action and not from a missing entry.
    plain = subprocess.run([str(probe_dir / "probe"), "int80"], capture_output=True, text=True)
    require(plain.returncode == 0 and plain.stdout.startswith("int80 "),
            "the kernel has no IA32 emulation: int 0x80 cannot be tested")
    outcome = run_probe(sandbox, probe_dir, "int80")
    assert outcome.signal == signal.SIGSYS, outcome
    assert "int80" not in outcome.stdout


@pytest.mark.skipif(not X86_64, reason="the x32 ABI exists on x86_64 only")
def test_x32_syscall_number_is_killed(sandbox: Runner, probe_dir: Path) -> None:
    outcome = run_probe(sandbox, probe_dir, "x32")
    assert outcome.signal == signal.SIGSYS, outcome
    assert "x32" not in outcome.stdout


def test_tiocsti_on_a_real_terminal_injects_nothing(probe_dir: Path) -> None:
    """The probe's stdin is a real terminal (a pty the sandbox opens, as a program may): pushing
    input into it fails, in each spelling of the request, and no injected byte comes back from
    the terminal. A terminal of the host is not handed in at all (tests/test_stdin.py)."""
    policy = Policy(mounts=Policy().mounts + (Bind(str(probe_dir), "/probe"),),
                    seccomp=Seccomp(log_denied=True))
    on_a_pty = ("import os, sys\n"
                "master, slave = os.openpty()\n"
                "if os.fork() == 0:\n"
                "    os.dup2(slave, 0)\n"
                "    os.execv('/probe/probe', ['/probe/probe', 'tiocsti'])\n"
                "os.wait()\n"
                "os.set_blocking(master, False)\n"
                "try:\n"
                "    sys.stderr.write('echoed %r' % os.read(master, 64))\n"
                "except BlockingIOError:\n"
                "    pass\n")
    result = nsbox.run(["python3", "-c", on_a_pty], policy)
    got = answers(Outcome(result))
    assert got == {f"tiocsti_{i}": (-1, errno.EPERM) for i in range(3)}, result
    assert "ioctl" in result.extra["seccomp_denied"]  # the filter refused it
    assert b"echoed" not in result.stderr


def test_ptrace_reaches_sandbox_processes_alone(sandbox: Runner, probe_dir: Path) -> None:
    """The documented decision: ptrace and process_vm_* stay allowed; inside its own PID
    namespace a process can trace its own children and cannot even name a host process."""
    inside = answers(run_probe(sandbox, probe_dir, "ptrace-child"))
    assert inside == {"ptrace_attach": (0, 0), "ptrace_stopped": (1, 0)}
    host_pid = os.getpid()
    attach = answers(run_probe(sandbox, probe_dir,
                               f"ptrace_host:{nr('ptrace')}:16:{host_pid}:0:0"))  # ATTACH
    assert attach == {"ptrace_host": (-1, errno.ESRCH)}
    assert answers(run_probe(sandbox, probe_dir, "vm-read", "2")) == {
        "process_vm_readv": (8, 0)}  # pid 2, the command: itself
    # pid 1, the sandbox's init, is outside the filter: not dumpable, so out of reach.
    assert answers(run_probe(sandbox, probe_dir, "vm-read", "1")) == {
        "process_vm_readv": (-1, errno.EPERM)}
    assert answers(run_probe(sandbox, probe_dir, "vm-read", str(host_pid))) == {
        "process_vm_readv": (-1, errno.ESRCH)}


def test_netlink_route_serves_ordinary_programs(sandbox: Runner) -> None:
    """if_nameindex(3) (like getifaddrs and getaddrinfo's AI_ADDRCONFIG) reads NETLINK_ROUTE."""
    outcome = launch(sandbox, [PYTHON, "-c", "import socket; print(socket.if_nameindex())"])
    assert outcome.result.exit_code == 0, outcome
    assert "'lo'" in outcome.stdout


def test_program_holds_the_native_architecture_alone() -> None:
    """The first check of the program compares seccomp_data.arch with the native value and
    jumps to the kill for anything else; no second architecture is compared. In front of it,
    the prefix for calls newer than the rules (tests/test_seccomp_new_calls.py) checks the
    architecture too and leaves any other to that check."""
    import struct

    bpf = seccomp_compile.compile_program(Seccomp()).bpf
    insns = [struct.unpack("=HBBI", bpf[i:i + 8]) for i in range(0, len(bpf), 8)]
    audit_arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}.get(os.uname().machine)
    require(audit_arch is not None, "no AUDIT_ARCH value known for this machine")
    bpf_ld_w_abs, bpf_jeq_k, bpf_ret_k = 0x20, 0x15, 0x06
    loads_of_arch = [i for i, (code, _, _, k) in enumerate(insns)
                     if code == bpf_ld_w_abs and k == 4]  # offsetof(seccomp_data, arch)
    assert len(loads_of_arch) == 2 and loads_of_arch[0] == 0
    start = loads_of_arch[1]  # libseccomp's program
    code, _, jf, k = insns[1]
    assert (code, k, 2 + jf) == (bpf_jeq_k, audit_arch, start)  # another arch: on to it
    code, _, jf, k = insns[start + 1]
    assert (code, k) == (bpf_jeq_k, audit_arch)
    assert insns[start + 2 + jf] == (bpf_ret_k, 0, 0, seccomp_compile.RET_KILL_PROCESS)


def test_two_filters_are_applied_after_no_new_privs(sandbox: Runner) -> None:
    """The set-id filter and the policy's; with the policy's disabled, the set-id one alone."""
    outcome = launch(sandbox, ["/bin/cat", "/proc/self/status"])
    status = dict(line.split(":\t", 1) for line in outcome.stdout.splitlines() if ":\t" in line)
    assert (status["Seccomp"], status["Seccomp_filters"], status["NoNewPrivs"]) == (
        "2", "2", "1"), outcome
    off = launch(sandbox, ["/bin/cat", "/proc/self/status"], seccomp=Seccomp(enabled=False))
    status = dict(line.split(":\t", 1) for line in off.stdout.splitlines() if ":\t" in line)
    assert (status["Seccomp"], status["Seccomp_filters"]) == ("2", "1"), off


def test_a_filter_the_kernel_refuses_stops_the_launch(unprivileged_tmp: Path) -> None:
    """Fail closed: with a program the kernel rejects, the command never runs."""
    from nsbox.launch import launcher
    from nsbox.plan import plan as planmod

    policy = Policy(workspace=str(unprivileged_tmp))
    wire = planmod.build(policy, ["/bin/touch", "/workspace/ran"]).to_wire()
    wire.update(host_uid=policy.host_uid, host_gid=policy.host_gid)
    wire["seccomp_bpf"] = struct.pack("=HBBI", 0xFFFF, 0, 0, 0).hex()  # no such BPF opcode
    with pytest.raises(SetupError) as info:
        launcher.launch_wire(wire, None, 1 << 20, False)
    assert (info.value.step, info.value.errno) == ("seccomp", errno.EINVAL)
    assert "seccomp" in info.value.message
    assert not (unprivileged_tmp / "ran").exists()


# --- profile rules ----------------------------------------------------------------------------


def test_profile_rules_change_the_filter(sandbox: Runner, probe_dir: Path) -> None:
    rules = (
        SeccompRule("getppid", "errno:EACCES"),
        SeccompRule("getpriority", "kill", (SeccompArg(0, "eq", 7),)),
        SeccompRule("socket", "allow"),  # lifts the built-in family restriction
        SeccompRule("keyctl", "errno:EOPNOTSUPP"),  # replaces the built-in EPERM
    )
    outcome = run_probe(
        sandbox, probe_dir,
        f"getppid:{nr('getppid')}",
        f"keyctl:{nr('keyctl')}:0xffffffffffffffff",
        f"socket_NETLINK_AUDIT:{nr('socket')}:16:3:9",
        f"getpriority:{nr('getpriority')}:0:0",  # arg 0 is 0: allowed
        f"getpriority_killed:{nr('getpriority')}:7:0",
        f"after_kill:{nr('getpid')}",
        seccomp=Seccomp(rules=rules),
    )
    got = answers(outcome)
    assert got["getppid"] == (-1, errno.EACCES)
    assert got["keyctl"] == (-1, errno.EOPNOTSUPP)
    # The audit netlink socket now reaches the kernel, which creates it.
    assert got["socket_NETLINK_AUDIT"][0] >= 0, got
    assert got["getpriority"][1] == 0
    assert "getpriority_killed" not in got and "after_kill" not in got
    assert outcome.signal == signal.SIGSYS, outcome


def test_default_action_errno_makes_an_allow_list(sandbox: Runner, probe_dir: Path) -> None:
    """default_action errno:EPERM, and allow rules for what the probe needs to start."""
    needed = (
        "execve", "brk", "mmap", "munmap", "mprotect", "arch_prctl", "set_tid_address",
        "set_robust_list", "rseq", "prlimit64", "access", "openat", "newfstatat", "fstat",
        "read", "pread64", "close", "write", "exit_group", "getrandom", "futex", "ioctl",
    )
    rules = tuple(SeccompRule(name, "allow") for name in needed)
    outcome = run_probe(sandbox, probe_dir, f"getpid:{nr('getpid')}", f"uname:{nr('uname')}:0",
                        seccomp=Seccomp(default_action="errno:EPERM", rules=rules))
    got = answers(outcome)
    assert got == {"getpid": (-1, errno.EPERM), "uname": (-1, errno.EPERM)}, outcome


@pytest.mark.parametrize(
    ("seccomp", "named"),
    [
        (Seccomp(rules=(SeccompRule("no_such_call", "allow"),)), "no_such_call"),
        (Seccomp(rules=(SeccompRule("getpid", "deny"),)), "'deny'"),
        (Seccomp(rules=(SeccompRule("getpid", "errno:ENOPE"),)), "ENOPE"),
        (Seccomp(rules=(SeccompRule("getpid", "errno:eperm"),)), "eperm"),
        (Seccomp(default_action="trap"), "'trap'"),
        (Seccomp(rules=(SeccompRule("read", "kill", (SeccompArg(6, "eq", 0),)),)), "index 6"),
        (Seccomp(rules=(SeccompRule("read", "kill", (SeccompArg(0, "like", 0),)),)), "'like'"),
        (Seccomp(rules=(SeccompRule("read", "kill", (SeccompArg(0, "eq", -1),)),)), "-1"),
        (Seccomp(rules=(SeccompRule(39, "allow"),)), "39"),  # type: ignore[arg-type]
        (Seccomp(rules=(SeccompRule(b"read", "allow"),)), "b'read'"),  # type: ignore[arg-type]
        (Seccomp(rules=(SeccompRule("read", "kill", (SeccompArg(0, "eq", "1"),)),)), "'1'"),
        (Seccomp(rules=(SeccompRule("read", "kill", (SeccompArg(0, "eq", 1, 3),)),)), "mask"),
    ],
)
def test_bad_rules_are_policy_errors_naming_them(seccomp: Seccomp, named: str) -> None:
    with pytest.raises(PolicyError) as info:
        nsbox.run(["/bin/true"], Policy(seccomp=seccomp))
    assert named in str(info.value)
    assert "seccomp" in (info.value.key or "")


# --- the cache --------------------------------------------------------------------------------
# The shipped profiles' programs come with the package (tests/test_seccomp_shipped.py); the
# cache serves every other policy, such as this one.
CUSTOM = Seccomp(rules=(SeccompRule("getppid", "errno:EACCES"),))

ROOT_DISK = pytest.mark.skipif(
    os.geteuid() != 0, reason="only a root caller keeps seccomp programs on disk "
    "(disk_cache_allowed); as this user the plant test below shows why")


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    clear_memory_cache()
    yield tmp_path / "nsbox" / "seccomp"
    clear_memory_cache()


@ROOT_DISK
def test_second_load_does_not_compile(cache_home: Path) -> None:
    before = sc.stats.compiled
    first = program_for(CUSTOM)
    assert sc.stats.compiled == before + 1
    assert program_for(CUSTOM) == first  # memory
    clear_memory_cache()
    hits = sc.stats.disk_hits
    assert program_for(CUSTOM) == first  # disk
    assert sc.stats.disk_hits == hits + 1
    assert sc.stats.compiled == before + 1
    assert oct(cache_home.stat().st_mode & 0o777) == oct(0o700)
    assert [p.name for p in cache_home.iterdir()] == [sc.cache_key(CUSTOM) + ".json"]


@ROOT_DISK
def test_second_launch_with_the_same_policy_does_not_compile(cache_home: Path) -> None:
    policy = Policy(seccomp=CUSTOM)
    before = sc.stats.compiled
    assert nsbox.run(["/bin/true"], policy).ok
    assert sc.stats.compiled == before + 1
    assert nsbox.run(["/bin/true"], policy).ok
    assert sc.stats.compiled == before + 1
    changed = Policy(seccomp=Seccomp(rules=(SeccompRule("getppid", "errno:EPERM"),)))
    assert nsbox.run(["/bin/true"], changed).ok
    assert sc.stats.compiled == before + 2


@ROOT_DISK
def test_changed_policy_gets_a_new_program(cache_home: Path) -> None:
    before = sc.stats.compiled
    plain = program_for(CUSTOM)
    changed = program_for(Seccomp(rules=(SeccompRule("getppid", "errno:EPERM"),)))
    assert sc.stats.compiled == before + 2
    assert plain != changed
    assert len(list(cache_home.iterdir())) == 2


@ROOT_DISK
def test_a_cache_hit_does_not_import_pyseccomp(cache_home: Path) -> None:
    """A whole launch in a new process with a warm disk cache: no compile, no pyseccomp."""
    program_for(CUSTOM)
    code = (
        "import sys, nsbox; from nsbox.host import seccomp; "
        "from nsbox.policy.policy import Policy, Seccomp, SeccompRule; "
        "custom = Seccomp(rules=(SeccompRule('getppid', 'errno:EACCES'),)); "
        "r = nsbox.run(['/bin/true'], Policy(seccomp=custom)); assert r.ok, r; "
        "print(seccomp.stats.compiled + seccomp.stats.setid_compiled, seccomp.stats.disk_hits, "
        "'pyseccomp' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=dict(os.environ, XDG_CACHE_HOME=str(cache_home.parent
                                                                             .parent)))
    assert out.stdout.split() == ["0", "1", "False"]


@ROOT_DISK
def test_a_corrupt_entry_is_rebuilt(cache_home: Path) -> None:
    good = program_for(CUSTOM)
    entry = cache_home / (sc.cache_key(CUSTOM) + ".json")
    data = json.loads(entry.read_text())
    data["bpf"] = data["bpf"][:-16] + "06000000000000ff"  # a changed last instruction
    entry.write_text(json.dumps(data))
    clear_memory_cache()
    before, errors = sc.stats.compiled, sc.stats.disk_errors
    assert program_for(CUSTOM) == good
    assert (sc.stats.compiled, sc.stats.disk_errors) == (before + 1, errors + 1)
    assert json.loads(entry.read_text())["bpf"] == good.hex()  # rewritten whole
    entry.write_bytes(b"\x00garbage")
    clear_memory_cache()
    assert program_for(CUSTOM) == good
    assert sc.stats.compiled == before + 2


@ROOT_DISK
def test_an_unwritable_cache_is_only_a_miss(cache_home: Path) -> None:
    cache_home.parent.mkdir(parents=True)
    cache_home.write_text("a file where the directory should be")
    before = sc.stats.compiled
    assert program_for(CUSTOM)
    clear_memory_cache()
    assert program_for(CUSTOM)
    assert sc.stats.compiled == before + 2


def test_a_cache_the_sandbox_can_write_is_not_used(cache_home: Path) -> None:
    """With the cache inside a writable bind, the sandbox could plant a weaker program."""
    program = sc.load(CUSTOM, untrusted_dirs=[str(cache_home.parent.parent)])
    assert program.bpf
    assert not cache_home.exists()


@ROOT_DISK
def test_a_workspace_that_holds_the_cache_keeps_it_unused(cache_home: Path) -> None:
    workspace = cache_home.parent.parent  # $XDG_CACHE_HOME itself
    if os.geteuid() == 0:  # a user's directory: as root, a root-owned one is refused
        os.chown(workspace, 1234, 1234)
    policy = Policy(workspace=str(workspace), seccomp=CUSTOM)
    result = nsbox.run(["/bin/true"], policy)
    assert result.ok, result
    assert not cache_home.exists()
    clear_memory_cache()
    assert nsbox.run(["/bin/true"], Policy(seccomp=CUSTOM)).ok  # no writable bind over it
    assert sorted(p.name for p in cache_home.iterdir()) == [sc.cache_key(CUSTOM) + ".json"]


@ROOT_DISK
def test_an_entry_from_another_directory_owner_is_not_trusted(cache_home: Path) -> None:
    program_for(CUSTOM)
    cache_home.chmod(0o777)  # writable by others: entries could have been swapped
    clear_memory_cache()
    before = sc.stats.compiled
    program_for(CUSTOM)
    assert sc.stats.compiled == before + 1


# --- learning mode ----------------------------------------------------------------------------


def test_learning_mode_reports_only_what_was_denied(sandbox: Runner, probe_dir: Path) -> None:
    outcome = run_probe(sandbox, probe_dir, f"getpid:{nr('getpid')}", f"keyctl:{nr('keyctl')}:0",
                        f"add_key:{nr('add_key')}:0", f"keyctl:{nr('keyctl')}:1",
                        seccomp=Seccomp(log_denied=True))
    got = answers(outcome)
    assert got["keyctl"] == (-1, errno.EPERM)
    assert got["add_key"] == (-1, errno.EPERM)
    assert {"keyctl", "add_key"} <= set(outcome.result.extra["seccomp_denied"])
    assert "getpid" not in outcome.result.extra["seccomp_denied"]


def test_learning_mode_answers_enosys_so_threads_fall_back(sandbox: Runner) -> None:
    """clone3 is denied with ENOSYS through the helper's answer; glibc then uses clone."""
    code = ("import threading; out = []; t = threading.Thread(target=out.append, args=(7,)); "
            "t.start(); t.join(); print(out[0] * 6)")
    outcome = launch(sandbox, [PYTHON, "-c", code], seccomp=Seccomp(log_denied=True))
    assert outcome.result.exit_code == 0, outcome
    assert outcome.stdout.strip() == "42"
    assert "clone3" in outcome.result.extra["seccomp_denied"]


def test_learning_mode_survives_many_short_runs() -> None:
    """The listener hangs up in the same instant the sandbox's init exits; the helper must not
    serve a listener its reap already closed (it did once, and died)."""
    policy = Policy(seccomp=Seccomp(log_denied=True))
    results = [nsbox.run(["/bin/true"], policy) for _ in range(40)]
    assert [r.status.value for r in results] == ["OK"] * 40
    assert all(r.extra["seccomp_denied"] == [] for r in results)


def test_without_learning_mode_nothing_is_reported(sandbox: Runner, probe_dir: Path) -> None:
    outcome = run_probe(sandbox, probe_dir, f"keyctl:{nr('keyctl')}:0")
    assert answers(outcome)["keyctl"] == (-1, errno.EPERM)
    assert "seccomp_denied" not in outcome.result.extra


# --- real workloads under the default profile -------------------------------------------------


def test_python_numpy_threads_and_multiprocessing(sandbox: Runner) -> None:
    has_numpy = subprocess.run([PYTHON, "-c", "import numpy"]).returncode == 0
    require(has_numpy, "python3-numpy (Debian) is not installed")
    code = (
        "import numpy, threading, multiprocessing as mp\n"
        "def sq(x): return x * x\n"
        "out = []\n"
        "ts = [threading.Thread(target=lambda i=i: out.append(i)) for i in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "with mp.Pool(2) as pool: s = sum(pool.map(sq, range(100)))\n"
        "a = numpy.arange(10000, dtype=numpy.float64)\n"
        "print(int(a.sum()), round(numpy.linalg.det(numpy.eye(3) * 2)), sorted(out) == "
        "list(range(8)), s)\n"
    )
    outcome = launch(sandbox, [PYTHON, "-c", code])
    assert outcome.result.exit_code == 0, outcome
    assert outcome.stdout.split() == ["49995000", "8", "True", "328350"]


def _tiny_wheel(directory: Path) -> Path:
    """A wheel built by hand: a zip with the module and its dist-info (no network, no backend)."""
    wheel = directory / "nsboxtiny-1.0-py3-none-any.whl"
    files = {
        "nsboxtiny.py": "ANSWER = 42\n",
        "nsboxtiny-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: nsboxtiny\n"
                                            "Version: 1.0\n",
        "nsboxtiny-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
                                         "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    import base64
    import hashlib

    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append("nsboxtiny-1.0.dist-info/RECORD,,")
    files["nsboxtiny-1.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    directory.chmod(0o755)
    wheel.chmod(0o644)
    return wheel


def test_pip_installs_a_local_wheel(sandbox: Runner, unprivileged_tmp: Path) -> None:
    has_pip = subprocess.run([PYTHON, "-m", "pip", "--version"],
                             capture_output=True).returncode == 0
    require(has_pip, "pip for /usr/bin/python3 (Debian python3-pip) is not installed")
    wheels = unprivileged_tmp / "wheels"
    wheels.mkdir()
    wheel = _tiny_wheel(wheels)
    script = (
        "set -e; export HOME=/tmp PIP_DISABLE_PIP_VERSION_CHECK=1; "
        f"/usr/bin/python3 -m pip install --no-index --no-deps --target /tmp/site "
        f"/wheels/{wheel.name} >/tmp/pip.log 2>&1 || {{ cat /tmp/pip.log; exit 1; }}; "
        "PYTHONPATH=/tmp/site /usr/bin/python3 -c 'import nsboxtiny; print(nsboxtiny.ANSWER)'"
    )
    outcome = launch(sandbox, ["/bin/sh", "-c", script], binds=((str(wheels), "/wheels"),))
    assert outcome.result.exit_code == 0, outcome
    assert outcome.stdout.strip() == "42"


def test_shell_pipelines_and_coreutils(sandbox: Runner) -> None:
    script = (
        "set -e; cd /tmp; seq 1 1000 | sort -rn | head -3 | tr '\\n' ' '; echo; "
        "mkdir d && echo hello > d/a && cp d/a d/b && mv d/b d/c && ln -s c d/l; "
        "cat d/l | sha256sum | cut -c1-16; ls d | wc -l; stat -c %s d/a; "
        "date +%Y >/dev/null; id -u >/dev/null; tar cf x.tar d && tar tf x.tar | sort | head -1"
    )
    outcome = launch(sandbox, ["/bin/bash", "-c", script])
    assert outcome.result.exit_code == 0, outcome
    assert outcome.stdout.split("\n")[:5] == [
        "1000 999 998 ", "5891b5b522d5df08", "3", "6", "d/",
    ]


def test_gcc_compiles_and_runs_a_c_program(sandbox: Runner) -> None:
    require(shutil.which("gcc") is not None, "gcc is not installed")
    script = (
        "set -e; cd /tmp; printf '#include <stdio.h>\\n#include <pthread.h>\\n"
        "static void *f(void *a) { return a; }\\n"
        "int main(void) { pthread_t t; void *r; pthread_create(&t, 0, f, (void *)7); "
        "pthread_join(t, &r); printf(\"%%ld\\\\n\", (long)r * 6); return 0; }\\n' > m.c; "
        "gcc -O1 -pthread -o m m.c; ./m"
    )
    outcome = launch(sandbox, ["/bin/sh", "-c", script])
    assert outcome.result.exit_code == 0, outcome
    assert outcome.stdout.strip() == "42"


def test_git_init_and_commit(sandbox: Runner) -> None:
    require(shutil.which("git") is not None, "git is not installed")
    script = (
        "set -e; export HOME=/tmp; cd /tmp; git init -q r; cd r; echo a > f; git add f; "
        "git -c user.name=n -c user.email=n@example.invalid commit -q -m first; "
        "git log --format=%s; git status --porcelain | wc -l"
    )
    outcome = launch(sandbox, ["/bin/sh", "-c", script])
    assert outcome.result.exit_code == 0, outcome
    assert outcome.stdout.split() == ["first", "0"]


def test_sqlite3(sandbox: Runner) -> None:
    require(shutil.which("sqlite3") is not None, "sqlite3 is not installed")
    sql = "create table t(x); insert into t values (40), (2); select sum(x) from t;"
    outcome = launch(sandbox, ["/usr/bin/sqlite3", "/tmp/db", sql])
    assert outcome.result.exit_code == 0, outcome
    assert outcome.stdout.strip() == "42"


def test_cli_seccomp_log_prints_what_was_denied(probe_dir: Path) -> None:
    argv = [sys.executable, "-m", "nsbox", "run", "--seccomp-log", "--ro-bind",
            f"{probe_dir}:/probe", "--", "/probe/probe", f"keyctl:{nr('keyctl')}:0",
            f"getpid:{nr('getpid')}"]
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"keyctl -1 {errno.EPERM}"
    assert "nsbox: seccomp denied: keyctl\n" in proc.stderr
    as_json = subprocess.run(argv[:4] + ["--json"] + argv[4:], capture_output=True, text=True,
                             timeout=60)
    assert json.loads(as_json.stdout)["extra"]["seccomp_denied"] == ["keyctl"]


PLANT = r'''
import json, hashlib, os, struct, sys
import nsbox
from nsbox.host import seccomp as sc
from nsbox.policy.policy import Bind, Policy, Seccomp, SeccompRule

home = sys.argv[1]
os.environ["XDG_CACHE_HOME"] = home
custom = Seccomp(rules=(SeccompRule("getppid", "errno:EACCES"),))
# One instruction: BPF_RET|BPF_K SECCOMP_RET_ALLOW, under the keys of the next run's programs.
allow = struct.pack("<HBBI", 0x06, 0, 0, 0x7FFF0000).hex()
entries = [{"format": sc._FORMAT, "key": key,
            "sha256": hashlib.sha256(bytes.fromhex(allow)).hexdigest(), "bpf": allow,
            "listener": False, "notify": None, "source": {}}
           for key in (sc.cache_key(Seccomp()), sc.cache_key(custom), sc.setid_key())]
# Overwrite the entries if it can, else move the directory aside and make a new one.
writer = ("import json, os, sys\n"
          "d = '/cache/nsbox/seccomp'\n"
          "os.makedirs(d, mode=0o700, exist_ok=True)\n"
          "for e in json.loads(sys.argv[1]):\n"
          "    try:\n"
          "        open(d + '/' + e['key'] + '.json', 'w').write(json.dumps(e))\n"
          "    except PermissionError:\n"
          "        print('refused', flush=True)\n"
          "        os.rename('/cache/nsbox', '/cache/nsbox.moved')\n"
          "        os.makedirs(d, mode=0o700)\n"
          "        open(d + '/' + e['key'] + '.json', 'w').write(json.dumps(e))\n")
policy = Policy(mounts=Policy().mounts + (Bind(home, "/cache", writable=True),))
planted = nsbox.run(["python3", "-c", writer, json.dumps(entries)], policy, timeout=30)
json.dump({"planted": planted.exit_code, "out": planted.stdout.decode(),
           "err": planted.stderr.decode()[-500:]}, sys.stdout)
'''

# A later run: the default policy and the custom one, unshare(CLONE_NEWUSER) and getppid.
LATER = r'''
import sys
import nsbox
from nsbox.host import seccomp as sc
from nsbox.policy.policy import Policy, Seccomp, SeccompRule

probe = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
         "print(libc.unshare(0x10000000), ctypes.get_errno(), end=' '); "
         "print(libc.getppid())")
custom = Seccomp(rules=(SeccompRule("getppid", "errno:EACCES"),))
for policy in (Policy(), Policy(seccomp=custom)):
    r = nsbox.run(["python3", "-c", probe], policy, timeout=30)
    print(r.stdout.decode().strip())
'''


def _plant_and_run_later(public_tree: Path, home: Path, user: list[str]) -> list[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(public_tree), "XDG_CACHE_HOME": str(home)}
    prefix = f"import sys; sys.path.insert(0, {str(public_tree)!r})\n"
    plant = subprocess.run([*user, "/usr/bin/python3", "-I", "-c", prefix + PLANT, str(home)],
                           capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert plant.returncode == 0, plant.stderr
    planted = json.loads(plant.stdout)
    assert planted["planted"] == 0, planted
    later = subprocess.run([*user, "/usr/bin/python3", "-I", "-c", prefix + LATER],
                           capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert later.returncode == 0, later.stderr
    return [planted["out"], *later.stdout.splitlines()]


def _denied_as_the_rules_say(lines: list[str]) -> None:
    default, custom = (line.split() for line in lines)
    assert default[:2] == ["-1", str(errno.EPERM)]  # built-in rule: no new user namespace
    assert int(default[2]) > 0  # getppid allowed by the default policy
    # glibc's getppid cannot fail, so it returns the filter's answer as it is: -EACCES.
    assert custom[:3] == ["-1", str(errno.EPERM), str(-errno.EACCES)]


def test_a_sandbox_cannot_plant_a_program_for_a_later_run(public_tree: Path,
                                                          unprivileged_tmp: Path) -> None:
    """A caller that is not root: a sandbox with a writable bind over the cache writes an
    allow-all program under the keys of the default and a custom policy; the next runs must
    still deny unshare (CLONE_NEWUSER) with EPERM, as the built-in rules say, and getppid as
    the custom policy says."""
    home = unprivileged_tmp / "cache"
    home.mkdir()
    user: list[str] = []  # a caller that is not root plants as itself
    if os.geteuid() == 0:
        os.chown(home, 65534, 65534)
        user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    out, *later = _plant_and_run_later(public_tree, home, user)
    assert out == ""  # the files were the caller's own: written without a refusal
    planted = sorted(p.name for p in (home / "nsbox" / "seccomp").iterdir())
    assert planted == sorted([sc.cache_key(Seccomp()) + ".json", sc.cache_key(CUSTOM) + ".json",
                              sc.setid_key() + ".json"])
    _denied_as_the_rules_say(later)


@ROOT_DISK
def test_a_sandbox_of_root_cannot_replace_roots_cached_programs(public_tree: Path,
                                                                unprivileged_tmp: Path) -> None:
    """Root's disk cache, bound writable into a sandbox (which runs as host uid 65534): the
    sandbox cannot write root's entries (a 0700 directory of root's), and the directory it makes
    in their place is not root's, so the next run does not read it."""
    home = unprivileged_tmp / "cache"
    home.mkdir()
    os.chown(home, 65534, 65534)  # the parent is the sandbox's to write: the worst case
    env = dict(os.environ, XDG_CACHE_HOME=str(home), PYTHONPATH=str(public_tree))
    warm = subprocess.run(["/usr/bin/python3", "-I", "-c",
                           f"import sys; sys.path.insert(0, {str(public_tree)!r})\n" + LATER],
                          capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert warm.returncode == 0, warm.stderr
    entry = home / "nsbox" / "seccomp" / (sc.cache_key(CUSTOM) + ".json")
    genuine = entry.read_bytes()
    assert entry.stat().st_uid == 0
    out, *later = _plant_and_run_later(public_tree, home, [])
    assert out.startswith("refused")
    assert (home / "nsbox.moved" / "seccomp" / entry.name).read_bytes() == genuine
    assert (home / "nsbox" / "seccomp").stat().st_uid == 65534  # the sandbox's, not trusted
    _denied_as_the_rules_say(later)


def test_a_rule_libseccomp_cannot_take_is_a_policy_error() -> None:
    """Seven comparisons (pyseccomp raises ValueError, not OSError) name the rule, never a
    traceback: the profile's check refuses them at load, a Policy made in code here."""
    import dataclasses

    from nsbox.errors import PolicyError
    from nsbox.host.seccomp_compile import compile_program
    from nsbox.policy.policy import Policy, SeccompArg, SeccompRule

    policy = Policy()
    rule = SeccompRule("ioctl", "kill", tuple(SeccompArg(0, "eq", i) for i in range(7)))
    seccomp = dataclasses.replace(policy.seccomp, rules=(rule,))
    with pytest.raises(PolicyError, match="libseccomp refuses the rule for 'ioctl'"):
        compile_program(seccomp)
