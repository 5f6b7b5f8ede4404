"""What ``nsbox run`` does once its options are parsed, without click.

Both doors lead here: the click command in nsbox/cli/commands.py, and the hand-written fast
path of nsbox/cli/fast.py that serves ``nsbox run`` without importing click. ``options`` holds
the command's parameters by name, as declared once in nsbox/cli/options.py. Prints, and returns
the exit code (nsbox/cli/commands.py documents them).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from typing import Any

import nsbox
from nsbox import visible
from nsbox.cli.lines import echo, exit_code, fail_code, report, settle_terminal
from nsbox.errors import NsboxError, PolicyError, SetupError
from nsbox.host.network import from_options
from nsbox.policy.policy import Policy
from nsbox.result import Result, Status


class OptionError(ValueError):
    """A bad option value; the click door shows it as a usage error (exit 2)."""

    def __init__(self, message: str, param_hint: str | None) -> None:
        super().__init__(message)
        self.param_hint = param_hint


def bind_override(spec: str, writable: bool) -> dict[str, Any]:
    source, _, target = spec.partition(":")
    if not source:
        raise OptionError(f"{spec!r}: expected SRC[:DST]",
                          "--bind" if writable else "--ro-bind")
    return {"type": "bind", "source": source, "target": target or os.path.abspath(source),
            "writable": writable}


def parse_env(items: tuple[str, ...]) -> dict[str, str]:
    env_set: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key or not sep:
            raise OptionError(f"{item!r}: expected KEY=VAL" + (
                f" (to pass the caller's {key}, as docker's -e {key} does: --pass-env {key})"
                if key and not sep else ""), "--env")
        env_set[key] = value
    return env_set


def check(options: dict[str, Any]) -> None:
    """Raise OptionError for what the option parsers alone do not refuse."""
    for spec in options["ro_bind"]:
        bind_override(spec, False)
    for spec in options["rw_bind"]:
        bind_override(spec, True)
    parse_env(options["env"])
    if options.get("tty"):
        check_tty(bool(options.get("as_json")))
    for item in options["settings"]:
        key, sep, _text = item.partition("=")
        if not key or not sep:
            raise OptionError(f"{item!r}: expected KEY=VALUE", "--set")


def check_tty(as_json: bool) -> None:
    """--tty relays this process's terminal: there must be one, and no --json capture."""
    if as_json:
        raise OptionError("--tty and --json do not go together: --json captures the output, "
                          "--tty relays it to this terminal", "--tty")
    if not os.isatty(0):
        raise OptionError("--tty needs a terminal on stdin, and stdin is not one here (a pipe "
                          "or a file): run without --tty", "--tty")


# --- profiles: the options become overrides of the profile's keys (docs/profiles.md) ----------


def load_policy(profile: str, overrides: dict[str, Any], settings: tuple[str, ...],
                binds: list[tuple[str, str, bool]]) -> Policy:
    """The profile with the options applied; ``--set KEY=VALUE`` takes a TOML value (a bare
    word is a string) and comes last. Raises PolicyError naming the file, key and line, or the
    option."""
    from nsbox.profiles import apply_overrides, load_profile, schema, toml

    for item in settings:
        tomllib = toml()
        key, _sep, text = item.partition("=")
        try:
            overrides[key.strip()] = tomllib.loads(f"value = {text}")["value"]
        except tomllib.TOMLDecodeError:
            overrides[key.strip()] = text
    policy = load_profile(profile)
    # Their values are merged here: checked first, as a profile's are (not spread, a string).
    here = schema.Origin(None)
    env = overrides.pop("environment.set", None) or {}
    schema.expect(here, "environment.set", env, dict, 'a table of NAME = "value"')
    env = dict(env)
    # PATH and LANG have keys of their own in the schema.
    for name in ("PATH", "LANG"):
        if name in env:
            overrides[f"environment.{name.lower()}"] = env.pop(name)
    if env:
        overrides["environment.set"] = env
    if overrides.get("environment.passthrough"):
        schema.env_names(here, "environment.passthrough", overrides["environment.passthrough"])
        overrides["environment.passthrough"] = [
            *policy.env_passthrough, *overrides["environment.passthrough"]]
    # The rules a trusted caller lifts come first: the binds and the workspace they allow
    # are checked as they are applied.
    allowed = overrides.pop("allow_rules", None)
    if allowed:
        if isinstance(allowed, str):
            allowed = [allowed]
        policy = apply_overrides(policy, {"allow_rules": [*policy.allow_rules, *allowed]})
    targets: dict[str, str] = {}  # each bind its own layer: a second would replace the first
    for option, spec, writable in binds:
        try:
            policy = apply_overrides(policy, {"mounts": [bind_override(spec, writable)]})
            _check_bind(policy)
            target = policy.mounts[-1].target
            if target in targets:
                raise PolicyError(f"{target} is already the target of {targets[target]}",
                                  hint="give each bind a target of its own (SRC:DST)")
            targets[target] = f"{option} {spec}"
        except PolicyError as exc:
            raise PolicyError(exc.message, key=f"{option} {spec}", hint=exc.hint,
                              rule=exc.rule) from None
    return apply_overrides(policy, {k: v for k, v in overrides.items()
                                    if v is not None and v != []})


