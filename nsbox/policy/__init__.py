"""Stage 1, what a sandbox may do: the ``Policy`` and its parts (``policy``), the checks of
single values (``checks``) and of a run's arguments (``inputs``), the rule book (``rules``),
network allow-list entries (``netrules``), the sandbox's identity on the host (``identity``),
the limits (``limits``, ``limittable``) and sizes and durations (``units``).

``from nsbox.policy import Policy, Bind, ...`` is the documented way to the policy's names
(docs/rules.md, docs/seccomp.md); they come from ``nsbox.policy.policy`` on first use. Nothing is
imported here up front: the launch helper imports ``identity`` and ``limits`` from this package,
and must not pay for the policy's dataclasses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nsbox.policy.policy import (
        DEFAULT_MOUNTS,
        DEFAULT_PROJECT_SECRETS,
        ISOLATION_MODES,
        MOUNT_KINDS,
        Bind,
        Dir,
        File,
        KiB,
        Limits,
        MiB,
        Mount,
        Network,
        Policy,
        Seccomp,
        SeccompArg,
        SeccompRule,
        Symlink,
        Tmpfs,
    )

__all__ = ["DEFAULT_MOUNTS", "DEFAULT_PROJECT_SECRETS", "ISOLATION_MODES", "MOUNT_KINDS", "Bind",
           "Dir", "File", "KiB", "Limits", "MiB", "Mount", "Network", "Policy", "Seccomp",
           "SeccompArg", "SeccompRule", "Symlink", "Tmpfs"]


def __getattr__(name: str) -> Any:
    # Only the policy's names: any other (a module of this package not imported yet) stays an
    # AttributeError, so that `from nsbox.policy import identity` imports that module alone.
    if name not in __all__:
        raise AttributeError(f"module 'nsbox.policy' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module("nsbox.policy.policy"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
