"""The choice of launch core, and the flat plan the native one reads.

Two cores run the sandbox child between clone and exec: the Python child (nsbox/sandbox/child.py
and mounts.py, the reference) and the native core (the extension nsbox._native, built from
nsbox/native/*.c), which performs the same named steps in C, so that no Python bytecode runs
after the clone. The native core is used when the extension is importable, the caller did not
set ``NSBOX_NATIVE=0``, and the plan holds nothing it does not do (``unsupported``); the launch
then falls back to the Python child, never to a weaker sandbox.

``flatten`` turns the plan into one byte string, once, before the clone: the C side parses it
in the parent into plain C memory and the child reads nothing else (nsbox/native/plan.c has the
format). Imported by the launch helper before it clones; imports nothing at launch time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

FORMAT = 3  # nsbox/native/plan.h, PLAN_FORMAT


def _load() -> tuple[ModuleType | None, str]:
    """The extension, or None and why not."""
    try:
        from nsbox import _native as module
    except ImportError as exc:  # no compiler at install time, or the one-file CLI (nsbox.pyz)
        return None, f"nsbox._native is not built ({exc})"
    if module.FORMAT != FORMAT:
        return None, "nsbox._native is from another version of nsbox: reinstall it"
    return module, ""


_native, MISSING = _load()

# The mount kinds of the C side (nsbox/native/plan.h, enum mount_kind).
KINDS = {"bind": 1, "tmpfs": 2, "file": 3, "symlink": 4, "dir": 5, "dev": 6, "proc": 7}
NET_MODES = {"none": 0, "loopback": 1, "allow": 2}
# The ranges the C side checks (nsbox/native/plan.h): MODE_MAX, RESOURCE_MAX, CAP_LAST_MAX.
_MODE_MAX = 0o7777
_RESOURCE_MAX = 63
_CAP_LAST_MAX = 63
_INT_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_ALL_SIGNALS = 2**64 - 1  # signals 1 to 64, bit N-1 for signal N (nsbox/_sys/libc.py, ALL_SIGNALS)
_DEFAULT_PATH = "/usr/bin:/bin"  # as nsbox/sandbox/child.py, execute


def disabled_by_caller() -> bool:
    """``NSBOX_NATIVE=0``: the Python child for every launch (CI runs the security tests so)."""
    return os.environ.get("NSBOX_NATIVE") == "0"


def status() -> tuple[bool, str]:
    """Whether launches use the native core, and why not (for ``nsbox doctor``)."""
    if disabled_by_caller():
        return False, "NSBOX_NATIVE=0: the Python child runs every launch"
    if _native is None and _in_one_file():
        return False, ("nsbox.pyz: the Python child runs every launch (a zip archive cannot "
                       "hold the compiled native core)")
    if _native is None:
        return False, (f"{MISSING}: the Python child runs every launch; install gcc and the "
                       "Python headers (python3-dev), then reinstall nsbox")
    return True, "native: nsbox._native runs the sandbox child (C, no Python after the clone)"


def _in_one_file() -> bool:
    """Whether this copy runs from the one-file nsbox.pyz (zipimport: tools/build_pyz.py)."""
    import zipimport

    return isinstance(__spec__.loader, zipimport.zipimporter)


def unsupported(plan: Mapping[str, Any]) -> str | None:
    """Why the native core cannot run ``plan`` (the launch then uses the Python child)."""
    if _native is None:
        return MISSING
    if plan.get("native") is False:
        return "NSBOX_NATIVE=0"
    if plan.get("session"):
        return "a session's init is Python (nsbox/sandbox/sessioninit.py)"
    for op in plan["mounts"]:
        if op["op"] not in KINDS:
            return f"{op['op']} mounts are made by the Python child"
    return None


class Unsupported(ValueError):
    """A plan the native core does not run (``unsupported`` says why): the Python child's."""


