"""Profiles: TOML files that describe a sandbox, loaded into an immutable Policy.

A profile is either the name of one shipped with nsbox (nsbox/profiles/NAME.toml) or the path
of a file the caller gives. Profiles are read only from those two places, never from the
working directory or anything a sandbox can write, so no sandbox can change the next one's
policy. ``extends = "NAME"`` (or a path, relative to the extending file) loads the parent first;
each file is checked on its own, so an error names the file, the key and the line it is on.

    policy = load_profile("python")
    policy = apply_overrides(policy, {"limits.memory": "1G", "network.mode": "loopback"})
    print(to_toml(policy))

The schema (every key, its default and an example) is docs/profiles.md; the keys and their
checks are in nsbox/profiles/schema.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nsbox.errors import PolicyError
from nsbox.policy import rules as rule_book
from nsbox.policy.policy import MOUNT_KINDS, Mount, Policy, SeccompRule
from nsbox.profiles import schema, writers
from nsbox.profiles import tomltext as _tomltext

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


# --- one file, checked: a layer of values to put on top of its parent ----------------------------


@dataclass
class Layer:
    origin: schema.Origin
    values: dict[str, Any] = field(default_factory=dict)  # FIELDS key -> parsed value
    inherit_mounts: bool = True
    mounts: list[tuple[str, Mount]] = field(default_factory=list)  # (key, mount)
    rules: list[SeccompRule] = field(default_factory=list)


def parse_layer(data: Mapping[str, Any], origin: schema.Origin) -> Layer:
    """Check one profile's (or the caller's overrides') keys and values."""
    layer = Layer(origin)
    schema.check_keys(origin, "", dict(data), schema.TOP_KEYS)
    for section in schema.SECTIONS:
        if section in data:
            schema.expect(origin, section, data[section], dict, f"a table [{section}]")
            known = [k.split(".", 1)[1] for k in schema.ALL_KEYS if k.startswith(section + ".")]
            schema.check_keys(origin, section, data[section], known)
    for key, spec in schema.FIELDS.items():
        section, _, name = key.rpartition(".")
        table = data.get(section, {}) if section else data
        if name in table:
            layer.values[key] = spec.parse(origin, key, table[name])
    filesystem = data.get("filesystem", {})
    if "inherit" in filesystem:
        layer.inherit_mounts = schema.boolean(origin, "filesystem.inherit", filesystem["inherit"])
    seen: dict[str, str] = {}
    for i, raw in enumerate(_array(origin, "filesystem.mounts", filesystem.get("mounts", []))):
        key = f"filesystem.mounts[{i}]"
        mount = schema.mount(origin, key, raw)
        if mount.target in seen:
            raise origin.error(f"{key}.target", f"{mount.target} is already the target of "
                               f"{seen[mount.target]}")
        seen[mount.target] = key
        layer.mounts.append((key, mount))
    rules = _array(origin, "seccomp.rules", data.get("seccomp", {}).get("rules", []))
    layer.rules = [schema.rule(origin, f"seccomp.rules[{i}]", raw) for i, raw in enumerate(rules)]
    return layer


def _array(origin: schema.Origin, key: str, raw: Any) -> list[Any]:
    schema.expect(origin, key, raw, list, f"an array of tables ([[{key}]])")
    return list(raw)


def apply_layer(policy: Policy, layer: Layer) -> Policy:
    """The policy with the layer's values on top: scalars replace, ``environment.set`` merges,
    mounts and seccomp rules are appended (a mount at an existing target replaces that one)."""
    origin = layer.origin
    for key, value in layer.values.items():
        spec = schema.FIELDS[key]
        if key == "environment.set":
            value = tuple({**dict(policy.env), **value}.items())
        if key == "workspace.path" and value is not None:
            schema.ruled(origin, rule_book.check_spelling, value, True, policy.allow_rules, key)
            schema.check_dir(origin, key, value)
        if key == "workspace.project" and value is not None:
            schema.ruled(origin, rule_book.check_spelling, value, False, policy.allow_rules,
                         key)
            schema.check_dir(origin, key, value)
        value = tuple(value) if isinstance(value, list) else value
        policy = schema.ruled(origin, _set, policy, spec.attr, value)
    mounts = list(policy.mounts) if layer.inherit_mounts else []
    for key, mount in layer.mounts:
        # The rule book, with this policy's allow_rules, so the error names this file's line.
        schema.ruled(origin, rule_book.check_mount, mount, policy.allow_rules, key)
        schema.check_exists(origin, key, mount)
        targets = [m.target for m in mounts]
        if mount.target in targets:
            mounts[targets.index(mount.target)] = mount
        else:
            mounts.append(mount)
        _check_not_hidden(origin, key, mounts, mount)
    final = tuple(mounts)
    policy = schema.ruled(origin, lambda: policy.replace(mounts=final))
    if layer.rules:
        rules = (*policy.seccomp.rules, *layer.rules)
        policy = policy.replace(seccomp=dataclasses.replace(policy.seccomp, rules=rules))
    return policy


