"""The profile schema: every key, how its value is checked, and which Policy field it fills.

One table (FIELDS) describes the scalar keys; mounts and seccomp rules, being ordered lists of
tables, have their own parsers below (a mount's keys are its class's fields, policy.MOUNT_KINDS).
The same parsers check profile files and the caller's overrides, so both doors lead to the same
validated values. Defaults are Policy's field defaults.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import math
import os
import posixpath
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nsbox.errors import PolicyError, suggest
from nsbox.host import seccomp_compile
from nsbox.policy import limittable, rules, units
from nsbox.policy.limittable import LimitSpec
from nsbox.policy.policy import MOUNT_KINDS, Bind, Mount, SeccompArg, SeccompRule
from nsbox.profiles.writers import format_duration, format_size, none_or

# --- where an error is reported ------------------------------------------------------------------


class Origin:
    """The file (or the caller's options) that values come from, for error messages."""

    def __init__(self, file: str | None, line_of: Callable[[str], int | None] | None = None,
                 base_dir: str | None = None) -> None:
        self.file = file
        self._line_of = line_of
        self.base_dir = base_dir

    def error(self, key: str, message: str, hint: str | None = None,
              rule: str | None = None) -> PolicyError:
        line = self._line_of(key) if self._line_of else None
        return PolicyError(message, key=key, file=self.file, line=line, hint=hint, rule=rule)


# --- value parsers: (origin, key, raw TOML value) -> Policy value --------------------------------

Parser = Callable[[Origin, str, Any], Any]

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "a table"}


def type_name(raw: Any) -> str:
    return _TYPE_NAMES.get(type(raw), type(raw).__name__)


def expect(origin: Origin, key: str, raw: Any, kind: type | tuple[type, ...], what: str) -> None:
    # bool is an int in Python; TOML keeps them apart, and so do we.
    if isinstance(raw, bool) and kind is not bool and bool not in (
            kind if isinstance(kind, tuple) else (kind,)):
        raise origin.error(key, f"expected {what}, got a boolean ({str(raw).lower()})")
    if not isinstance(raw, kind):
        raise origin.error(key, f"expected {what}, got {type_name(raw)} ({raw!r})")


def boolean(origin: Origin, key: str, raw: Any) -> bool:
    expect(origin, key, raw, bool, "true or false")
    return bool(raw)


def string(origin: Origin, key: str, raw: Any) -> str:
    expect(origin, key, raw, str, "a string")
    if "\0" in raw:
        raise origin.error(key, "contains a NUL character")
    return str(raw)


def integer(low: int, high: int = 2**63 - 1, why: str = "") -> Parser:
    def parse(origin: Origin, key: str, raw: Any) -> int:
        expect(origin, key, raw, int, "an integer")
        if not low <= raw <= high:
            bound = f"at least {low}" if high == 2**63 - 1 else f"{low}..{high}"
            raise origin.error(key, f"{raw} is out of range (must be {bound}{why})")
        return int(raw)
    return parse


def number(origin: Origin, key: str, raw: Any) -> float:
    expect(origin, key, raw, (int, float), "a number")
    if not math.isfinite(raw) or raw <= 0:
        raise origin.error(key, f"must be a positive number, got {raw}")
    return float(raw)


def size(minimum: int = 1) -> Parser:
    """Bytes as an integer or a string with a binary unit: 4096, "512K", "256M", "1.5G"."""
    def parse(origin: Origin, key: str, raw: Any) -> int:
        expect(origin, key, raw, (int, str), 'a size such as "256M" or a number of bytes')
        try:
            value = units.parse_size(limittable.ascii_only(raw))
        except ValueError as exc:
            raise origin.error(key, str(exc)) from None
        if value < minimum:
            raise origin.error(key, f"must be at least {minimum} byte{'s' * (minimum != 1)}, "
                               f"got {raw!r}")
        return value
    return parse


def duration(origin: Origin, key: str, raw: Any) -> float:
    """Seconds as a number or a string with a unit: 10, 2.5, "500ms", "10s", "2m", "1h"."""
    expect(origin, key, raw, (int, float, str), 'a duration such as "10s" or a number of seconds')
    try:
        value = units.parse_duration(limittable.ascii_only(raw))
    except ValueError as exc:
        raise origin.error(key, str(exc)) from None
    if not math.isfinite(value) or value <= 0:
        raise origin.error(key, f"must be a positive duration, got {raw!r}")
    return value


