"""A project session's review: what its sandbox changed in the project, applied by the host.

A session made with ``project=DIR`` sees DIR copy-on-write at /workspace (nsbox/host/project.py
records the project as the session found it). Its changes are listed by a file operation in the
sandbox, read back as data (each checked against its SHA-256), and written into DIR by this
process only on ``apply``, atomically per file; a file changed on the host since the session
started is a conflict and is not written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

from nsbox.errors import FileTransferError, NsboxError, PolicyError
from nsbox.host import autorun
from nsbox.host import project as projectmod
from nsbox.policy import checks
from nsbox.session.files import FileTransfer

# The diffs of one listing, in bytes: 60 new text files of 1 MiB took the supervisor from
# 22 MB to 453 MB (the CLI that read the reply to 363 MB). Past this, a text file's change is
# listed without its diff (``no_diff`` says why) and its file is not read from the sandbox.
DIFF_TOTAL = 16 * 1024 * 1024
OVER_TOTAL = (f"the diffs listed passed {DIFF_TOTAL >> 20} MiB in all: ask for this path "
              "alone to see its diff")


class ProjectReview(FileTransfer):
    """The project methods of nsbox.Session: ``changes``, ``apply``, ``discard``."""

    _project: projectmod.Project | None  # Session's: None without a project

    @property
    def masked(self) -> list[str]:
        """The project's secrets covered with an empty read-only file in the sandbox."""
        return list(self._project.masked) if self._project is not None else []

    @property
    def project_notes(self) -> list[str]:
        """What the sandbox sees of the project beyond the masks: a .git withheld, and why."""
        return list(self._project.view.notes) if self._project is not None else []

    def _project_or_refuse(self) -> projectmod.Project:
        if self._project is None:
            raise PolicyError("this session has no project workspace", key="project",
                              hint="start it with Session(project=DIR) or --project DIR")
        return self._project

    def changes(self, *, diff: bool = True) -> list[projectmod.Change]:
        """What the sandbox changed in the project: added, modified, deleted files and
        directories, mode changes, symlinks and what cannot be applied (hard links, FIFOs,
        files over the copy limit), each text file with a unified diff (``diff``)."""
        project = self._project_or_refuse()
        try:
            data = self._file_op({"kind": "changes", "max_entries": projectmod.MAX_CHANGES,
                                  "max_size": self.copy_limits.max_file_size})
        except FileTransferError as exc:
            raise _too_many(exc) from None
        try:
            listing = json.loads(data)["entries"]
            found = project.changes(listing)
        except (ValueError, KeyError, TypeError):
            raise FileTransferError(projectmod.UPPER, "the sandbox sent a malformed listing"
                                    ) from None
        return self._diffed(found) if diff else found

    def _diffed(self, found: list[projectmod.Change]) -> list[projectmod.Change]:
        """``found`` (as ``changes(diff=False)`` lists them), each text file with its diff:
        only these files are read from the sandbox, a batch at a time, and none once the diffs
        passed DIFF_TOTAL bytes (the rest say so in ``no_diff``)."""
        project = self._project_or_refuse()
        shown: dict[str, projectmod.Change] = {}
        total = 0
        # Batches of at most DIFF_TOTAL bytes: a file's diff is about as long as it, or longer.
        for batch in self._batches([c for c in found if c.size is not None
                                    and c.size <= projectmod.DIFF_MAX], DIFF_TOTAL):
            contents = self._read_batch(batch) if total <= DIFF_TOTAL else {}
            for change in batch:
                if total <= DIFF_TOTAL:
                    diffed = project.with_diff(change, contents[change.path])
                    total += len(diffed.diff.encode("utf-8", "replace")) if diffed.diff else 0
                shown[change.path] = diffed if total <= DIFF_TOTAL else dataclasses.replace(
                    change, no_diff=OVER_TOTAL)
        return [shown.get(c.path) or project.with_diff(c, None) for c in found]

    def _batches(self, changes: list[projectmod.Change], most: int | None = None
                 ) -> list[list[projectmod.Change]]:
        """The changed files to read from the sandbox, in batches (one file operation for
        many files) of up to the copy limit's bytes (or ``most``, if fewer)."""
        limit = min(self.copy_limits.max_file_size, most or self.copy_limits.max_file_size)
        wanted = [c for c in changes if c.kind in ("added", "modified") and not c.is_dir
                  and c.size is not None and c.sha256 is not None]
        batches: list[list[projectmod.Change]] = [[]]
        for change in wanted:
            batches[-1].append(change)
            if sum(c.size or 0 for c in batches[-1]) >= limit:
                batches.append([])
        return [b for b in batches if b]

    def _upper(self, changes: list[projectmod.Change]) -> dict[str, bytes]:
        """The sandbox's version of the changed files, each checked against the SHA-256 it
        was listed with."""
        contents: dict[str, bytes] = {}
        for batch in self._batches(changes):
            contents.update(self._read_batch(batch))
        return contents

    def _read_batch(self, batch: list[projectmod.Change]) -> dict[str, bytes]:
        total = sum(c.size or 0 for c in batch)
        data = self._file_op({"kind": "getmany", "max_size": self.copy_limits.max_file_size,
                              "paths": [f"{projectmod.UPPER}/{c.path}" for c in batch]},
                             cap=total + 65536)
        if len(data) != total:
            raise FileTransferError(batch[0].path, "changed while it was read")
        contents, offset = {}, 0
        for change in batch:
            part = data[offset:offset + (change.size or 0)]
            offset += change.size or 0
            if hashlib.sha256(part).hexdigest() != change.sha256:
                raise FileTransferError(change.path, "changed while it was read")
            contents[change.path] = part
        return contents

    def apply(self, paths: Sequence[str] | None = None, *,
              reviewed: Sequence[projectmod.Change] | str | None = None
              ) -> projectmod.ApplyReport:
        """Write the chosen changes (all, or those at or below ``paths``) into the project
        directory, as this process, atomically per file. A change whose host file changed
        since the session started is a conflict and is not written.

        ``reviewed``: the changes the user reviewed (as ``changes(paths)`` gave them, or their
        ``review_token``, which ``nsbox session diff`` prints); nothing is written unless the
        chosen changes are still exactly those. Without it, apply writes what the sandbox
        holds now, which a command run since the review may have changed."""
        project = self._project_or_refuse()
        chosen = choose(self.changes(diff=False), paths)
        if reviewed is not None:
            _check_reviewed(chosen, reviewed)
        report = projectmod.ApplyReport()
        with self._lock:
            contents = self._upper([c for c in chosen if c.applicable and not c.conflict])
            for change in projectmod.order(chosen):
                if not change.applicable:
                    report.refused.append((change.path, change.reason or change.kind))
                elif change.conflict or project.conflict(change):
                    report.conflicts.append(change.path)
                else:
                    try:
                        self._apply_one(project, change, contents)
                    except (OSError, NsboxError) as exc:
                        report.refused.append((change.path, getattr(exc, "strerror", None)
                                               or str(exc)))
                        continue
                    report.applied.append(change.path)
        return report

    def _apply_one(self, project: projectmod.Project, change: projectmod.Change,
                   contents: dict[str, bytes]) -> None:
        if change.kind == "deleted":
            project.remove(change)
        elif change.kind == "mode":
            project.chmod(change)
        elif change.is_dir:
            project.make_dir(change)
        else:
            project.write(change, contents[change.path])

    def discard(self, paths: Sequence[str] | None = None) -> list[str]:
        """Drop the chosen changes from review: they are not listed or applied (unless the
        sandbox changes them again). The sandbox keeps its own view until the session ends;
        nothing reaches the host."""
        project = self._project_or_refuse()
        chosen = choose(self.changes(diff=False), paths)
        project.discard(chosen)
        return [c.path for c in chosen]