class Writer:
    """The items of the flat plan: 'i' + int64, or 's' + uint32 length + bytes + NUL."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def put_int(self, value: int) -> None:
        self.parts.append(b"i" + value.to_bytes(8, "little", signed=True))

    def put_bits(self, mask: int) -> None:
        """64 bits, as the int item of the same bytes (plan.c reads them unsigned)."""
        self.parts.append(b"i" + mask.to_bytes(8, "little", signed=False))

    def put_in(self, value: int, low: int, high: int) -> None:
        """An int the C side keeps in a narrower range (nsbox/native/plan.h): out of it, the
        native core would refuse the plan as malformed, so the Python child takes it."""
        if not low <= value <= high:
            raise OverflowError(f"{value} is out of the native core's range {low}..{high}")
        self.put_int(value)

    def put_bytes(self, data: bytes, c_string: bool = True) -> None:
        if c_string and b"\0" in data:
            raise ValueError("a string of the plan holds a NUL byte")
        self.parts.append(b"s" + len(data).to_bytes(4, "little") + data + b"\0")

    def put_str(self, text: str) -> None:
        # Strictly UTF-8: the child writes these into its JSON error report as they are. A
        # name that is not (surrogate escapes of undecodable bytes) takes the Python child.
        self.put_bytes(text.encode("utf-8"))

    def put_strings(self, texts: Sequence[str]) -> None:
        self.put_int(len(texts))
        for text in texts:
            self.put_str(text)


def flatten(plan: Mapping[str, Any], stdio: Sequence[int], sync_r: int, err_w: int,
            sources: Mapping[int, int], notify: int, net: int | None, cap_last: int,
            comm: str = "", ignored_signals: int = _ALL_SIGNALS) -> tuple[bytes, list[int]]:
    """The flat plan, and the descriptors it refers to by index (in that order).
    ``ignored_signals``: the mask of signals the child puts back to SIG_DFL before the exec
    (nsbox/sandbox/child.py, ignored_signals). Raises ValueError (UnicodeError) or
    OverflowError for a plan the native core cannot carry (Unsupported, a ValueError, for one
    that ``unsupported`` names): use the Python child."""
    reason = unsupported(plan)
    if reason is not None:
        raise Unsupported(reason)
    fds = [*stdio, sync_r, err_w]
    w = Writer()
    w.put_int(FORMAT)
    for index in range(5):
        w.put_int(index)
    for fd in (notify, -1 if net is None else net):
        w.put_int(len(fds) if fd >= 0 else -1)
        if fd >= 0:
            fds.append(fd)
    w.put_in(plan["uid"], 0, _INT_MAX)
    w.put_in(plan["gid"], 0, _INT_MAX)
    w.put_in(cap_last, 0, _CAP_LAST_MAX)
    w.put_int(1 if plan.get("trace") else 0)
    w.put_int(1 if plan.get("pooled") else 0)
    w.put_bits(ignored_signals)
    w.put_str(comm)
    w.put_str(plan["hostname"])
    net_plan = plan["net"]
    w.put_int(NET_MODES[net_plan.get("mode", "none")])
    w.put_in(int(net_plan.get("proxy_port", 0)), 0, 65535)
    _mounts(w, plan["mounts"], sources, fds)
    _command(w, plan)
    return b"".join(w.parts), fds


def _mounts(w: Writer, mounts: Sequence[Mapping[str, Any]], sources: Mapping[int, int],
            fds: list[int]) -> None:
    w.put_int(len(mounts))
    for index, op in enumerate(mounts):
        kind = op["op"]
        w.put_int(KINDS[kind])
        w.put_str(op["target"])
        w.put_str(f"{kind} {op['target']}")  # the step's name, as the Python child names it
        if kind == "bind":
            source = sources.get(index)
            w.put_int(len(fds) if source is not None else -1)
            if source is not None:
                fds.append(source)
            w.put_str("/oldroot" + op["source"])  # nsbox/sandbox/mounts.py, _open_source
            w.put_int(1 if op["writable"] else 0)
            w.put_int(1 if op["is_dir"] else 0)
        elif kind == "tmpfs":
            w.put_in(int(op["size"]), 0, _INT64_MAX)
            w.put_in(int(op["mode"]), 0, _MODE_MAX)
        elif kind == "file":
            w.put_bytes(op["content"].encode(), c_string=False)
            w.put_in(int(op["mode"]), 0, _MODE_MAX)
        elif kind == "symlink":
            w.put_str(op["points_to"])
        elif kind == "dir":
            w.put_in(int(op["mode"]), 0, _MODE_MAX)
        elif kind == "dev":
            w.put_strings(op["devices"])
            w.put_in(int(op["shm_size"]), 0, _INT64_MAX)


def _command(w: Writer, plan: Mapping[str, Any]) -> None:
    rlimits = plan["rlimits"]
    w.put_int(len(rlimits))
    for resource, soft, hard in rlimits:
        w.put_in(int(resource), 0, _RESOURCE_MAX)
        for value in (soft, hard):  # -1: RLIM_INFINITY
            w.put_in(int(value), -1, _INT64_MAX)
    w.put_str(plan["cwd"])
    argv = list(plan["argv"])
    env = dict(plan["env"])  # as the Python child: the last of two equal names wins
    if any("=" in name or not name for name in env):
        raise ValueError("an environment variable name holds '=' (os.execve refuses it)")
    w.put_strings(argv)
    w.put_strings([f"{name}={value}" for name, value in env.items()])
    name = argv[0]
    w.put_int(1 if "/" in name else 0)
    w.put_strings([] if "/" in name else [
        os.path.join(directory or ".", name)
        for directory in env.get("PATH", _DEFAULT_PATH).split(":")])
    w.put_bytes(bytes.fromhex(plan["setid_bpf"]), c_string=False)
    w.put_bytes(bytes.fromhex(plan["seccomp_bpf"] or ""), c_string=False)
    w.put_int(1 if plan.get("seccomp_notify") else 0)
    tty = plan.get("tty") or (0, 0)  # --tty: rows and columns (nsbox/sandbox/terminal.py)
    w.put_int(1 if plan.get("tty") else 0)
    w.put_in(int(tty[0]), 0, 65535)
    w.put_in(int(tty[1]), 0, 65535)


def flatten_command(command: Mapping[str, Any], setid_bpf: str) -> bytes:
    """A pooled sandbox's command in flat form (its per-command items alone): the native core
    parses it after the wait (nsbox/native/child.c, await_command). Raises ValueError or
    OverflowError as ``flatten`` does."""
    w = Writer()
    _command(w, {**command, "setid_bpf": setid_bpf})
    return b"".join(w.parts)


def spawn(blob: bytes, fds: Sequence[int], close_fds: Sequence[int], flags: int,
          cgroup_fd: int) -> int:
    """Clone the sandbox child of ``blob`` (see nsbox/native/module.c, spawn)."""
    assert _native is not None
    return int(_native.spawn(blob, list(fds), list(close_fds), flags, cgroup_fd))


def start_spawner(sock: int, procs: Sequence[int], flags: int, spawner_name: str) -> int:
    """A spawner as a C loop (nsbox/native/spawner.c): its pid; 0 in a sandbox child that it
    cloned for the Python child, which goes on in Python."""
    assert _native is not None
    return int(_native.start_spawner(sock, list(procs), flags, spawner_name, own_name()))


_comm: list[str] = []


def own_name() -> str:
    """This process's name (comm), which a sandbox cloned by a spawner takes back."""
    if not _comm:
        with open("/proc/self/comm") as f:
            _comm.append(f.read().rstrip("\n"))
    return _comm[0]
