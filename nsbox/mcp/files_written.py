"""The files a run tool's command wrote, as its reply shows them (nsbox/mcp/tools.py).

The workspace is listed before and after the command, through the sandbox (the session's
``files``), and the two are compared. What reaches the model is capped like the command's
output: at most MAX_FILES_SHOWN files, each name at most MAX_NAME_SHOWN characters, and the
count of the rest. A listing that failed or that the sandbox cut does not stop the command:
the reply says what is not known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nsbox import visible
from nsbox.errors import NsboxError

MAX_FILES_SHOWN = 50  # files written listed in one reply (the rest counted)
MAX_NAME_SHOWN = 200  # characters of one file's name in a reply, text and data
IMAGE_CAP = 4 * 1024 * 1024  # bytes of one PNG returned as image content
MAX_IMAGES = 4  # per reply
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def file_entry(info: Any) -> dict[str, Any]:
    """A session's FileInfo (path relative to /workspace) -> {name, size, sha256}."""
    return {"name": info.path, "size": info.size, "sha256": info.sha256}


@dataclass(frozen=True)
class Snapshot:
    """The workspace's files at one moment: name -> sha256, in the walk's order; ``cut``
    when the sandbox cut the listing, ``error`` (and no files) when it failed."""

    files: dict[str, str]
    cut: bool = False
    error: str | None = None


def snapshot(session: Any) -> tuple[Snapshot, list[dict[str, Any]]]:
    """The workspace listed now, and its entries (name, size, sha256)."""
    try:
        listing = session.files()
    except NsboxError as error:
        return Snapshot({}, error=str(error)), []
    entries = [file_entry(info) for info in listing]
    return (Snapshot({e["name"]: e["sha256"] for e in entries},
                     cut=bool(getattr(listing, "truncated", False))), entries)


def _walk_key(name: str) -> tuple[str, ...]:
    """A name's place in the walk's order: each directory's entries sorted by name."""
    return tuple(name.split("/"))


def written(before: Snapshot, after: Snapshot,
            entries: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The entries of ``after`` the command created or changed, and notes on what is not
    known (a listing that failed or was cut)."""
    for listing, when in ((before, "before"), (after, "after")):
        if listing.error is not None:
            return [], [f"the files the command wrote are not known: the workspace could not "
                        f"be listed {when} it ({visible.name(listing.error)})"]
    produced = [e for e in entries if before.files.get(e["name"]) != e["sha256"]]
    if not (before.cut or after.cut):
        return produced, []
    if before.cut:
        # Past the last name listed before, a file is new or was only past the cut: not known.
        last = max((_walk_key(name) for name in before.files), default=())
        produced = [e for e in produced if _walk_key(e["name"]) <= last]
    return produced, ["the workspace's listing was cut (its names passed the listing's "
                      "size): files written past the cut are not listed"]


def _short(name: str) -> str:
    """``name`` as it fits MAX_NAME_SHOWN characters: its start and its end."""
    if len(name) <= MAX_NAME_SHOWN:
        return name
    half = (MAX_NAME_SHOWN - 1) // 2
    return name[:half] + "\u2026" + name[len(name) - (MAX_NAME_SHOWN - 1 - half):]


def shown(produced: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries a reply's data holds: the first MAX_FILES_SHOWN, each name cut to
    MAX_NAME_SHOWN characters (marked ``name_truncated``)."""
    entries = []
    for entry in produced[:MAX_FILES_SHOWN]:
        if len(entry["name"]) > MAX_NAME_SHOWN:
            entry = {**entry, "name": _short(entry["name"]), "name_truncated": True}
        entries.append(entry)
    return entries


def render(data: dict[str, Any]) -> list[str]:
    """The "files written" part of a run reply's text (``data`` is the reply's data)."""
    if not data["files"]:
        return []
    lines = ["--- files written ---"]
    lines += [f"{_short(visible.name(f['name']))}  {f['size']} bytes  sha256 {f['sha256']}"
              for f in data["files"]]
    total = data.get("files_total", len(data["files"]))
    if total > len(data["files"]):
        lines.append(f"[{total - len(data['files'])} more; {total} files written in all]")
    return lines


def images(session: Any, produced: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
    """PNG files the command wrote, read back through the session (never by host path)."""
    found: list[tuple[str, bytes]] = []
    for entry in produced:
        if len(found) >= MAX_IMAGES:
            break
        if not entry["name"].lower().endswith(".png") or entry["size"] > IMAGE_CAP:
            continue
        try:
            data = session.read_file(entry["name"], max_size=IMAGE_CAP)
        except NsboxError:
            continue  # no longer a regular file of that size: it is listed, not shown
        if data.startswith(PNG_MAGIC):
            found.append((entry["name"], data))
    return found
