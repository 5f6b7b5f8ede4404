"""Which isolation a run gets: namespaces, or the Landlock mode where the host refuses them.

``Policy.isolation`` is ``auto`` (the default), ``namespaces`` or ``landlock``. ``auto`` means
namespaces until this process has seen the host refuse them, then the Landlock mode for every
later run. Nothing is probed: on a host where namespaces work the choice costs one attribute
read per run. The refusal is detected from a real launch (``refused``): the namespace step
itself fails (a container's seccomp profile: EPERM or ENOSYS; no user namespaces: EINVAL, or
ENOSPC with ``user.max_user_namespaces`` at 0), or a step inside the new user namespace is denied
the capability it needs while AppArmor restricts unprivileged user namespaces
(``kernel.apparmor_restrict_unprivileged_userns=1`` gives such a namespace no capabilities).
That launch failed before the command started, so the run is launched again in the Landlock mode.

The Landlock mode needs Landlock ABI 4 (Linux 6.7: TCP bind and connect); ``landlock`` on an older
kernel, or ``auto`` on a host that refuses namespaces and has no such Landlock, is refused with
the remedy. docs/hosts.md describes the mode and what is weaker in it.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from nsbox._sys import landlock as _landlock
from nsbox.errors import HostError, SetupError
from nsbox.policy.policy import Policy

NAMESPACES, LANDLOCK = "namespaces", "landlock"
T = TypeVar("T")

# The steps inside a new user namespace that need one of its capabilities, first to last.
_CAPABLE_STEPS = ("cgroup namespace", "set identity", "make mounts private", "mount tmpfs root")
_NAMESPACE_ERRNOS = (errno.EPERM, errno.EACCES, errno.ENOSYS, errno.EINVAL)


class _State:
    """What this process has learnt about its host (once; a host does not change under it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refused: str | None = None  # why namespaces are refused here, once seen
        self.abi: int | None = None


_state = _State()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def kernel_abi() -> int:
    """The Landlock ABI the mode uses: the kernel's. ``NSBOX_LANDLOCK_ABI`` in the environment
    may only lower it (the tests run the older ABIs' code on a newer kernel)."""
    if _state.abi is None:
        abi = _landlock.abi_version()
        cap = os.environ.get("NSBOX_LANDLOCK_ABI", "")
        if cap.isdigit():
            abi = min(abi, int(cap))
        _state.abi = abi
    return _state.abi


def refusal_reason() -> str | None:
    """Why this process runs in the Landlock mode under ``auto``, or None (namespaces)."""
    return _state.refused


def mode_for(policy: Policy) -> str:
    """The mode a run of ``policy`` gets now: ``namespaces`` or ``landlock``. Raises HostError
    when the policy asks for the Landlock mode and the kernel cannot give it."""
    wanted = policy.isolation
    if wanted == NAMESPACES or (wanted == "auto" and _state.refused is None):
        return NAMESPACES
    require_landlock(_state.refused if wanted == "auto" else None)
    return LANDLOCK


def require_landlock(why_not_namespaces: str | None = None) -> None:
    """HostError with the remedy unless the kernel has Landlock ABI 4 or later."""
    abi = kernel_abi()
    if abi >= _landlock.MIN_ABI:
        return
    have = f"Landlock ABI {abi}" if abi else "no Landlock"
    context = f"this host refuses namespaces ({why_not_namespaces}) and " if (
        why_not_namespaces) else ""
    raise HostError(
        f"isolation: {context}the Landlock mode needs Landlock ABI {_landlock.MIN_ABI} (Linux "
        f"6.7: TCP bind and connect), this kernel has {have}",
        feature="landlock",
        hint="boot Linux 6.7 or later with landlock in the lsm= list (CONFIG_SECURITY_LANDLOCK), "
        "or give nsbox a host that allows namespaces (`nsbox doctor` says what to change)")


def refused(error: SetupError) -> str | None:
    """Why ``error`` (a failed namespace launch) shows that this host refuses namespaces; None
    when it is some other failure. Detected from the error, never guessed."""
    if error.step == "create namespaces":
        if error.errno == errno.ENOSPC and _read("/proc/sys/user/max_user_namespaces") == "0":
            return "user.max_user_namespaces is 0"
        if error.errno in _NAMESPACE_ERRNOS:
            return _namespace_cause(error.errno)
        return None
    if (error.step in _CAPABLE_STEPS and error.errno == errno.EPERM
            and _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1"):
        return _APPARMOR
    return None


_APPARMOR = ("AppArmor gives unprivileged user namespaces no capabilities "
             "(kernel.apparmor_restrict_unprivileged_userns=1)")


def _namespace_cause(err: int) -> str:
    if err == errno.EINVAL:
        return "the kernel has no user namespaces"
    if _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1" and os.geteuid():
        return _APPARMOR
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0" and os.geteuid():
        return "kernel.unprivileged_userns_clone is 0"
    if "\nSeccomp:\t2" in _read("/proc/self/status") or err == errno.ENOSYS:
        return ("a seccomp filter around nsbox (a container's) refuses them "
                f"({errno.errorcode[err]})")
    return f"the kernel refuses them ({errno.errorcode.get(err, err)})"


def fall_back(policy: Policy, error: SetupError) -> bool:
    """After a failed namespace launch of ``policy``: True when the run should be launched again
    in the Landlock mode (``auto``, and the error shows the refusal); later runs then go there
    at once. For ``namespaces`` the error's hint names the Landlock mode."""
    reason = refused(error)
    if reason is None:
        return False
    if policy.isolation != "auto":
        error.hint = ((error.hint + "; ") if error.hint else "") + (
            "or run in the Landlock mode where namespaces are refused: isolation = \"auto\" or "
            "\"landlock\" (--isolation auto)")
        return False
    require_landlock(reason)
    with _state.lock:
        _state.refused = reason
    return True


def with_fallback(policy: Policy, attempt: Callable[[], T]) -> T:
    """``attempt()`` (a launch of ``policy``), launched again in the Landlock mode when it
    showed that this host refuses namespaces and the policy's isolation is ``auto``; the
    command had not started."""
    try:
        return attempt()
    except SetupError as exc:
        if not fall_back(policy, exc):
            raise
    return attempt()


def forget() -> None:
    """Start over (tests of the choice)."""
    with _state.lock:
        _state.refused = None
        _state.abi = None
