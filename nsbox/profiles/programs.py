"""What the build makes of the shipped profiles, so that a launch of one neither compiles nor
parses: their seccomp programs (and those of the set-id filter and the Landlock mode's filter),
loaded as bytes, and their values as the TOML parser gives them.

setup.py calls ``build`` and ``build_parsed`` while it builds the package (``python -m
nsbox.profiles.programs`` does the same in this tree by hand). Both go into the package
directory (nsbox/host/seccomp.py ``SHIPPED_DIR``, nsbox/profiles ``PARSED``), where rule
nsbox-code keeps every sandbox from writing them, so a regular user's ``nsbox run`` neither
imports pyseccomp nor compiles. Each program records what it was compiled from, so that a test
can compile it again and compare (tests/test_seccomp_shipped.py); each parsed profile holds the
text it was parsed from, and is used only for that text.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from nsbox.host import seccomp, seccomp_compile
from nsbox.policy.policy import Policy, Seccomp


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
    setid = seccomp_compile.compile_setid(seccomp.setid_key())
    seccomp.write_entry(directory, setid, {"setid": True})
    keys.append(setid.key)
    from nsbox.host import (
        landlock_filter,  # the Landlock mode's own filter, in every one of its runs
    )

    landlock = landlock_filter.compile_filter(landlock_filter.filter_key())
    seccomp.write_entry(directory, landlock, {"landlock": True})
    keys.append(landlock.key)
    for policy in shipped_policies():
        program = seccomp_compile.compile_program(policy, seccomp.cache_key(policy))
        seccomp.write_entry(directory, program, {"seccomp": seccomp.plain_source(policy)})
        keys.append(program.key)
    return keys


def build_parsed(path: str) -> list[str]:
    """The shipped profiles' values into ``path`` (JSON), each with its text; the names."""
    import json

    from nsbox import profiles

    parsed = {}
    for name in profiles.shipped_profiles():
        source = profiles.shipped_source(name)
        text = source.read_text()
        parsed[source.display] = {"text": text, "data": profiles.toml().loads(text)}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(parsed, f, sort_keys=True)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return sorted(parsed)


def main(argv: list[str]) -> int:
    directory = argv[0] if argv else seccomp.SHIPPED_DIR
    keys = build(directory)
    print(f"{len(keys)} seccomp programs in {directory}")
    if not argv:
        from nsbox import profiles

        names = build_parsed(profiles.PARSED)
        print(f"{len(names)} profiles parsed into {profiles.PARSED}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
