"""What the sandbox of ``nsbox mcp`` has installed, for the tools' descriptions: the version of
its python3, the packages an agent's code can import and the notable programs on its PATH,
found by that python3 itself in a sandbox of the server's policy (nothing is assumed about the
host)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from nsbox.errors import NsboxError
from nsbox.mcp.tools import PYTHON
from nsbox.policy.policy import Policy

# Run by the sandbox's own python3 (-I: neither the cwd nor PYTHON* variables count), so that
# it lists what the agent's code can import, not what this server's environment has.
PROBE = """\
import importlib.metadata as m, json, shutil, sys
found = {}
for dist in m.distributions():
    try:
        found[str(dist.metadata["Name"])] = str(dist.version)
    except Exception:
        pass
commands = [name for name in json.loads(sys.argv[1]) if shutil.which(name)]
print(json.dumps({"python": "%d.%d.%d" % sys.version_info[:3], "packages": found,
                  "commands": commands}))
"""
# The packages an agent reaches for first, named when they are installed; the rest are counted.
NOTABLE = ("numpy", "pandas", "scipy", "matplotlib", "scikit-learn", "sympy", "statsmodels",
           "seaborn", "networkx", "polars", "pyarrow", "pillow", "openpyxl", "lxml",
           "beautifulsoup4", "requests", "pyyaml", "torch")
# The programs beyond the shell and coreutils an agent's bash commands reach for, named when
# they are on the sandbox's PATH.
COMMANDS = ("git", "curl", "wget", "jq", "sqlite3", "gcc", "make", "node", "perl", "R", "ps",
            "file", "zip", "unzip", "xz", "convert", "ffmpeg", "pandoc")
PROBE_TIMEOUT = 30.0
_PACKAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]{0,39}")


@dataclass(frozen=True)
class Installed:
    """What the sandbox's python3 can import: its version and the distributions found."""

    python: str
    packages: dict[str, str]  # name, lower case -> version
    commands: tuple[str, ...] = ()  # those of COMMANDS on the sandbox's PATH

    def summary(self) -> str:
        named = [f"{name} {self.packages[name]}" for name in NOTABLE if name in self.packages]
        others = len(self.packages) - len(named)
        text = f"Python {self.python}"
        if named:
            text += " with " + ", ".join(named)
        if others > 0:
            text += f"{' and' if named else ' with'} {others} other distributions"
        return text + " (importlib.metadata lists them all)"

    def commands_summary(self) -> str:
        return ("bash with coreutils" + (" and " + ", ".join(self.commands)
                                         if self.commands else ""))


def probe_installed(policy: Policy) -> Installed | None:
    """What the sandbox of ``policy`` has installed, from a one-off sandbox of it (so the
    session's audit record holds the agent's commands only); None when the probe fails."""
    import json

    import nsbox
    from nsbox.policy.policy import Network

    try:
        result = nsbox.run([PYTHON, "-I", "-c", PROBE, json.dumps(COMMANDS)],
                           policy.replace(network=Network()), timeout=PROBE_TIMEOUT, cwd="/")
    except NsboxError:
        return None
    if not result.ok:
        return None
    try:
        report = json.loads(result.stdout)
        python, packages, commands = report["python"], report["packages"], report["commands"]
    except (ValueError, KeyError, TypeError):
        return None
    # What the sandbox printed is its own making: only well-formed names and versions count.
    if not isinstance(python, str) or not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", python):
        return None
    found = {name.lower(): version for name, version in
             (packages.items() if isinstance(packages, dict) else ())
             if isinstance(name, str) and isinstance(version, str)
             and _PACKAGE_NAME.fullmatch(name) and _VERSION.fullmatch(version)}
    on_path = tuple(name for name in COMMANDS if isinstance(commands, list) and name in commands)
    return Installed(python, found, on_path)
