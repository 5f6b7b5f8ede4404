"""Calls newer than the filters' rules: a number past seccomp_compile.TABLE_END, which the
system's libseccomp (2.5.4) cannot name, so that no rule could refuse it and the policy's
allow-by-default filter let every one reach the kernel (file_setattr, open_tree_attr, the lsm_*
calls). The namespace mode's filter now answers them ENOSYS, as the Landlock mode's does
(tests/test_landlock_filter.py, whose probe this is), unless they are allowed on purpose
(seccomp_compile.POLICY_PAST_TABLE) or a rule names them; x32 and i386 are still killed.

The real sandboxes run as this process's user and as an unprivileged uid (conftest's
``sandbox``), with whatever launch core NSBOX_NATIVE and NSBOX_ENGINE choose; the programs
themselves are also run through a small classic-BPF interpreter (run_filter).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import struct
from typing import Any

import pytest
from conftest import PYTHON, Runner, require
from test_landlock import PROBE_HEAD
from test_landlock_filter import NEWER_CALLS, PAST_THE_TABLE

from nsbox.host import landlock_filter, seccomp_compile
from nsbox.host import seccomp as sc
from nsbox.policy.policy import Seccomp, SeccompRule

X86_64 = os.uname().machine == "x86_64"
_release = re.match(r"(\d+)\.(\d+)", os.uname().release)
KERNEL = (int(_release.group(1)), int(_release.group(2))) if _release else (0, 0)

# The Landlock test's probe (its held() shows the outcome while the sandbox still runs; here the
# outcome is printed at the end), then the calls the namespace mode allows past the table, on
# the same workspace file "mine".
NAMESPACE_CALLS = r'''
flag = ctypes.create_string_buffer(b"1")
set_args = struct.pack("<QII", ctypes.addressof(flag), 1, 0)  # struct xattr_args
attempt("setxattrat", lambda: call(463, -100, b"mine", 0, b"user.nsbox", set_args,
                                   ctypes.c_size_t(len(set_args))))
attempt("removexattrat", lambda: call(466, -100, b"mine", 0, b"user.nsbox"))
LSMT_ROOT = (1 << 64) - 1
ids = (ctypes.c_uint64 * 64)()
attempt("listmount", lambda: call(458, struct.pack("<IIQQ", 24, 0, LSMT_ROOT, 0), ids, 64,
                                  0) > 0)
page = ctypes.create_string_buffer(4096)
attempt("statmount", lambda: call(457, struct.pack("<IIQQ", 24, 0, ids[0], 1), page, 4096, 0))
print(json.dumps(out), flush=True)
'''
PROBE = PROBE_HEAD + "def held():\n    pass\n" + NEWER_CALLS + NAMESPACE_CALLS
ALLOWED = {"setxattrat": ["done", "0"], "removexattrat": ["done", "0"],
           "listmount": ["done", "True"], "statmount": ["done", "0"]}


def run_newer_calls(runner: Runner, seccomp: Seccomp) -> tuple[dict[str, list[str]], Any]:
    result = runner.run([PYTHON, "-c", PROBE, "{}"], seccomp=dataclasses.asdict(seccomp),
                        limit_changes={"wall_time": 60.0})
    text = result.stdout.decode(errors="replace")
    assert result.exit_code == 0 and text, (result, result.stderr[-2000:])
    return json.loads(text.splitlines()[-1]), result


def check_newer_calls(outcome: dict[str, list[str]]) -> None:
    for name in PAST_THE_TABLE:  # file_getattr, file_setattr, lsm_*, open_tree_attr, 471
        assert outcome[name] == ["refused", "ENOSYS"], (name, outcome)
    assert outcome["mseal"] == ["done", "0"], outcome
    assert outcome["getxattrat"] == ["refused", "ENODATA"], outcome
    assert outcome["listxattrat"] == ["done", "0"], outcome
    assert outcome["getpid"] == ["done", "True"], outcome
    for name in ("x32 getpid", "x32 file_setattr", "i386 getpid", "i386 file_setattr"):
        assert outcome[name] == ["killed", "SIGSYS"], (name, outcome)
    if KERNEL >= (6, 17):  # the kernel has every call allowed past the table
        for name, answer in ALLOWED.items():
            assert outcome[name] == answer, (name, outcome)


@pytest.mark.skipif(not X86_64, reason="x86_64's numbers, x32 and int 0x80")
def test_a_call_newer_than_the_policy_is_not_implemented(sandbox: Runner) -> None:
    """In the namespace mode's sandbox with the default policy: ENOSYS past the table (without
    the prefix file_setattr changed the file's attributes, lsm_list_modules answered), the
    calls allowed on purpose work, getpid works, x32 and int 0x80 are killed."""
    outcome, _ = run_newer_calls(sandbox, Seccomp())
    check_newer_calls(outcome)


@pytest.mark.skipif(not X86_64, reason="x86_64's numbers, x32 and int 0x80")
def test_learning_mode_sees_the_newer_calls_it_refuses(sandbox: Runner) -> None:
    """Learning mode answers them through the listener (ENOSYS all the same) and names them."""
    outcome, result = run_newer_calls(sandbox, Seccomp(log_denied=True))
    check_newer_calls(outcome)
    denied = set(result.extra["seccomp_denied"])
    assert {"file_getattr", "file_setattr", "lsm_list_modules", "lsm_get_self_attr",
            "open_tree_attr", "syscall_471"} <= denied, denied
    assert not denied & {"mseal", "getxattrat", "listxattrat", *ALLOWED, "getpid"}, denied


# --- the programs, run through a classic-BPF interpreter ---------------------------------------

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}.get(os.uname().machine)
_AUDIT_ARCH_I386 = 0x40000003
_X32 = 0x40000000


def run_filter(bpf: bytes, nr: int, arch: int | None = None, args: tuple[int, ...] = ()) -> int:
    """What the filter answers for seccomp_data {nr, arch, args}: the opcodes libseccomp and
    past_table_prefix emit (ld abs, and k, ja, jeq/jgt/jge/jset k, ret k)."""
    data = struct.pack("=IIQ6Q", nr & 0xFFFFFFFF, _AUDIT_ARCH if arch is None else arch, 0,
                       *(tuple(args) + (0,) * 6)[:6])
    insns = [struct.unpack("=HBBI", bpf[i:i + 8]) for i in range(0, len(bpf), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x54:
            acc &= k
        elif code == 0x05:
            pc += k
        elif code in (0x15, 0x25, 0x35, 0x45):
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"opcode {code:#x} at {pc - 1}")


ENOSYS = seccomp_compile.RET_ERRNO | errno.ENOSYS
KILL, ALLOW = seccomp_compile.RET_KILL_PROCESS, seccomp_compile.RET_ALLOW
REFUSED = (459, 460, 461, 467, 468, 469, 470, 471, 600, 1023, 1024, 0xEFFFF)


@pytest.fixture(autouse=True, scope="module")
def native() -> None:
    require(_AUDIT_ARCH is not None, "no AUDIT_ARCH value known for this machine")


def test_the_policys_program_refuses_what_is_past_the_table() -> None:
    bpf = seccomp_compile.compile_program(Seccomp()).bpf
    assert all(run_filter(bpf, nr) == ENOSYS for nr in REFUSED)
    for nr in seccomp_compile.POLICY_PAST_TABLE.values():
        assert run_filter(bpf, nr) == ALLOW, nr
    assert run_filter(bpf, seccomp_compile.TABLE_END) == ALLOW  # futex_requeue
    getpid = seccomp_compile.import_pyseccomp().resolve_syscall(0, "getpid")
    assert run_filter(bpf, getpid) == ALLOW  # on to the program, which allows it
    assert run_filter(bpf, 0xFFFFFFFF) == ALLOW  # a tracer's skipped call: as before
    assert run_filter(bpf, 0xF0005) == ALLOW  # ARM's set_tls's number: not the shared table's
    for nr in (getpid, 469, 462):  # other ABIs: killed, as by the program behind
        assert run_filter(bpf, nr, _AUDIT_ARCH_I386) == KILL
        if X86_64:
            assert run_filter(bpf, _X32 | nr) == KILL


def test_learning_mode_refuses_them_through_the_listener() -> None:
    program = seccomp_compile.compile_program(Seccomp(log_denied=True))
    assert program.listener and program.notify is not None
    assert all(run_filter(program.bpf, nr) == seccomp_compile.RET_USER_NOTIF for nr in REFUSED)
    assert run_filter(program.bpf, 462) == ALLOW
    assert program.notify["default"] == errno.ENOSYS  # what the helper answers for them
    assert program.notify["names"]["469"] == "file_setattr"


def test_an_allow_list_or_its_learning_mode_has_no_prefix() -> None:
    """With an errno default nothing past the table is allowed anyway; in learning mode the
    listener hears every call no rule allows, and answers the default's errno."""
    allow_list = Seccomp(default_action="errno:EPERM", rules=(SeccompRule("read", "allow"),))
    bpf = seccomp_compile.compile_program(allow_list).bpf
    assert run_filter(bpf, 469) == run_filter(bpf, 462) == seccomp_compile.RET_ERRNO | errno.EPERM
    learning = seccomp_compile.compile_program(dataclasses.replace(allow_list, log_denied=True))
    assert run_filter(learning.bpf, 469) == seccomp_compile.RET_USER_NOTIF
    assert learning.notify is not None and learning.notify["default"] == errno.EPERM