def _set(policy: Any, attr: tuple[str, ...], value: Any) -> Any:
    if len(attr) == 1:
        return dataclasses.replace(policy, **{attr[0]: value})
    inner = _set(getattr(policy, attr[0]), attr[1:], value)
    return dataclasses.replace(policy, **{attr[0]: inner})


def _check_not_hidden(origin: schema.Origin, key: str, mounts: list[Mount], new: Mount) -> None:
    """Mounts apply in order: one below an earlier target is fine, one that a later mount
    would cover is a mistake (its content could never be seen)."""
    where = mounts.index(new)
    for later in mounts[where + 1:]:
        if new.target.startswith(later.target + "/"):
            raise origin.error(f"{key}.target", f"{new.target} would be hidden by the mount at "
                               f"{later.target}, which comes later",
                               f"list {new.target} after {later.target}")
    for earlier in mounts[:where]:
        if earlier.target.startswith(new.target + "/"):
            raise origin.error(f"{key}.target", f"the mount at {new.target} would hide the "
                               f"earlier mount at {earlier.target}",
                               f"list {earlier.target} after {new.target}")


# --- finding and reading profile files -----------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """Where one profile's text comes from: the package's data (also inside nsbox.pyz) or a
    file the caller named."""

    display: str  # for messages: "profiles/python.toml" or the file's path
    path: str  # a file, or a path inside the package (which may be a zip archive)
    base_dir: str | None  # relative host paths and extends are taken from here (files only)

    def read_text(self) -> str:
        if self.base_dir is not None:
            return _read_file(self.path, self.display)
        # The package's loader reads from a directory and from a zip archive alike, and costs
        # no import (importlib.resources takes ~5 ms, on every `nsbox run`).
        assert __spec__ is not None and __spec__.loader is not None
        data: bytes = __spec__.loader.get_data(self.path)  # type: ignore[attr-defined]
        return data.decode("utf-8")


MAX_PROFILE = 1024 * 1024  # bytes; the shipped profiles are about 2 KB
MAX_DEPTH = 32  # nested tables and arrays; the schema's deepest is 4


def _read_file(path: str, display: str) -> str:
    """A profile file's text; a FIFO (it would block), a device (/dev/zero would never end) or
    a file over MAX_PROFILE is refused before anything is read."""
    # O_NONBLOCK: opening a FIFO without a writer would block (fifo(7)).
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PolicyError("a profile must be a regular file, not a FIFO, device, socket or "
                              "directory", file=display)
        if st.st_size > MAX_PROFILE:
            raise PolicyError(f"the profile is too large ({st.st_size} bytes; at most "
                              f"{MAX_PROFILE})", file=display)
        data = os.read(fd, MAX_PROFILE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_PROFILE:
        raise PolicyError(f"the profile is too large (at most {MAX_PROFILE} bytes)", file=display)
    return data.decode("utf-8")


def _check_depth(data: Any, display: str) -> None:
    """Refuse values nested deeper than MAX_DEPTH (walked without recursion)."""
    stack: list[tuple[Any, int, str]] = [(data, 0, "")]
    while stack:
        value, depth, key = stack.pop()
        if depth > MAX_DEPTH:
            raise PolicyError(f"nested more than {MAX_DEPTH} levels deep", key=key or None,
                              file=display)
        if isinstance(value, dict):
            stack.extend((v, depth + 1, f"{key}.{k}" if key else str(k)[:100])
                         for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, depth + 1, key) for v in value)


def shipped_source(name: str) -> _Source:
    path = os.path.join(os.path.dirname(__file__), f"{name}.toml")
    return _Source(f"profiles/{name}.toml", path, None)


def shipped_profiles() -> list[str]:
    import importlib.resources

    directory = importlib.resources.files("nsbox").joinpath("profiles")
    return sorted(p.name[:-len(".toml")] for p in directory.iterdir() if p.name.endswith(".toml"))


def _is_path(ref: str) -> bool:
    return "/" in ref or ref.endswith(".toml")


def _locate(ref: str, origin: schema.Origin | None, key: str) -> _Source:
    if _is_path(ref):
        # os.path, not pathlib: pathlib's import alone costs ~2.5 ms of every `nsbox run`.
        path = ref
        if not os.path.isabs(path) and origin is not None and origin.base_dir:
            path = os.path.join(origin.base_dir, path)
        path = os.path.realpath(path)
        return _Source(path, path, os.path.dirname(path))
    # A name is only ever a file of the package: no "/", no "..", nothing else searched.
    if _NAME.match(ref) and _exists(shipped_source(ref)):
        return shipped_source(ref)
    names = shipped_profiles()
    hint = schema.suggest(ref, names) or f"shipped profiles: {', '.join(names)}; or give a path"
    message = f"no shipped profile named {ref!r}"
    if origin is None:
        raise PolicyError(message, hint=hint)
    raise origin.error(key, message, hint)


def _exists(source: _Source) -> bool:
    try:
        source.read_text()
    except OSError:
        return False
    return True


def toml() -> Any:
    """tomllib (tomli before Python 3.11), imported only when a TOML text is parsed here."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib


