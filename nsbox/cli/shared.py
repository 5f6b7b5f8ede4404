"""What the click commands of nsbox/cli/commands.py and nsbox/cli/session.py share: the exit
on an error, the limit options and the profile with the options applied.

Below both, so that neither imports the other (docs/architecture.md).
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

from nsbox.cli import options as _options
from nsbox.cli import run as _cli_run
from nsbox.cli.lines import fail_code
from nsbox.errors import NsboxError
from nsbox.policy import limittable
from nsbox.policy.policy import Policy


def fail(error: NsboxError, given: dict[str, Any] | None = None, policy: Policy | None = None,
         extra_inputs: bool = False) -> NoReturn:
    """Print ``nsbox: <step>: <reason>`` (and the hint) and exit with the matching code. With
    the options ``given`` (named as in nsbox/cli/options.py) and the ``policy`` they made, the
    error names the option rather than the policy's key (nsbox/cli/origins.py)."""
    if given is not None:
        from nsbox.cli.origins import Origins

        error = Origins.of(given, policy, extra_inputs).translate(error)
    sys.exit(fail_code(error))


# The checks of the option table, for the session commands' own options.
size = _options.click_callback("size")
duration = _options.click_callback("duration")


# --- resource limit options (nsbox/policy/limits.py; docs/limits.md) ---------------------------
# Declared in nsbox/policy/limittable.py and nsbox/cli/options.py; a bad value (``--memory 0``,
# ``--memory lots``) is a usage error that names the option and says what to write.
LIMIT_PARSERS: dict[str, Any] = {spec.name: spec.parse_option for spec in limittable.OPTION_LIMITS}
limit_options = _options.click_options(_options.START, lambda option: option.limit is not None)


def with_limits(policy: Policy, values: dict[str, Any], settings: tuple[str, ...] = ()
                ) -> Policy:
    # --set comes last, for the limits' own options too (nsbox/cli/run.py, policy_from_options).
    set_keys = {item.partition("=")[0].strip() for item in settings}
    changes = limittable.limit_changes({
        k: v for k, v in values.items()
        if k in LIMIT_PARSERS and limittable.BY_NAME[k].key not in set_keys})
    return policy.with_limits(**changes) if changes else policy


def load_policy(profile: str, overrides: dict[str, Any], settings: tuple[str, ...],
                binds: list[tuple[str, str, bool]]) -> Policy:
    """The profile with the options applied (nsbox/cli/run.py, shared with the fast path of
    nsbox run); a malformed --set or bind is a usage error."""
    try:
        _cli_run.check({"ro_bind": (), "rw_bind": (), "env": (), "settings": settings})
        for _option, spec, writable in binds:
            _cli_run.bind_override(spec, writable)
    except _cli_run.OptionError as exc:
        raise click.BadParameter(str(exc), param_hint=exc.param_hint) from None
    return _cli_run.load_policy(profile, overrides, settings, binds)