def test_a_rule_naming_a_call_past_the_table_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile's rule names a call by its name alone (profiles/schema.py); a libseccomp newer
    than TABLE_END's knows file_setattr's, as this stand-in does: its rule, not the prefix,
    answers it, whatever it says."""
    pyseccomp = seccomp_compile.import_pyseccomp()
    resolve = pyseccomp.resolve_syscall

    def newer(arch: Any, name: Any) -> Any:
        return 469 if name == "file_setattr" else resolve(arch, name)

    monkeypatch.setattr(pyseccomp, "resolve_syscall", newer)
    for action, answer in (("errno:EACCES", seccomp_compile.RET_ERRNO | errno.EACCES),
                           ("allow", ALLOW)):
        bpf = seccomp_compile.compile_program(
            Seccomp(rules=(SeccompRule("file_setattr", action),))).bpf
        assert run_filter(bpf, 469) == answer, action
        assert run_filter(bpf, 468) == ENOSYS


def test_the_landlock_filter_has_the_same_prefix_and_its_own_set() -> None:
    bpf = landlock_filter.compile_filter("").bpf
    assert all(run_filter(bpf, nr) == ENOSYS for nr in REFUSED)
    for nr in landlock_filter._ALLOWED_PAST_TABLE.values():
        assert run_filter(bpf, nr) == ALLOW
    for nr in (463, 466):  # setxattrat, removexattrat: its rules by number decide
        assert run_filter(bpf, nr) == seccomp_compile.RET_ERRNO | errno.ENOTSUP
    for nr in (457, 458):  # statmount, listmount
        assert run_filter(bpf, nr) == ENOSYS
    if X86_64:
        assert run_filter(bpf, _X32 | 469) == KILL
    assert run_filter(bpf, 469, _AUDIT_ARCH_I386) == KILL


def test_the_keys_change_with_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program from before the prefix, or of another prefix, is never found by a key."""
    policy, landlock = sc.cache_key(Seccomp()), landlock_filter.filter_key()
    monkeypatch.setattr(sc, "_PAST_TABLE", "another set")
    assert sc.cache_key(Seccomp()) != policy
    assert landlock_filter.filter_key() == landlock  # the policy's set is not its program's
    monkeypatch.undo()
    monkeypatch.setattr(seccomp_compile, "PAST_TABLE_KEY", "another prefix")
    assert landlock_filter.filter_key() != landlock
