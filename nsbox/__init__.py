"""nsbox: run untrusted commands in a Linux sandbox built from kernel namespaces alone.

    import nsbox
    result = nsbox.run(["python3", "-c", "print(6 * 7)"], text=True, check=True)
    print(result.stdout)          # 42

- ``run`` / ``arun`` (asyncio): one command in a new sandbox, with ``subprocess.run``'s
  arguments where they mean the same (``input``, ``text``, ``check``, ``capture_output``,
  ``timeout``); a ``Result`` back.
- ``Session`` / ``AsyncSession``: one sandbox for many commands and files; ``Pool``:
  sandboxes built ahead for many short commands.
- ``Policy`` (and ``Limits``, ``Network``, ``Bind``...): what a sandbox may do; profiles load
  into one.
- Errors: ``NsboxError`` and its kinds (``CommandNotFound`` is also a FileNotFoundError,
  ``CommandFailed`` a subprocess.CalledProcessError).

The guide is docs/api.md; the names are imported on first use, so ``import nsbox`` costs
nothing until one is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nsbox.aio import AsyncSession, arun
    from nsbox.api import run
    from nsbox.errors import (
        CommandNotExecutable,
        CommandNotFound,
        FileTransferError,
        HostError,
        LaunchError,
        NsboxError,
        PolicyError,
        SandboxFileNotFound,
        SessionClosed,
        SetupError,
    )
    from nsbox.failed import CommandFailed, CommandTimedOut
    from nsbox.launch.pool import Pool
    from nsbox.policy.policy import (
        Bind,
        Dir,
        File,
        Limits,
        Network,
        Policy,
        Seccomp,
        Symlink,
        Tmpfs,
    )
    from nsbox.result import OutputDecodeError, Result, Status
    from nsbox.session.session import CopyLimits, FileInfo, Session
    from nsbox.version import VERSION as __version__

_WHERE = {
    "CommandNotFound": "errors", "HostError": "errors", "LaunchError": "errors",
    "NsboxError": "errors", "PolicyError": "errors", "SetupError": "errors",
    "CommandNotExecutable": "errors", "FileTransferError": "errors",
    "SandboxFileNotFound": "errors", "SessionClosed": "errors",
    "CommandFailed": "failed", "CommandTimedOut": "failed",
    "arun": "aio", "AsyncSession": "aio",
    "run": "api", "Pool": "launch.pool", "Result": "result", "Status": "result",
    "OutputDecodeError": "result",
    "Bind": "policy.policy", "Dir": "policy.policy", "File": "policy.policy",
    "Limits": "policy.policy", "Network": "policy.policy", "Policy": "policy.policy",
    "Seccomp": "policy.policy", "Symlink": "policy.policy", "Tmpfs": "policy.policy",
    "CopyLimits": "session.session", "FileInfo": "session.session", "Session": "session.session",
    "__version__": "version",
}

__all__ = [
    "Bind", "CommandNotFound", "Dir", "File", "HostError", "LaunchError", "Limits", "Network",
    "NsboxError", "Policy", "PolicyError", "Result", "Seccomp", "SetupError", "Status", "Symlink",
    "Tmpfs", "__version__", "run",
]
__all__ += ["CopyLimits", "FileInfo", "Session"]
__all__ += ["Pool"]
__all__ += ["AsyncSession", "CommandFailed", "CommandNotExecutable", "CommandTimedOut",
            "FileTransferError", "SandboxFileNotFound", "SessionClosed", "arun"]
__all__ += ["OutputDecodeError"]


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