def review_token(changes: Sequence[projectmod.Change]) -> str:
    """The digest ``apply(reviewed=)`` takes for exactly these changes."""
    return projectmod.review_token(changes)


def _check_reviewed(chosen: list[projectmod.Change],
                    reviewed: Sequence[projectmod.Change] | str) -> None:
    token = reviewed if isinstance(reviewed, str) else review_token(reviewed)
    if review_token(chosen) != token:
        raise PolicyError("the changes are not the ones reviewed: the sandbox changed them "
                          "since; nothing was applied", key="reviewed",
                          hint="review them again (nsbox session diff) and apply with the "
                               "token it prints")


def choose(changes: list[projectmod.Change],
           paths: Sequence[str] | None) -> list[projectmod.Change]:
    """The changes at or below ``paths`` (all for None)."""
    if paths is None:
        return changes
    if isinstance(paths, str):
        raise PolicyError(f"expected a list of paths, got {paths!r}", key="paths",
                          hint=f"did you mean [{paths!r}]?")
    wanted = [checks.text(p, "paths").strip("/") for p in paths]
    # "/" (which strips to "") names the whole project.
    return [c for c in changes
            if any(w == "" or autorun.at_or_below(c.path, w) for w in wanted)]


def changes_at(session: ProjectReview, paths: Sequence[str] | None, diff: bool = True
               ) -> list[projectmod.Change]:
    """``choose(session.changes(), paths)``, the same changes and diffs, with only the chosen
    changes diffed: the files of the others are never read from the sandbox. ``diff`` False:
    none is (a listing such as ``nsbox session diff --stat``; the review token is the same)."""
    chosen = choose(session.changes(diff=False), paths)
    return session._diffed(chosen) if diff else chosen


def _too_many(exc: FileTransferError) -> FileTransferError:
    """The listing's failure, said so that the user can act when the sandbox changed more
    entries than a review lists (an ``npm install`` does): review, apply and discard all list
    every change, so none of them works until there are fewer."""
    if not (exc.reason.startswith("more than") and exc.reason.endswith("changed entries")):
        return exc
    return FileTransferError(exc.path, (
        f"the project has {exc.reason} (a review lists at most {projectmod.MAX_CHANGES}): "
        "diff, apply and discard fail until there are fewer; "
        "remove what need not reach the project from inside the session (e.g. nsbox session "
        "exec ID -- rm -rf node_modules), or stop the session to drop every change"))
