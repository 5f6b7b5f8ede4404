"""What a Session is made of: the caller's arguments, checked, and the session's policy.

A session's policy is the caller's (or a profile's) with the session's own workspace, a project
seen copy-on-write at /workspace, and inputs mounted read-only under /input. A bad value fails
here, naming its key, before anything of the session is opened.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from nsbox.errors import PolicyError
from nsbox.host import project as projectmod
from nsbox.policy import checks, rules
from nsbox.policy.policy import Bind, Policy
from nsbox.session.files import CopyLimits

INPUT_DIR = "/input"


def input_mount(spec: str) -> Bind:
    """``HOST_PATH[:NAME]`` -> a read-only bind of HOST_PATH at /input/NAME."""
    source, sep, name = spec.rpartition(":")
    if not sep:
        source, name = spec, ""
    if not source:
        raise PolicyError(f"{spec!r}: expected HOST_PATH[:NAME]", key="input")
    name = name or os.path.basename(os.path.normpath(source))
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise PolicyError(f"{spec!r}: the name under {INPUT_DIR} must be one path component",
                          key="input")
    if not os.path.exists(source):
        # A refused path is refused by its rule, whether or not it exists on this host; one
        # that exists meets the rules (with the policy's allow_rules) in Policy and the plan.
        rules.check_spelling(rules.resolve(os.path.abspath(source), "input"), False, (),
                             "input")
        raise PolicyError(f"{spec!r}: {source} does not exist", key="input",
                          hint="check the path of the input")
    return Bind(os.path.abspath(source), f"{INPUT_DIR}/{name}", writable=False)


def check_copy_limits(copy_limits: object) -> None:
    if copy_limits is not None and not isinstance(copy_limits, CopyLimits):
        raise PolicyError(f"expected a nsbox.CopyLimits, got {checks.quote(copy_limits)}",
                          key="copy_limits")


def check_inputs(inputs: object) -> None:
    if isinstance(inputs, str) or not isinstance(inputs, (list, tuple)):
        raise PolicyError(f"expected a list of HOST_PATH[:NAME], got {checks.quote(inputs)}",
                          key="inputs", hint=f"did you mean [{checks.quote(inputs)}]?"
                          if isinstance(inputs, str) else None)
    for spec in inputs:
        checks.text(spec, "inputs")


def policy_for(policy: Policy, workspace: str | None, project: str | None,
               inputs: Sequence[str]) -> Policy:
    """The policy with the session's own workspace, project and inputs."""
    if workspace is not None:
        policy = policy.replace(workspace=workspace)
    if project is not None:
        policy = policy.replace(project=projectmod.source(checks.path(project, "project")))
    if inputs:
        policy = policy.replace(mounts=policy.mounts + tuple(input_mount(s) for s in inputs))
    if policy.seccomp.log_denied:
        # The learning-mode listener is handed over once per launch, not per command.
        raise PolicyError("seccomp learning mode is not available in a session",
                          key="seccomp.log_denied", hint="use nsbox run --seccomp-log")
    return policy


def check_ask(ask: object, policy: Policy) -> None:
    if ask is not None and (not callable(ask) or policy.network.effective_mode != "allow"):
        raise PolicyError(
            "ask needs a callable and network mode allow with at least one entry"
            if callable(ask) else f"expected a callable, got {checks.quote(ask)}",
            key="ask", hint="e.g. Network(mode='allow', allow=('pypi.org',)): hosts not "
            "on the list are put to ask(host, port)")