def nullable(parser: Parser) -> Parser:
    """The string "none" (TOML has no null) means "no limit of this kind"."""
    def parse(origin: Origin, key: str, raw: Any) -> Any:
        if raw is None or raw == "none":
            return None
        return parser(origin, key, raw)
    return parse


def choice(*choices: str) -> Parser:
    def parse(origin: Origin, key: str, raw: Any) -> str:
        value = string(origin, key, raw)
        if value not in choices:
            raise origin.error(key, f"{value!r} is not one of {', '.join(choices)}",
                               suggest(value, choices))
        return value
    return parse


def mode(origin: Origin, key: str, raw: Any) -> int:
    """File mode bits: a TOML integer (0o755) or an octal string ("0755")."""
    expect(origin, key, raw, (int, str), 'a mode such as 0o755 or "0755"')
    try:
        value = int(raw, 8) if isinstance(raw, str) else raw
    except ValueError:
        raise origin.error(key, f"{raw!r} is not an octal mode", 'write it as "0755"') from None
    if not 0 <= value <= 0o7777:
        raise origin.error(key, f"{raw!r} is not a file mode (0..0o7777)")
    return int(value)


ENV_NAME = rules.ENV_NAME


def pattern(regex: re.Pattern[str], what: str) -> Parser:
    def parse(origin: Origin, key: str, raw: Any) -> str:
        value = string(origin, key, raw)
        if not regex.match(value):
            raise origin.error(key, f"{value!r} is not {what}")
        return value
    return parse


def identity_text(which: str) -> Parser:
    """A user or host name, as the rule identity-text of nsbox/policy/rules.py takes it."""
    def parse(origin: Origin, key: str, raw: Any) -> str:
        expect(origin, key, raw, str, "a string")  # NUL too is the rule's business
        value = str(raw)
        names = {"user": value, "hostname": "nsbox"} if which == "user" else {
            "user": "sandbox", "hostname": value}
        ruled(origin, rules.check_identity, names["user"], names["hostname"])
        return value
    return parse


def allow_rules(origin: Origin, key: str, raw: Any) -> tuple[str, ...]:
    expect(origin, key, raw, list, 'an array of rule names such as ["bind-run"]')
    return tuple(ruled(origin, rules.check_allow, raw, key))


def env_names(origin: Origin, key: str, raw: Any) -> tuple[str, ...]:
    expect(origin, key, raw, list, "an array of variable names")
    for i, name in enumerate(raw):
        pattern(ENV_NAME, "a variable name")(origin, f"{key}[{i}]", name)
    return tuple(raw)


def patterns(origin: Origin, key: str, raw: Any) -> tuple[str, ...]:
    expect(origin, key, raw, list, "an array of file name patterns")
    for i, item in enumerate(raw):
        string(origin, f"{key}[{i}]", item)
    return tuple(raw)


def env_table(origin: Origin, key: str, raw: Any) -> dict[str, str]:
    expect(origin, key, raw, dict, 'a table of NAME = "value"')
    for name, value in raw.items():
        if not ENV_NAME.match(name):
            raise origin.error(f"{key}.{name}", f"{name!r} is not a variable name")
        if name in ("PATH", "LANG"):
            raise origin.error(f"{key}.{name}", f"{name} has its own key",
                               f"set environment.{name.lower()} instead")
        string(origin, f"{key}.{name}", value)
    return dict(raw)


# --- paths ---------------------------------------------------------------------------------------

def target_path(origin: Origin, key: str, raw: Any, kind: str = "bind") -> str:
    """A path inside the sandbox: absolute, without "..", not the root or a reserved tree
    (rules target-path, target-reserved, nsbox-files of nsbox/policy/rules.py)."""
    value = string(origin, key, raw)
    return ruled(origin, rules.check_target, value, key, kind)


def ruled(origin: Origin, check: Callable[..., Any], *args: Any) -> Any:
    """Run a check of the rule book, its error placed in the origin's file and line."""
    try:
        return check(*args)
    except PolicyError as exc:
        raise origin.error(exc.key or "", exc.message, exc.hint, rule=exc.rule) from None


