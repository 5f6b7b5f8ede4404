"""Errors in the command line's own terms.

The library refuses a policy in the policy's terms: ``mounts[9].source`` for the tenth mount,
``workspace.path`` for the workspace, ``allow_rules`` for the lifted rules. Someone who typed
``--ro-bind $HOME`` or ``--workspace DIR`` knows neither the index nor the key, so the command
line keeps where each of those came from (``Origins``) and rewrites the error before it is
printed. The library never learns about the options.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

from nsbox.cli import options as _options
from nsbox.errors import NsboxError, PolicyError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from nsbox.policy.policy import Policy

_MOUNT_KEY = re.compile(r"mounts\[(\d+)\](?:\.\w+)?")
# Keys the library uses for what has no profile key (the option table's ``key``).
_OTHER_KEYS = {"inputs": "input"}
# The library's names (a Policy's fields) for what a profile key set: a refused workspace is
# "workspace", its size "limits.workspace_size". Without an option they become the profile key.
_PLAN_KEYS = {"workspace.path": "workspace", "workspace.size": "limits.workspace_size"}


class Origins:
    """The option each policy key and mount came from, for one command line."""

    def __init__(self, keys: dict[str, str], mounts: dict[int, str]) -> None:
        self.keys = keys  # profile key (or the library's own name) -> option flag
        self.mounts = mounts  # index in Policy.mounts -> the option as typed

    @classmethod
    def of(cls, values: dict[str, Any], policy: Policy | None,
           extra_inputs: bool = False) -> Origins:
        """The origins of the options ``values`` (parameters named as in the option table) in
        ``policy``, the policy they made (None: not made yet). ``extra_inputs``: the --input
        mounts are not in ``policy`` yet and come after its own (a session adds them)."""
        settings = {item.partition("=")[0].strip() for item in values.get("settings") or ()}
        keys: dict[str, str] = {}
        for option in _options.OPTIONS:
            given = values.get(option.name)
            key = option.key or _OTHER_KEYS.get(option.name)
            # A --set of the same key comes last and wins: the error is then the --set's.
            if key and given not in (None, (), [], False) and key not in settings:
                keys[key] = option.flags[-1]
        keys.update({key: f"--set {key}" for key in settings if key})
        keys.update({plan: keys[key] for key, plan in _PLAN_KEYS.items() if key in keys})
        return cls(keys, _mount_origins(values, policy, extra_inputs) if policy else {})

    def translate(self, error: NsboxError) -> NsboxError:
        """``error`` naming the option instead of the policy's key, where one option set it."""
        if not isinstance(error, PolicyError) or error.file or not error.key:
            return error  # a profile file's error names its file, key and line: those are right
        key = error.key
        match = _MOUNT_KEY.fullmatch(key)
        named: str | None = None
        if match and int(match.group(1)) in self.mounts:
            named = self.mounts[int(match.group(1))]
        else:
            named = self.keys.get(key) or next(  # the key itself first, then a part of one
                (flag for known, flag in self.keys.items()
                 if key.startswith((known + "[", known + "."))), None)
        hint = _lift_hint(error)
        if (named or key).startswith(("--ro-bind ", "--bind ")) and hint and \
                "optional = true" in hint:
            hint = "fix the path: the source of a bind must exist on this host"  # no optional
        named = named or next((k for k, plan in _PLAN_KEYS.items() if key == plan), None)
        if named is None and hint == error.hint:
            return error
        return PolicyError(error.message, key=named or key, hint=hint, rule=error.rule)


def _lift_hint(error: PolicyError) -> str | None:
    """The hint of a refusal by a rule of the rule book, saying how to lift it with the
    option (the library's names the profile key too)."""
    from nsbox.policy import rules

    rule = rules.RULES.get(error.rule or "")
    if rule is None or not rule.can_allow or error.hint != rules.refuse(rule.name, "").hint:
        return error.hint
    return f"{rule.remedy}; a trusted caller may lift this rule with --allow-rule {rule.name}"


def _mount_origins(values: dict[str, Any], policy: Policy, extra_inputs: bool
                   ) -> dict[int, str]:
    """Index in the policy's mounts -> the --ro-bind, --bind or --input that made it, or the
    mount's target for one of the profile's."""
    from nsbox.session.policy import input_mount

    by_target: dict[str, str] = {}
    for flag, name in (("--ro-bind", "ro_bind"), ("--bind", "rw_bind")):
        for spec in values.get(name) or ():
            source, _, target = spec.partition(":")  # SRC[:DST], as nsbox/cli/run.py reads it
            target = target or os.path.abspath(source)
            by_target[posixpath.normpath(target)] = f"{flag} {spec}"
    targets = [posixpath.normpath(mount.target) for mount in policy.mounts]
    for spec in values.get("inputs") or ():
        try:
            target = input_mount(spec).target
        except (NsboxError, OSError):
            continue  # refused before any mount was made
        by_target[target] = f"--input {spec}"
        if extra_inputs:
            targets.append(target)
    # A mount of the profile's is named by where it is: its index means nothing to the user.
    return {i: by_target.get(target, f"the mount at {target}")
            for i, target in enumerate(targets)}