def _check_bind(policy: Policy) -> None:
    """The rule book on the bind just added, now, so that a refusal names the option
    (``--ro-bind /root: refused by rule secret-dir``), not the policy's ``mounts[9]``."""
    from nsbox.host.pathrules import HostView
    from nsbox.plan import plan

    mount = policy.mounts[-1]
    plan.MOUNT_OPS[mount.kind](mount, "bind", policy.allow_rules, HostView.current())


# --- end profiles ---------------------------------------------------------------------------------


class Stopped(BaseException):
    """SIGTERM arrived (as KeyboardInterrupt does for SIGINT): unwinds the run like it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, _frame: Any) -> None:
    raise Stopped(signum)


def execute(options: dict[str, Any]) -> int:
    """Run the command of ``nsbox run`` as the options say; returns the exit code. Raises
    OptionError for a usage error (no command).

    Ctrl-C (SIGINT) or SIGTERM ends the sandbox: the exception unwinds the run, which closes
    its launch socket (the helper kills the sandbox at that end-of-file), then the helper
    itself is ended and reaped; one line is printed and the exit code is 128 + the signal."""
    check(options)
    from nsbox.launch import launcher

    launcher.use_forked_helper()  # one launch: a second interpreter would cost more
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        return _execute(options)
    except KeyboardInterrupt:
        return _stopped(signal.SIGINT)
    except Stopped as stop:
        return _stopped(stop.signum)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped(signum: int) -> int:
    from nsbox.launch import launcher

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    launcher.helper_client.stop()  # every sandbox is dead once the helper is reaped
    echo(f"nsbox: stopped by {signal.Signals(signum).name}: the sandbox was killed", err=True)
    return 128 + signum


def _execute(o: dict[str, Any]) -> int:
    """The named steps of ``nsbox run``: the policy, the launch, the report."""
    as_json = o["as_json"]
    collected: list[Any] = []
    policy: Policy | None = None
    try:
        policy = policy_from_options(o)
        if o["print_profile"]:
            from nsbox.profiles import to_toml

            sys.stdout.write(to_toml(policy))
            sys.stdout.flush()
            return 0
        if not o["command"] or not o["command"][0]:
            raise OptionError("missing COMMAND (or --print-profile)" if not o["command"] else
                              "COMMAND is empty: no program is named ('')", None)
        policy = _with_inputs(policy, o["inputs"])
        if o.get("ask") and policy.network.effective_mode != "allow":
            raise OptionError("it asks about the hosts that are not on the allow-list: name "
                              "at least one with --allow-host HOST (or a profile's [network] "
                              "allow)", "--ask")
        collect_from_now_on()
        result, collected = _launch(o, policy)
    except (NsboxError, OSError) as raised:
        return _failed(_naming_the_program(raised, o["command"]), as_json, o, policy)
    if result.isolation != "namespaces" and policy.isolation == "auto" and not o.get("quiet"):
        echo(isolation_line(), err=True)
    if as_json:
        echo(visible.json_text({**result.to_dict(with_output=True),
                                **({"files": collected} if o["collect"] else {})}))
    else:
        report(result, quiet=bool(o.get("quiet")))
    return exit_code(result)


def _naming_the_program(raised: NsboxError | OSError,
                        command: tuple[str, ...]) -> NsboxError | OSError:
    """A program that exists but cannot be run is named, as a shell names it
    (``sh: 1: /etc/passwd: Permission denied``); a missing one is named already."""
    if (isinstance(raised, SetupError) and raised.step == "exec" and command
            and command[0] not in raised.message):
        return type(raised)("exec", raised.errno, f"{command[0]}: {raised.message}",
                            raised.hint)
    return raised


def isolation_line() -> str:
    """Why this run got the Landlock mode, in one line (the Result lists what is weaker)."""
    from nsbox.host.isolation import refusal_reason

    return (f"nsbox: Landlock mode: this host refuses namespaces ({refusal_reason()}); "
            "`nsbox doctor` says what is weaker and how to get them")


def collect_from_now_on() -> None:
    """Garbage collection back on (the fast path starts without it, nsbox/cli/fast.py), over
    the objects made from now on only: those of the imports and the policy stay, so no pass
    walks them again (and a forked helper does not write to their pages)."""
    gc.freeze()
    gc.enable()


# How an option's value becomes the value of its profile key (Option.key), where it is not the
# value itself: a flag sets its key only when given, a list only when not empty.
_OVERRIDE_VALUES: dict[str, Any] = {
    "env": lambda items: parse_env(items) or None,
    "project": lambda path: os.path.abspath(path) if path else None,
    "seccomp_log": lambda given: True if given else None,
}


def overrides_from_options(o: dict[str, Any]) -> dict[str, Any]:
    """The profile keys the options set (the option table's ``key``), limits aside."""
    from nsbox.cli import options as _options

    overrides: dict[str, Any] = {}
    for option in _options.for_door(_options.RUN):
        if option.key is None or option.limit is not None:
            continue
        value = o.get(option.name)
        convert = _OVERRIDE_VALUES.get(option.name)
        if convert is not None:
            value = convert(value)
        elif option.kind == _options.MULTIPLE:
            value = list(value or ()) or None
        overrides[option.key] = value
    return overrides


def policy_from_options(o: dict[str, Any]) -> Policy:
    """The profile with the options applied: keys, binds, limits, then the network."""
    from nsbox.policy import limittable

    binds = [("--ro-bind", spec, False) for spec in o["ro_bind"]]
    binds += [("--bind", spec, True) for spec in o["rw_bind"]]
    policy = load_policy(o["profile"], overrides_from_options(o), o["settings"], binds)
    # --set comes last, for the limits' own options too (as for every other option's key).
    set_keys = {item.partition("=")[0].strip() for item in o["settings"]}
    limit_changes = limittable.limit_changes(
        {spec.name: o.get(spec.name) for spec in limittable.OPTION_LIMITS
         if spec.key not in set_keys})
    if limit_changes:
        policy = policy.with_limits(**limit_changes)
    # --- network (docs/network.md) ---
    return policy.replace(network=from_options(policy.network, o["net_mode"], o["allow_host"]))


def _with_inputs(policy: Policy, specs: tuple[str, ...]) -> Policy:
    """--input: each host path mounted read-only at /input/NAME."""
    if not specs:
        return policy
    from nsbox.session.session import input_mount

    return policy.replace(mounts=policy.mounts + tuple(input_mount(s) for s in specs))


def _launch(o: dict[str, Any], policy: Policy) -> tuple[Result, list[Any]]:
    """One run: on a pty of its own (--tty), or with its output passed through, after which a
    terminal it went to is settled: what the sandbox wrote reached it raw (docs/cli.md)."""
    if o.get("tty"):
        return _launch_on_terminal(o, policy), []
    try:
        return _launch_piped(o, policy)
    finally:
        settle_terminal()  # also when the run failed after some output


def _launch_piped(o: dict[str, Any], policy: Policy) -> tuple[Result, list[Any]]:
    """In a session where the run needs one (a project, --ask, --collect), else by
    ``nsbox.run``; the files collected, if any."""
    as_json = o["as_json"]
    # The caller's terminal is never handed in (a command could change its modes, stty -echo,
    # or read what was typed for the shell): stdin is /dev/null then; --tty gives a pty.
    stdin = None if os.isatty(0) else 0
    common: dict[str, Any] = {"stdin": stdin, "cwd": o["cwd"],
                              "passthrough": not as_json, "audit": o["audit"]}
    command = list(o["command"])
    if policy.project is not None or o.get("ask"):
        from nsbox.cli.oneshot import run_in_project

        return run_in_project(command, policy, ask=bool(o.get("ask")), **common), []
    if o["collect"]:
        from nsbox.cli.oneshot import run_and_collect

        result, collected, skipped = run_and_collect(
            command, policy, patterns=o["collect"], dest=o["collect_dir"], **common)
        settle_terminal()
        for path, why in skipped:
            echo(f"nsbox: not collected: {visible.quoted(path)}: {visible.name(why)}", err=True)
        return result, collected
    return nsbox.run(command, policy, **common), []


def _launch_on_terminal(o: dict[str, Any], policy: Policy) -> Result:
    """--tty: the command on a pty of the sandbox's own, relayed to this terminal."""
    from nsbox.api import run_cancellable
    from nsbox.host.terminal import Relay
    from nsbox.launch import launcher

    if policy.project is not None or o.get("ask") or o["collect"] or o["audit"]:
        raise OptionError("--tty does not go with --project, --ask, --collect or --audit",
                          "--tty")
    cancel = launcher.Cancel()
    with Relay(cap=policy.limits.output, on_cap=cancel) as relay:
        result = run_cancellable(list(o["command"]), policy, stdin=relay.sandbox_end,
                                 cwd=o["cwd"], tty=relay.size, cancel=cancel)
    if relay.cut:  # killed past the output limit, as a run with pipes is (status OL)
        result.status, result.stdout_truncated = Status.OL, True
    return result


def _failed(raised: NsboxError | OSError, as_json: bool, o: dict[str, Any],
            policy: Policy | None) -> int:
    # An OSError is the host refusing something the options name (a path this user may not
    # resolve, say): a message, not a traceback.
    error = raised if isinstance(raised, NsboxError) else NsboxError(
        f"{raised.strerror or raised}" + (f": {raised.filename}" if raised.filename else ""))
    from nsbox.cli.origins import Origins

    error = Origins.of(o, policy).translate(error)  # in the options' terms, not the policy's
    if as_json:
        echo(visible.json_text(failure_json(error)))
    return fail_code(error)


def failure_json(error: NsboxError) -> dict[str, Any]:
    """--json of a run that did not start: the keys of every other result (null where there
    is no value), so that a reader finds ``exit_code`` whatever happened."""
    import dataclasses

    data: dict[str, Any] = {field.name: None for field in dataclasses.fields(Result)}
    data.update(status=Status.XX.value, error=str(error), stdout="", stderr="")
    return data