def host_path(origin: Origin, key: str, raw: Any) -> str:
    """An absolute host path, canonical: the directories leading to it are resolved now (with
    rules.resolve), so no later change to a symlink on the way can redirect the mount. The last
    component is kept as it is; ``mount`` decides whether a symlink there is resolved too."""
    value = points_to(origin, key, raw)  # a string, not empty (not "the directory")
    if value.startswith("~"):
        raise origin.error(key, f"{value!r}: ~ is not expanded in profiles",
                           "write the absolute path")
    if not value.startswith("/"):
        if origin.base_dir is None:
            raise origin.error(key, f"{value!r} is a relative path; host paths are absolute")
        value = os.path.join(origin.base_dir, value)
    parent, name = posixpath.split(value.rstrip("/"))
    if name in ("", ".", ".."):
        return str(ruled(origin, rules.resolve, value, key))
    return posixpath.join(str(ruled(origin, rules.resolve, parent or "/", key)), name)


def host_dir(origin: Origin, key: str, raw: Any) -> str:
    """A host directory the sandbox may write, resolved; the rule book (with the policy's
    allow_rules) and check_dir judge it when it is applied."""
    return str(ruled(origin, rules.resolve, host_path(origin, key, raw), key))


def check_dir(origin: Origin, key: str, value: str) -> None:
    if not os.path.isdir(value):
        raise origin.error(key, f"{value} does not exist or is not a directory", "create it first")


# --- mounts --------------------------------------------------------------------------------------

def points_to(origin: Origin, key: str, raw: Any) -> str:
    value = string(origin, key, raw)
    if not value:
        raise origin.error(key, "is empty")
    return value


# The parser of a mount's field (its class is in policy.MOUNT_KINDS) by the field's name, else by
# its type: a new kind whose fields are of these sorts is read with no edit here.
MOUNT_FIELDS: dict[str, Parser] = {"source": host_path, "size": size(), "mode": mode,
                                   "points_to": points_to}
MOUNT_FIELD_TYPES: dict[str, Parser] = {"bool": boolean, "str": string, "int": integer(0)}


def mount_field_parser(kind: str, item: dataclasses.Field[Any]) -> Parser:
    # policy.py has postponed annotations, so a field's type is its source text ("bool").
    parser = MOUNT_FIELDS.get(item.name) or MOUNT_FIELD_TYPES.get(str(item.type))
    if parser is None:
        raise TypeError(f"mount kind {kind!r}: no profile parser for its field {item.name!r} "
                        f"({item.type}); add one to MOUNT_FIELDS or MOUNT_FIELD_TYPES")
    return parser


def check_keys(origin: Origin, key: str, table: dict[str, Any], known: Iterable[str]) -> None:
    known = tuple(known)
    for name in table:
        if name not in known:
            raise origin.error(f"{key}.{name}" if key else name, "unknown key",
                               suggest(name, known))


def require(origin: Origin, key: str, table: dict[str, Any], name: str) -> Any:
    if name not in table:
        raise origin.error(key, f'missing "{name}"')
    return table[name]


def mount(origin: Origin, key: str, raw: Any) -> Mount:
    """A mount's table: "type" picks the kind; a field without a default is required."""
    expect(origin, key, raw, dict, "a table")
    kind = choice(*MOUNT_KINDS)(origin, f"{key}.type", require(origin, key, raw, "type"))
    fields = [f for f in dataclasses.fields(MOUNT_KINDS[kind]) if f.name != "kind"]
    check_keys(origin, key, raw, ("type", *(f.name for f in fields)))
    target = target_path(origin, f"{key}.target", require(origin, key, raw, "target"), kind)
    values: dict[str, Any] = {"target": target}
    # The flags first: a table with two errors reports the one it always has (a bind's source).
    for item in sorted((f for f in fields if f.name != "target"), key=lambda f: f.type != "bool"):
        if item.name in raw:
            parse = mount_field_parser(kind, item)
            values[item.name] = parse(origin, f"{key}.{item.name}", raw[item.name])
        elif item.default is dataclasses.MISSING:
            raise origin.error(key, f'missing "{item.name}"')
    if "source" in values:
        values["source"] = bound_source(values["source"], target, values.get("writable", False))
    return MOUNT_KINDS[kind](**values)


def bound_source(source: str, target: str, writable: bool) -> str:
    """A bind's source, a symlink resolved now unless the launch reproduces it (read-only onto
    the same path: /bin -> usr/bin). The rules check it when applied and again at plan time."""
    if os.path.islink(source) and (writable or source != target):
        return os.path.realpath(source)
    return source


def check_exists(origin: Origin, key: str, mount: Mount) -> None:
    """A bind's source must exist unless the mount is optional."""
    if isinstance(mount, Bind) and not mount.optional and not os.path.lexists(mount.source):
        raise origin.error(f"{key}.source", f"{mount.source} does not exist",
                           "fix the path, or set optional = true to skip it when missing")


