"""The seccomp filter of a launch: the default deny policy plus a profile's rules, as a cached
BPF program.

The host process compiles the program once (nsbox/host/seccomp_compile.py, from the rules of
nsbox/host/seccomp_rules.py) and caches the bytes, keyed by the seccomp policy, the built-in
rules, the architecture, the libseccomp version and the nsbox version: in memory, and, for a
root caller only (disk_cache_allowed), on disk under ``$XDG_CACHE_HOME/nsbox/seccomp`` (or
``~/.cache/nsbox/seccomp``). A hit only reads
bytes; pyseccomp is imported on a miss alone, because its import runs ldconfig (about 35 ms).
The child applies the program as the last step before execve (nsbox/sandbox/child.py).
docs/seccomp.md explains every rule.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import hashlib
import json
import os
import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nsbox.host.seccomp_compile import MAX_INSNS, Program, compile_program, compile_setid
from nsbox.host.seccomp_rules import BUILTIN_DIGEST, SETID_DIGEST
from nsbox.policy import Seccomp, SeccompArg, SeccompRule

_FORMAT = 1  # of the cache entries; bump when their layout changes


@dataclass
class Stats:
    """What the cache did in this process; tests read it to see a hit."""

    compiled: int = 0  # policy programs
    setid_compiled: int = 0  # the set-id filter
    memory_hits: int = 0
    disk_hits: int = 0
    disk_errors: int = 0  # entries that could not be written or were corrupt


stats = Stats()
_memory: dict[str, Program] = {}
_MEMORY_MAX = 64


def clear_memory_cache() -> None:
    _memory.clear()


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

    return _cached(key, untrusted_dirs, compile_)


def load_setid(*, untrusted_dirs: Iterable[str] = ()) -> Program:
    """The set-id filter (SETID_RULES), compiled once and cached like the policy's program."""
    key = _setid_key()

    def compile_() -> Program:
        stats.setid_compiled += 1
        return compile_setid(key)

    return _cached(key, untrusted_dirs, compile_)


def _cached(key: str, untrusted_dirs: Iterable[str], compile_: Callable[[], Program]) -> Program:
    """The program of ``key``: from memory, else from the disk cache (unless it lies in a
    directory the sandbox can write), else compiled and written to both."""
    program = _memory.get(key)
    if program is not None:
        stats.memory_hits += 1
        return program
    directory = cache_dir() if disk_cache_allowed() else None
    if directory is not None and _inside_any(directory, untrusted_dirs):
        directory = None
    program = _read_entry(directory, key) if directory else None
    if program is not None:
        stats.disk_hits += 1
    else:
        program = compile_()
        if directory:
            _write_entry(directory, program)
    if len(_memory) >= _MEMORY_MAX:  # an embedder with ever new policies: forget the oldest
        del _memory[next(iter(_memory))]
    _memory[key] = program
    return program


def program_for(seccomp: Seccomp) -> bytes:
    """The BPF program (bytes of struct sock_filter) for ``seccomp``, cached."""
    return load(seccomp).bpf


# --- the cache key, without pyseccomp ---------------------------------------------------------


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]


_libseccomp_version: str | None = None


def libseccomp_version() -> str:
    """The system libseccomp's version, read with dlopen (ldconfig is what makes pyseccomp's
    import slow; the dynamic linker's cache finds the library directly)."""
    global _libseccomp_version
    if _libseccomp_version is None:
        try:
            lib = ctypes.CDLL("libseccomp.so.2")
            lib.seccomp_version.restype = ctypes.POINTER(_Version)
            v = lib.seccomp_version().contents
            _libseccomp_version = f"{v.major}.{v.minor}.{v.micro}"
        except (OSError, AttributeError):
            _libseccomp_version = "unknown"
    return _libseccomp_version


def cache_key(seccomp: Seccomp) -> str:
    from nsbox.version import VERSION as __version__

    blob = json.dumps(
        {
            "format": _FORMAT,
            "seccomp": _plain(seccomp),
            "builtin": BUILTIN_DIGEST,
            "arch": platform.machine(),
            "libseccomp": libseccomp_version(),
            "nsbox": __version__,
        },
        sort_keys=True,
        default=repr,  # a malformed value still gets a key; compiling names the problem
    )
    return hashlib.sha256(blob.encode()).hexdigest()


# The fields _plain writes out; a class with other fields goes through dataclasses.asdict.
_SHAPES = {Seccomp: ("enabled", "default_action", "rules", "log_denied"),
           SeccompRule: ("syscall", "action", "args"),
           SeccompArg: ("index", "op", "value", "mask")}
_PLAIN_FITS = all(tuple(f.name for f in dataclasses.fields(cls)) == names
                  for cls, names in _SHAPES.items())


def _plain(seccomp: Seccomp) -> Any:
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


def _setid_key() -> str:
    """Everything in it is fixed for the life of the process: worked out once."""
    global _setid_key_memo
    if not _setid_key_memo:
        from nsbox.version import VERSION as __version__

        # "compiler" changes with compile_setid's options (a program of the same rules, built
        # anew)
        blob = json.dumps({"format": _FORMAT, "setid": SETID_DIGEST, "compiler": 2,
                           "arch": platform.machine(), "libseccomp": libseccomp_version(),
                           "nsbox": __version__}, sort_keys=True)
        _setid_key_memo = hashlib.sha256(blob.encode()).hexdigest()
    return _setid_key_memo


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

    A sandbox runs as its caller's own uid unless the caller is root, whose sandboxes run as
    an unprivileged uid (nsbox/identity.py). Run as the caller, a sandbox given a writable bind
    over the cache (``~/.cache`` for pip's sake, in one run) can write an entry that passes
    every ownership check, since it is the caller's own file: an allow-all program under the
    key of the next run's policy. The untrusted_dirs check sees only the current run's binds,
    so it cannot stop that. Root's entries are root's files, which no sandbox can write."""
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
            entry = json.loads(f.read(4 * 1024 * 1024))
        bpf = bytes.fromhex(entry["bpf"])
        if (
            entry.get("format") != _FORMAT
            or entry.get("key") != key
            or hashlib.sha256(bpf).hexdigest() != entry.get("sha256")
            or not bpf
            or len(bpf) % 8
            or len(bpf) // 8 > MAX_INSNS
        ):
            raise ValueError("entry does not match")
        notify = entry.get("notify")
        return Program(bpf, key, bool(entry.get("listener")), notify)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        stats.disk_errors += 1  # a corrupt entry is a miss; the new one replaces it
        return None


def _write_entry(directory: str, program: Program) -> None:
    """Atomically (a temporary file renamed over the entry); a failure is only a miss."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not _trusted_dir(directory):
            raise OSError(errno.EPERM, f"{directory}: not owned by us or writable by others")
        entry = {
            "format": _FORMAT,
            "key": program.key,
            "sha256": hashlib.sha256(program.bpf).hexdigest(),
            "bpf": program.bpf.hex(),
            "listener": program.listener,
            "notify": program.notify,
        }
        import tempfile  # only when writing: launches that hit the cache do not need it

        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, os.path.join(directory, program.key + ".json"))
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        stats.disk_errors += 1
