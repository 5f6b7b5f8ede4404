"""nsbox: run untrusted commands in a Linux sandbox built from kernel namespaces alone.

The public names are imported on first use (PEP 562), so that ``import nsbox`` is free: the
command line's fast path and the launch helper import only what they use (docs/performance.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nsbox.api import run
    from nsbox.errors import (
        CommandNotFound,
        HostError,
        LaunchError,
        NsboxError,
        PolicyError,
        SetupError,
    )
    from nsbox.policy import Bind, Dir, File, Limits, Network, Policy, Seccomp, Symlink, Tmpfs
    from nsbox.pool import Pool
    from nsbox.result import Result, Status
    from nsbox.session import CopyLimits, FileInfo, Session
    from nsbox.version import VERSION as __version__

_WHERE = {
    "CommandNotFound": "errors", "HostError": "errors", "LaunchError": "errors",
    "NsboxError": "errors", "PolicyError": "errors", "SetupError": "errors",
    "run": "api", "Pool": "pool", "Result": "result", "Status": "result",
    "Bind": "policy", "Dir": "policy", "File": "policy", "Limits": "policy", "Network": "policy",
    "Policy": "policy", "Seccomp": "policy", "Symlink": "policy", "Tmpfs": "policy",
    "CopyLimits": "session", "FileInfo": "session", "Session": "session",
    "__version__": "version",
}

__all__ = [
    "Bind", "CommandNotFound", "Dir", "File", "HostError", "LaunchError", "Limits", "Network",
    "NsboxError", "Policy", "PolicyError", "Result", "Seccomp", "SetupError", "Status", "Symlink",
    "Tmpfs", "__version__", "run",
]
__all__ += ["CopyLimits", "FileInfo", "Session"]
__all__ += ["Pool"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'nsbox' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f"nsbox.{_WHERE[name]}")
    value = getattr(module, "VERSION" if name == "__version__" else name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
