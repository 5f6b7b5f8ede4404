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
from nsbox.result import Result, Status

__version__ = "0.1.0"

__all__ = [
    "Bind", "CommandNotFound", "Dir", "File", "HostError", "LaunchError", "Limits", "Network",
    "NsboxError", "Policy", "PolicyError", "Result", "Seccomp", "SetupError", "Status", "Symlink",
    "Tmpfs", "__version__", "run",
]
