"""The host's home directories and the secrets at their top, as the rule book sees them.

A bound tree that holds a home's credentials is refused (rule secret-dir, nsbox/policy/rules.py):
nsbox/host/pathrules.py asks here which homes there are and which of rules.SECRETS each one
holds, at its top and in the folders those names go into (``.config/gcloud``).
"""

from __future__ import annotations

import os
import posixpath

from nsbox.policy.rules import SECRETS, UNSCANNED_TREES, secret_in


def home_dirs() -> list[str]:
    """The host's home directories: /root, /home/*, and every home in the user database."""
    import pwd

    homes = {"/root"}
    try:
        homes.update(os.path.join("/home", n) for n in os.listdir("/home"))
    except OSError:
        pass
    homes.update(p.pw_dir for p in pwd.getpwall() if p.pw_dir.startswith("/"))
    return sorted(h for h in homes if posixpath.normpath(h) != "/" and os.path.isdir(h)
                  and not _system_tree(os.path.realpath(h)))


def _system_tree(real: str) -> bool:
    """System accounts' homes in package-managed trees (/bin, /usr/sbin, /usr/games) or /dev:
    only packages and the kernel put files there, never an account's credentials, and listing
    them (a thousand programs in /usr/bin) would cost every launch."""
    return any(real == tree or real.startswith(tree + "/")
               for tree in (*UNSCANNED_TREES, "/dev")) and not real.startswith("/usr/local")


# The folders of a home that SECRETS names entries of (".config" for ".config/gcloud").
SECRET_PARENTS = tuple(sorted({"/" + p.split("/")[0] for p in SECRETS if "/" in p}))


def home_secrets(home: str) -> list[str]:
    """The secrets (rules.SECRETS) at the top of ``home`` and in its folders that SECRETS
    names entries of, in any case: one listing each."""
    found = []
    for parent in ("", *SECRET_PARENTS):
        try:
            names = os.listdir(home + parent)
        except OSError:
            continue
        for name in names:
            rel = parent.lstrip("/") + ("/" if parent else "") + name
            if secret_in(rel) == rel:
                found.append(f"{home}/{rel}")
    return found
