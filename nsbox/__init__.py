"""nsbox: run untrusted commands in a Linux sandbox built from kernel namespaces alone."""

from nsbox.errors import (
    CommandNotFound,
    HostError,
    LaunchError,
    NsboxError,
    PolicyError,
    SetupError,
)
from nsbox.launcher import run
from nsbox.policy import Bind, Dir, File, Limits, Network, Policy, Seccomp, Symlink, Tmpfs
from nsbox.pool import Pool
from nsbox.result import Result, Status
from nsbox.session import CopyLimits, FileInfo, Session
from nsbox.version import VERSION as __version__

__all__ = [
    "Bind", "CommandNotFound", "Dir", "File", "HostError", "LaunchError", "Limits", "Network",
    "NsboxError", "Policy", "PolicyError", "Result", "Seccomp", "SetupError", "Status", "Symlink",
    "Tmpfs", "__version__", "run",
    "Pool",
]
__all__ += ["CopyLimits", "FileInfo", "Session"]
