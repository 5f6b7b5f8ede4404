"""A project session's review: what its sandbox changed in the project, applied by the host.

A session made with ``project=DIR`` sees DIR copy-on-write at /workspace (nsbox/host/project.py
records the project as the session found it). Its changes are listed by a file operation in the
sandbox, read back as data (each checked against its SHA-256), and written into DIR by this
process only on ``apply``, atomically per file; a file changed on the host since the session
started is a conflict and is not written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from nsbox.errors import FileTransferError, NsboxError, PolicyError
from nsbox.host import autorun
from nsbox.host import project as projectmod
from nsbox.policy import checks
from nsbox.session.files import FileTransfer


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
        data = self._file_op({"kind": "changes", "max_entries": projectmod.MAX_CHANGES,
                              "max_size": self.copy_limits.max_file_size})
        try:
            listing = json.loads(data)["entries"]
            found = project.changes(listing)
        except (ValueError, KeyError, TypeError):
            raise FileTransferError(projectmod.UPPER, "the sandbox sent a malformed listing"
                                    ) from None
        return self._diffed(found) if diff else found

    def _diffed(self, found: list[projectmod.Change]) -> list[projectmod.Change]:
        """``found`` (as ``changes(diff=False)`` lists them), each text file with its diff:
        only these files are read from the sandbox."""
        project = self._project_or_refuse()
        contents = self._upper([c for c in found if c.size is not None
                                and c.size <= projectmod.DIFF_MAX])
        return [project.with_diff(c, contents.get(c.path)) for c in found]

    def _upper(self, changes: list[projectmod.Change]) -> dict[str, bytes]:
        """The sandbox's version of the changed files, read in batches (one file operation
        for many files), each checked against the SHA-256 it was listed with."""
        wanted = [c for c in changes if c.kind in ("added", "modified") and not c.is_dir
                  and c.size is not None and c.sha256 is not None]
        contents: dict[str, bytes] = {}
        batch: list[projectmod.Change] = []
        for change in wanted:
            batch.append(change)
            if sum(c.size or 0 for c in batch) >= self.copy_limits.max_file_size:
                contents.update(self._read_batch(batch))
                batch = []
        if batch:
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


def changes_at(session: ProjectReview, paths: Sequence[str] | None
               ) -> list[projectmod.Change]:
    """``choose(session.changes(), paths)``, the same changes and diffs, with only the chosen
    changes diffed: the files of the others are never read from the sandbox."""
    return session._diffed(choose(session.changes(diff=False), paths))