# --- seccomp -------------------------------------------------------------------------------------

ACTIONS = ("allow", "kill")  # and errno:NAME
RULE_KEYS = ("syscall", "action", "args")
ARG_KEYS = ("index", "op", "value", "mask")


@functools.lru_cache(maxsize=1)
def _libseccomp() -> Any:  # a ctypes.CDLL, or None; ctypes only for a profile's rules
    import ctypes  # directly: importing pyseccomp costs ~35 ms (it runs ldconfig)
    try:
        return ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return None


def known_syscall(name: str) -> bool:
    """Whether libseccomp knows the name, on any architecture (``vm86`` passes on x86_64, a
    no-op, docs/seccomp.md); without libseccomp every name passes (the compiler refuses it)."""
    lib = _libseccomp()  # seccomp_syscall_resolve_name(3): -1 (__NR_SCMP_ERROR) if unknown
    return lib is None or lib.seccomp_syscall_resolve_name(name.encode()) != -1


@functools.lru_cache(maxsize=1)
def native_syscall_names() -> frozenset[str]:
    """The native architecture's syscall names, for "did you mean" (empty without libseccomp)."""
    lib = _libseccomp()
    if lib is None:
        return frozenset()
    import ctypes  # loaded by _libseccomp already
    resolve = lib.seccomp_syscall_resolve_num_arch
    resolve.restype = ctypes.c_void_p
    pointers = (resolve(0, number) for number in range(1024))  # 0: SCMP_ARCH_NATIVE
    return frozenset(ctypes.string_at(p).decode() for p in pointers if p)


def action(origin: Origin, key: str, raw: Any) -> str:
    """allow, kill or errno:NAME, as the filter compiler (host/seccomp_compile.py) reads them."""
    value = string(origin, key, raw)
    try:
        seccomp_compile.parse_action(value, key)
    except PolicyError as exc:
        kind, _, name = value.partition(":")
        hint = (suggest(name, errno.errorcode.values()) if kind == "errno"
                else suggest(value, ACTIONS))
        raise origin.error(key, exc.message, hint or exc.hint) from None
    return value


def rule(origin: Origin, key: str, raw: Any) -> SeccompRule:
    expect(origin, key, raw, dict, "a table")
    check_keys(origin, key, raw, RULE_KEYS)
    name = string(origin, f"{key}.syscall", require(origin, key, raw, "syscall"))
    if not known_syscall(name):
        raise origin.error(f"{key}.syscall", f"{name!r} is not a system call libseccomp knows",
                           suggest(name, native_syscall_names()))
    act = action(origin, f"{key}.action", require(origin, key, raw, "action"))
    args = raw.get("args", [])
    expect(origin, f"{key}.args", args, list, "an array of tables")
    parsed = tuple(rule_arg(origin, f"{key}.args[{i}]", a) for i, a in enumerate(args))
    for i, arg in enumerate(parsed):  # libseccomp's rule; so no more than 6 (index 0..5)
        if arg.index in (a.index for a in parsed[:i]):
            raise origin.error(f"{key}.args[{i}].index", f"argument {arg.index} is already "
                               "compared in this rule (one comparison per argument)",
                               "write another rule for the same syscall for another value")
    return SeccompRule(name, act, parsed)


def rule_arg(origin: Origin, key: str, raw: Any) -> SeccompArg:
    expect(origin, key, raw, dict, "a table such as { index = 0, op = \"eq\", value = 1 }")
    check_keys(origin, key, raw, ARG_KEYS)
    index = integer(0, 5)(origin, f"{key}.index", require(origin, key, raw, "index"))
    op = choice(*seccomp_compile.OPS)(origin, f"{key}.op", require(origin, key, raw, "op"))
    value = integer(0, 2**64 - 1)(origin, f"{key}.value", require(origin, key, raw, "value"))
    if "mask" in raw and op != "masked_eq":
        raise origin.error(f"{key}.mask", 'a mask is only used with op = "masked_eq"')
    mask = integer(0, 2**64 - 1)(origin, f"{key}.mask", raw.get("mask", 0))
    return SeccompArg(index, op, value, mask)


# --- network -------------------------------------------------------------------------------------