def __getattr__(name: str) -> Any:
    if name == "tomllib":  # what ``from nsbox.profiles import tomllib`` gave before
        return toml()
    raise AttributeError(f"module 'nsbox.profiles' has no attribute {name!r}")


# The shipped profiles' values as tomllib gives them, written when the package is built
# (nsbox/profiles/programs.py): {display name: {"text": the file's text, "data": its values}}.
# Used only for a text equal to the file's own, so that a run of a shipped profile imports
# no TOML parser (~4 ms); any other text, or no such file (a plain source tree), is parsed.
PARSED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parsed.json")
_parsed: dict[str, Any] | None = None


def _parsed_already(source: _Source, text: str) -> dict[str, Any] | None:
    global _parsed
    if source.base_dir is not None:  # a file of the caller's
        return None
    if _parsed is None:
        try:
            assert __spec__ is not None and __spec__.loader is not None
            _parsed = json.loads(__spec__.loader.get_data(PARSED))  # type: ignore[attr-defined]
        except (OSError, ValueError):
            _parsed = {}
    entry = _parsed.get(source.display) if isinstance(_parsed, dict) else None
    if isinstance(entry, dict) and entry.get("text") == text and isinstance(entry.get("data"),
                                                                              dict):
        return entry["data"]
    return None


def _read(source: _Source) -> tuple[dict[str, Any], schema.Origin]:
    try:
        text = source.read_text()
    except FileNotFoundError:
        raise PolicyError("profile file not found", file=source.display,
                          hint="give an existing file or a shipped profile's name") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"cannot read the profile: {exc}", file=source.display) from None
    data = _parsed_already(source, text)
    if data is None:
        data = _parse(text, source.display)
    _check_depth(data, source.display)
    return data, schema.Origin(source.display, _tomltext.KeyLines(text).line, source.base_dir)


def _parse(text: str, display: str) -> dict[str, Any]:
    tomllib = toml()
    try:
        data: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = re.search(r"line (\d+)", str(exc))
        raise PolicyError(f"not valid TOML: {exc}", file=display,
                          line=int(match.group(1)) if match else None) from None
    except RecursionError:
        raise PolicyError(f"nested more than {MAX_DEPTH} levels deep", file=display) from None
    return data


def load_layers(ref: str) -> tuple[str, list[Layer]]:
    """The chain of layers for a profile, root first, and the profile's name."""
    chain: list[Layer] = []
    seen: list[str] = []
    source = _locate(ref, None, "extends")
    extending: schema.Origin | None = None  # the file whose ``extends`` named this one
    while True:
        if source.display in seen:
            cycle = " -> ".join([*seen, source.display])
            raise chain[-1].origin.error("extends", f"profiles extend each other in a cycle: "
                                         f"{cycle}")
        seen.append(source.display)
        try:
            data, origin = _read(source)
        except PolicyError as exc:  # the file itself (missing, unreadable): the extends' error
            if extending is None or exc.line is not None or exc.key is not None:
                raise
            raise extending.error("extends", f"{source.display}: {exc.message}",
                                  exc.hint) from None
        chain.append(parse_layer(data, origin))
        parent = data.get("extends")
        if parent is None:
            break
        parent = schema.string(origin, "extends", parent)
        source, extending = _locate(parent, origin, "extends"), origin
    name = ref if not _is_path(ref) else os.path.splitext(os.path.basename(ref))[0]
    return name, chain[::-1]


