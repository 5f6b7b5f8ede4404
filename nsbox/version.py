"""The version, and the commit it was built from (for `nsbox --version`).

The commit is written into the package when it is built (nsbox/_build_info.py: by setup.py into
a wheel, by tools/build_pyz.py into nsbox.pyz); a checkout run in place asks git. A copy built
where there was no commit to name (from a source archive) says the version alone.
"""

from __future__ import annotations

import os

VERSION = "0.1.0"


def git_commit(repo: str) -> str | None:
    """The checkout's HEAD (12 hex digits), or None: no checkout or no git."""
    # A worktree's .git is a file, a clone's a directory.
    if not os.path.exists(os.path.join(repo, ".git")):
        return None
    import subprocess  # only for `nsbox --version` and builds: it costs every launch several ms

    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, check=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def build_info(repo: str) -> bytes:
    """The text of nsbox/_build_info.py for a build from ``repo``."""
    return f"COMMIT = {git_commit(repo)!r}\n".encode()


def commit() -> str | None:
    """The commit baked into a built copy, else the checkout's HEAD, else None."""
    try:
        from nsbox._build_info import COMMIT  # type: ignore[import-not-found]

        return str(COMMIT) if COMMIT else None
    except ImportError:
        pass
    return git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def describe() -> str:
    named = commit()
    return f"nsbox {VERSION} (commit {named})" if named else f"nsbox {VERSION}"