def allow_list(origin: Origin, key: str, raw: Any) -> tuple[str, ...]:
    """``host[:port]`` entries, checked one by one by the proxy's own rules
    (nsbox/policy/netrules.py), so an error names the entry's index and line."""
    from nsbox.policy import netrules  # loads ipaddress; only profiles with an allow-list need it

    expect(origin, key, raw, list, 'an array of "host[:port]"')
    for i, entry in enumerate(raw):
        item_key = f"{key}[{i}]"
        try:
            netrules.parse_entry(string(origin, item_key, entry))
        except PolicyError as exc:
            raise origin.error(item_key, exc.message, exc.hint) from None
    return tuple(raw)


# --- the scalar keys -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    attr: tuple[str, ...]  # where the value goes in a Policy, e.g. ("limits", "memory")
    parse: Parser
    to_toml: Callable[[Any], Any] = lambda value: value


# The parser and TOML form of each kind of limit in nsbox/policy/limittable.py.
_LIMIT_KINDS: dict[str, tuple[Callable[[LimitSpec], Parser], Callable[[Any], Any]]] = {
    limittable.SIZE: (lambda spec: size(spec.low), format_size),
    limittable.DURATION: (lambda spec: duration, format_duration),
    limittable.COUNT: (lambda s: integer(s.low, s.high, limittable.why_low(s)), int),
    limittable.SHARE: (lambda spec: number, float),
    limittable.FLAG: (lambda spec: boolean, bool),
}


def limit_fields(prefix: str) -> dict[str, Field]:
    """The keys of the limits whose key starts with ``prefix``, from the table of limits."""
    fields = {}
    for spec in limittable.LIMITS:
        if not spec.key.startswith(prefix):
            continue
        make, fmt = _LIMIT_KINDS[spec.kind]
        parse = make(spec)
        if spec.nullable:
            parse, fmt = nullable(parse), none_or(fmt)
        fields[spec.key] = Field(("limits", spec.name), parse, fmt)
    return fields


FIELDS: dict[str, Field] = {
    "description": Field(("description",), string),
    "isolation": Field(("isolation",), choice("auto", "namespaces", "landlock")),
    # Before every key whose value a rule may refuse: a layer applies its keys in this order.
    "allow_rules": Field(("allow_rules",), allow_rules, list),
    "environment.set": Field(("env",), env_table, dict),
    "environment.passthrough": Field(("env_passthrough",), env_names, list),
    "environment.path": Field(("path",), string),
    "environment.lang": Field(("lang",), string),
    "identity.uid": Field(("uid",), integer(0, 2**32 - 2)),
    "identity.gid": Field(("gid",), integer(0, 2**32 - 2)),
    "identity.user": Field(("user",), identity_text("user")),
    "identity.hostname": Field(("hostname",), identity_text("hostname")),
    # Never host uid/gid 0: a kernel bug that leaks a file must land as nobody (DESIGN.md).
    "identity.host_uid": Field(("host_uid",), integer(1, 2**32 - 2)),
    "identity.host_gid": Field(("host_gid",), integer(1, 2**32 - 2)),
    **limit_fields("limits."),
    "network.mode": Field(("network", "mode"), choice("none", "loopback", "allow")),
    "network.allow": Field(("network", "allow"), allow_list, list),
    "network.proxy_port": Field(("network", "proxy_port"), integer(1, 65535)),
    "network.max_connections": Field(("network", "max_connections"), integer(1)),
    "network.max_bytes": Field(("network", "max_bytes"), size(), format_size),
    "network.connect_timeout": Field(("network", "connect_timeout"), duration, format_duration),
    "network.idle_timeout": Field(("network", "idle_timeout"), duration, format_duration),
    "seccomp.enabled": Field(("seccomp", "enabled"), boolean),
    "seccomp.default_action": Field(("seccomp", "default_action"), action),
    "seccomp.log_denied": Field(("seccomp", "log_denied"), boolean),
    "workspace.path": Field(("workspace",), nullable(host_dir), none_or(str)),
    **limit_fields("workspace."),
    "workspace.project": Field(("project",), nullable(host_dir), none_or(str)),
    "workspace.secrets": Field(("project_secrets",), patterns, list),
}

# Keys that hold ordered lists of tables, and the switch that drops inherited mounts.
LIST_KEYS = ("filesystem.mounts", "seccomp.rules")
SECTIONS = ("filesystem", "environment", "identity", "limits", "network", "seccomp", "workspace")
TOP_KEYS = ("description", "extends", "allow_rules", "isolation", *SECTIONS)
ALL_KEYS = (*FIELDS, *LIST_KEYS, "filesystem.inherit", "extends")