def load_profile(ref: str, overrides: Mapping[str, Any] | None = None) -> Policy:
    """The Policy of a shipped profile's name or a profile file's path, with optional
    overrides applied (see apply_overrides)."""
    name, layers = load_layers(ref)
    policy = Policy(name=name)
    for layer in layers:
        policy = apply_layer(policy, layer)
    return apply_overrides(policy, overrides) if overrides else policy


def profile_description(name: str) -> str:
    """The first line of a shipped profile's description (its parents are not loaded)."""
    data, _ = _read(shipped_source(name))
    lines = str(data.get("description", "")).strip().splitlines()
    return lines[0] if lines else ""


# --- overrides: the caller's options, on the same keys -------------------------------------------

# Short names for the keys callers set most; each is unique in the schema.
ALIASES = {
    **{k.rpartition(".")[2]: k for k in schema.FIELDS if k.startswith(("limits.", "identity."))},
    "network": "network.mode",
    "allow": "network.allow",
    "workspace": "workspace.path",
    "workspace_size": "workspace.size",
    "env": "environment.set",
    "passthrough": "environment.passthrough",
    "mounts": "filesystem.mounts",
    "seccomp": "seccomp.enabled",
}


def apply_overrides(policy: Policy, overrides: Mapping[str, Any]) -> Policy:
    """Apply the caller's overrides (CLI options, API keyword arguments) to a policy.

    Keys are schema keys ("limits.memory") or their short names ("memory"); values take the
    same forms as in a profile ("1G", "10s", "none" for no limit) and are checked the same way.
    ``None`` also means "no limit". Mounts (tables like a profile's, or Bind/Tmpfs/... objects)
    are appended; relative host paths are taken from the current directory.
    """
    data: dict[str, Any] = {}
    for name, value in overrides.items():
        key = ALIASES.get(name, name)
        if key not in schema.ALL_KEYS or key in ("extends", "filesystem.inherit"):
            known = sorted({*schema.FIELDS, *schema.LIST_KEYS, *ALIASES})
            raise PolicyError("not an option that can be overridden", key=name,
                              hint=schema.suggest(name, known))
        if key == "filesystem.mounts":  # API callers may pass Bind(...) and friends
            kinds = tuple(MOUNT_KINDS.values())
            value = [writers.mount_to_toml(m) if isinstance(m, kinds) else m for m in value]
        section, _, leaf = key.rpartition(".")
        (data.setdefault(section, {}) if section else data)[leaf] = (
            "none" if value is None else value)
    origin = schema.Origin(None, None, os.getcwd())
    return apply_layer(policy, parse_layer(data, origin))


# --- writing a policy as a profile ---------------------------------------------------------------


def to_toml(policy: Policy) -> str:
    """The policy as a self-contained profile (no ``extends``): loading it gives the same
    policy back, so ``--print-profile`` output can be saved and edited."""
    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, spec in schema.FIELDS.items():
        value: Any = policy
        for attr in spec.attr:
            value = getattr(value, attr)
        if key == "workspace.path" and value is None:
            continue
        section, _, name = key.rpartition(".")
        (sections.setdefault(section, {}) if section else top)[name] = spec.to_toml(value)
    parts = [f"# profile {policy.name!r}: the effective policy, parents and overrides merged"]
    parts += [f"{_tomltext.key(k)} = {_tomltext.value(v)}" for k, v in top.items()]
    env = sections["environment"].pop("set")
    sections["filesystem"] = {"inherit": False}
    for section in schema.SECTIONS:
        parts.append("\n" + _tomltext.table(section, sections.get(section, {})))
        if section == "environment":
            parts.append("\n" + _tomltext.table("environment.set", env))
        if section == "filesystem":
            parts += ["\n" + _tomltext.table("filesystem.mounts", writers.mount_to_toml(m),
                                             array=True) for m in policy.mounts]
        if section == "seccomp":
            parts += ["\n" + _tomltext.table("seccomp.rules", writers.rule_to_toml(r),
                                             array=True) for r in policy.seccomp.rules]
    return "\n".join(parts) + "\n"
