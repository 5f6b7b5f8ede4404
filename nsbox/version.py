"""The version, and the commit it was built from (for `nsbox --version`)."""

from __future__ import annotations

import os

VERSION = "0.1.0"


def commit() -> str:
    """The commit baked into a built nsbox.pyz, else the checkout's HEAD, else "unknown"."""
    try:
        from nsbox._build_info import COMMIT  # type: ignore[import-not-found]

        return str(COMMIT)
    except ImportError:
        pass
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(repo, ".git")):
        return "unknown"
    import subprocess  # only for `nsbox --version`: it costs every launch several ms

    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, check=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip()


def describe() -> str:
    return f"nsbox {VERSION} (commit {commit()})"
