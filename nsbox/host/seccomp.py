"""The seccomp filter of a launch: the default deny policy plus a profile's rules, as a BPF
program, loaded as bytes wherever it can be.

Where a program comes from, in order:

1. memory: each program is compiled or read once per process;
2. the package: the programs of the shipped profiles (nsbox/profiles/*.toml, with and without
   learning mode) and the set-id filter, compiled when nsbox is built
   (nsbox/profiles/programs.py, run by setup.py) into ``seccomp_programs/`` beside this file.
   They are read by every caller, root or not: the package directory is code, and rule
   ``nsbox-code`` keeps every sandbox from writing it (nsbox/host/codepaths.py). A build
   without libseccomp, or the one-file nsbox.pyz, has none: its programs are compiled at run
   time, never replaced by a weaker filter;
3. for a root caller only (disk_cache_allowed), a disk cache under
   ``$XDG_CACHE_HOME/nsbox/seccomp`` (or ``~/.cache/nsbox/seccomp``): root's own files in a
   directory only root may write, which no sandbox can write since none ever runs as host uid
   0 (nsbox/policy/identity.py); checked before use (_read_entry);
4. compiled by nsbox/host/seccomp_compile.py (from the rules of nsbox/host/seccomp_rules.py),
   which imports pyseccomp, whose import runs ldconfig.

Every program is keyed by the seccomp policy, the digest of the built-in rules, the prefix
for calls newer than the rules (seccomp_compile.past_table_prefix), the architecture and the
nsbox version (cache_key): a changed rule, another architecture or another release never finds
an old program. libseccomp is not in the key: it only compiles, the BPF does not use it at run
time. The child applies the program as the last step before execve (nsbox/sandbox/child.py).
docs/seccomp.md explains every rule.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nsbox.host.seccomp_compile import (
    MAX_INSNS,
    PAST_TABLE_KEY,
    POLICY_PAST_TABLE,
    Program,
    compile_program,
    compile_setid,
)
from nsbox.host.seccomp_rules import BUILTIN_DIGEST, SETID_DIGEST, sha256_hex
from nsbox.policy.policy import Seccomp, SeccompArg, SeccompRule

_FORMAT = 2  # of the entries; bump when their layout or the key's inputs change
# The programs built with the package (nsbox/profiles/programs.py writes them).
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seccomp_programs")


@dataclass
class Stats:
    """What the cache did in this process; tests read it to see a hit."""

    compiled: int = 0  # policy programs
    setid_compiled: int = 0  # the set-id filter
    memory_hits: int = 0
    shipped_hits: int = 0  # read from the package's programs
    disk_hits: int = 0
    disk_errors: int = 0  # entries that could not be written or were corrupt


stats = Stats()
_memory: dict[str, Program] = {}
_MEMORY_MAX = 64


def load(seccomp: Seccomp, *, untrusted_dirs: Iterable[str] = ()) -> Program:
    """The compiled program for ``seccomp``, from the cache when possible.

    ``untrusted_dirs`` are host directories the sandbox can write (its workspace, writable
    binds): a disk cache inside one of them is neither read nor written, since the sandbox
    could plant a weaker program there for the next run.
    """
    key = cache_key(seccomp)

    def compile_() -> Program:
        stats.compiled += 1
        return compile_program(seccomp, key)

    return cached(key, untrusted_dirs, compile_)


def load_setid(*, untrusted_dirs: Iterable[str] = ()) -> Program:
    """The set-id filter (SETID_RULES), compiled once and cached like the policy's program."""
    key = setid_key()

    def compile_() -> Program:
        stats.setid_compiled += 1
        return compile_setid(key)

    return cached(key, untrusted_dirs, compile_)


def cached(key: str, untrusted_dirs: Iterable[str], compile_: Callable[[], Program]) -> Program:
    """The program of ``key``: from memory, else from the package, else from the disk cache
    (unless it lies in a directory the sandbox can write), else compiled and written to it."""
    program = _memory.get(key)
    if program is not None:
        stats.memory_hits += 1
        return program
    program = read_shipped(key)
    if program is not None:
        stats.shipped_hits += 1
    else:
        program = _from_disk_or_compiled(key, untrusted_dirs, compile_)
    if len(_memory) >= _MEMORY_MAX:  # an embedder with ever new policies: forget the oldest
        del _memory[next(iter(_memory))]
    _memory[key] = program
    return program


