"""The seccomp programs built with the package: those of the shipped profiles and the set-id
filter, compiled once when nsbox is built and loaded as bytes at every launch.

setup.py calls ``build`` while it builds the package (``python -m nsbox.profiles.programs DIR``
does the same by hand). The programs go into the package directory (nsbox/host/seccomp.py,
``SHIPPED_DIR``), where rule nsbox-code keeps every sandbox from writing them, so a regular
user's ``nsbox run`` neither imports pyseccomp nor compiles. Each entry records what it was
compiled from, so that a test can compile it again and compare (tests/test_seccomp_shipped.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from nsbox.host import seccomp, seccomp_compile
from nsbox.policy import Policy, Seccomp


def shipped_policies() -> list[Seccomp]:
    """The seccomp policies a shipped profile (or the default ``Policy()``) gives, each also in
    learning mode (``--seccomp-log``), without repeats."""
    from nsbox.profiles import load_profile, shipped_profiles  # the package this module is in

    found: list[Seccomp] = [Policy().seccomp]
    found += [load_profile(name).seccomp for name in shipped_profiles()]
    policies: list[Seccomp] = []
    for policy in found:
        if not policy.enabled:
            continue
        for variant in (policy, dataclasses.replace(policy, log_denied=True)):
            if variant not in policies:
                policies.append(variant)
    return policies


def build(directory: str) -> list[str]:
    """Compile every shipped program into ``directory`` (made if missing, emptied of older
    entries first); the keys written."""
    os.makedirs(directory, mode=0o755, exist_ok=True)
    os.chmod(directory, 0o755)
    for name in os.listdir(directory):
        if name.endswith(".json"):
            os.unlink(os.path.join(directory, name))
    keys = []
    setid = seccomp_compile.compile_setid(seccomp._setid_key())
    seccomp.write_entry(directory, setid, {"setid": True})
    keys.append(setid.key)
    for policy in shipped_policies():
        program = seccomp_compile.compile_program(policy, seccomp.cache_key(policy))
        seccomp.write_entry(directory, program, {"seccomp": seccomp._plain(policy)})
        keys.append(program.key)
    return keys


def main(argv: list[str]) -> int:
    directory = argv[0] if argv else seccomp.SHIPPED_DIR
    keys = build(directory)
    print(f"{len(keys)} seccomp programs in {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