def _from_disk_or_compiled(key: str, untrusted_dirs: Iterable[str],
                           compile_: Callable[[], Program]) -> Program:
    directory = cache_dir() if disk_cache_allowed() else None
    if directory is not None and _inside_any(directory, untrusted_dirs):
        directory = None
    program = _read_entry(directory, key) if directory else None
    if program is not None:
        stats.disk_hits += 1
        return program
    program = compile_()
    if directory:
        _write_entry(directory, program)
    return program


def read_shipped(key: str) -> Program | None:
    """The program of ``key`` built with the package, or None (none built, another key).

    No owner check: these files are as trusted as the code beside them that loads them (a
    sandbox never writes either, rule nsbox-code), and a corrupt one is only a miss."""
    try:
        fd = os.open(os.path.join(SHIPPED_DIR, key + ".json"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # not built here; inside a zip (nsbox.pyz) there is no such directory
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            return _parse_entry(f.read(4 * 1024 * 1024), key)
    except OSError:
        return None


# --- the key, without pyseccomp ----------------------------------------------------------------


_libseccomp_version: str | None = None


def libseccomp_version() -> str:
    """The system libseccomp's version (for `nsbox doctor`), read with dlopen: ldconfig is what
    makes pyseccomp's import slow; the dynamic linker's cache finds the library directly."""
    global _libseccomp_version
    if _libseccomp_version is None:
        import ctypes  # not at import: no launch needs it

        class _Version(ctypes.Structure):
            _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint),
                        ("micro", ctypes.c_uint)]

        try:
            lib = ctypes.CDLL("libseccomp.so.2")
            lib.seccomp_version.restype = ctypes.POINTER(_Version)
            v = lib.seccomp_version().contents
            _libseccomp_version = f"{v.major}.{v.minor}.{v.micro}"
        except (OSError, AttributeError):
            _libseccomp_version = "unknown"
    return _libseccomp_version


def architecture() -> str:
    """The machine and the process's word size: the programs hold the native architecture
    only (a 32-bit interpreter on a 64-bit kernel is another one), so it is in every key."""
    return f"{os.uname().machine}-{64 if sys.maxsize > 2**32 else 32}"


# The policy program's prefix for calls newer than the rules (seccomp_compile.past_table_prefix):
# its shape and the calls it lets through, so that a program from before either is never used.
_PAST_TABLE = repr((PAST_TABLE_KEY, sorted(POLICY_PAST_TABLE.items())))


def cache_key(seccomp: Seccomp) -> str:
    return program_key({"seccomp": plain_source(seccomp), "builtin": BUILTIN_DIGEST,
                        "past_table": _PAST_TABLE})


def program_key(inputs: dict[str, Any]) -> str:
    """The cache key of a program made from ``inputs`` (also the Landlock mode's filter,
    nsbox/host/landlock_filter.py): with the entries' format, the architecture and the version."""
    from nsbox.version import VERSION

    blob = json.dumps(
        {**inputs, "format": _FORMAT, "arch": architecture(), "nsbox": VERSION},
        sort_keys=True,
        default=repr,  # a malformed value still gets a key; compiling names the problem
    )
    return sha256_hex(blob.encode())


# The fields plain_source writes out; a class with other fields goes through dataclasses.asdict.
_SHAPES = {Seccomp: ("enabled", "default_action", "rules", "log_denied"),
           SeccompRule: ("syscall", "action", "args"),
           SeccompArg: ("index", "op", "value", "mask")}
_PLAIN_FITS = all(tuple(f.name for f in dataclasses.fields(cls)) == names
                  for cls, names in _SHAPES.items())


def plain_source(seccomp: Seccomp) -> Any:
    """``dataclasses.asdict(seccomp)`` for a well-formed policy, without asdict's copying of
    every value (two thirds of the key's cost); anything else goes through asdict itself."""
    rules = seccomp.rules
    if not _PLAIN_FITS or type(rules) is not tuple or not all(
            type(rule) is SeccompRule and type(rule.args) is tuple
            and all(type(arg) is SeccompArg for arg in rule.args) for rule in rules):
        return dataclasses.asdict(seccomp)
    return {
        "enabled": seccomp.enabled, "default_action": seccomp.default_action,
        "log_denied": seccomp.log_denied,
        "rules": [{"syscall": rule.syscall, "action": rule.action,
                   "args": [{"index": arg.index, "op": arg.op, "value": arg.value,
                             "mask": arg.mask} for arg in rule.args]} for rule in rules],
    }


_setid_key_memo = ""


def setid_key() -> str:
    """Everything in it is fixed for the life of the process: worked out once."""
    global _setid_key_memo
    if not _setid_key_memo:
        # "compiler" changes with compile_setid's options (a program of the same rules, built
        # anew)
        _setid_key_memo = program_key({"setid": SETID_DIGEST, "compiler": 2})
    return _setid_key_memo


def entry(program: Program, source: dict[str, Any]) -> dict[str, Any]:
    """The stored form of ``program``; ``source`` says what it was compiled from (a shipped
    program is checked against the compiler with it, tests/test_seccomp_shipped.py)."""
    return {
        "format": _FORMAT,
        "key": program.key,
        "sha256": sha256_hex(program.bpf),
        "bpf": program.bpf.hex(),
        "listener": program.listener,
        "notify": program.notify,
        "source": source,
    }


def _parse_entry(data: bytes, key: str) -> Program | None:
    """The program in a stored entry, if it is whole and is the program of ``key``."""
    try:
        stored = json.loads(data)
        bpf = bytes.fromhex(stored["bpf"])
        if (
            stored.get("format") != _FORMAT
            or stored.get("key") != key
            or sha256_hex(bpf) != stored.get("sha256")
            or not bpf
            or len(bpf) % 8
            or len(bpf) // 8 > MAX_INSNS
        ):
            raise ValueError("entry does not match")
        notify = stored.get("notify")
        if notify is not None and not isinstance(notify, dict):
            raise ValueError("notify is not a mapping")
        return Program(bpf, key, bool(stored.get("listener")), notify)
    except (ValueError, KeyError, TypeError, AttributeError):
        stats.disk_errors += 1  # a corrupt entry is a miss; a disk cache's is replaced
        return None


# --- the disk cache ---------------------------------------------------------------------------


def cache_dir() -> str | None:
    """``$XDG_CACHE_HOME/nsbox/seccomp`` (an absolute XDG_CACHE_HOME only, as the XDG spec says)
    or ``~/.cache/nsbox/seccomp``; None when there is no home to put it in."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "nsbox", "seccomp")


def disk_cache_allowed() -> bool:
    """Only a root caller keeps programs on disk.

    What keeps every sandbox from writing root's cache: a root caller's sandboxes never run as
    host uid 0 (nsbox/policy/identity.py: the sandbox's user never maps to an id that is 0 in the
    launcher's namespace or its parent), and an entry is read only from a directory owned by
    root that nobody else may write, and only when the entry itself is root's file
    (_trusted_dir, _read_entry). A sandbox given a writable bind over the cache's parent can
    make files there, but only as its own uid, which these checks refuse.

    A caller that is not root has its sandboxes run as its own uid: a sandbox given a writable
    bind over the cache (``~/.cache`` for pip's sake, in one run) could write an entry that
    passes every ownership check, since it is the caller's own file: an allow-all program under
    the key of the next run's policy. The untrusted_dirs check sees only the current run's
    binds, so it cannot stop that. Such callers get the shipped programs from the package
    (read_shipped) and compile other policies once per process."""
    return os.geteuid() == 0


def _inside_any(path: str, dirs: Iterable[str]) -> bool:
    real = os.path.realpath(path)
    for d in dirs:
        top = os.path.realpath(d)
        if real == top or real.startswith(top.rstrip("/") + "/"):
            return True
    return False


def _trusted_dir(directory: str) -> bool:
    """Ours and writable by us alone: another user must not be able to swap entries."""
    try:
        st = os.stat(directory, follow_symlinks=False)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022 and os.path.isdir(directory)


def _read_entry(directory: str, key: str) -> Program | None:
    path = os.path.join(directory, key + ".json")
    if not _trusted_dir(directory):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if os.fstat(f.fileno()).st_uid != os.geteuid():
                return None
            data = f.read(4 * 1024 * 1024)
    except OSError:
        stats.disk_errors += 1
        return None
    return _parse_entry(data, key)


def write_entry(directory: str, program: Program, source: dict[str, Any]) -> None:
    """Atomically: a temporary file renamed over the entry, readable by everyone (the
    programs are no secret; the directory decides who may write)."""
    import tempfile  # only when writing: launches that hit the cache do not need it

    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry(program, source), f, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(directory, program.key + ".json"))
    except BaseException:
        os.unlink(tmp)
        raise


def _write_entry(directory: str, program: Program) -> None:
    """Into the disk cache; a failure is only a miss."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not _trusted_dir(directory):
            raise OSError(errno.EPERM, f"{directory}: not owned by us or writable by others")
        write_entry(directory, program, {})
    except OSError:
        stats.disk_errors += 1
