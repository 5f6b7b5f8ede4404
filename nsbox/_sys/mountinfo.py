"""The mount table of /proc/self/mountinfo, parsed (proc(5)).

One line per mount: ``36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw``:
mount id, parent id, ``major:minor``, the root of the mount within its filesystem, the mount
point, mount options, optional fields up to a lone ``-``, then the filesystem type, the
source and the superblock options. The kernel writes a space, tab, newline or backslash in a
path as an octal escape (``\\040``). Read by the path rules (nsbox/host/pathrules.py), the cgroup
layout (nsbox/cgroups/_host.py) and the doctor (nsbox/doctor/hostfacts.py). Imported by the
helper too: nothing here may import more than the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class MountEntry:
    """One mount: ``root`` is the directory of the filesystem that appears at ``point``."""

    dev: str  # "major:minor"
    root: str
    point: str
    fstype: str
    options: tuple[str, ...]  # the superblock's options ("rw", "nsdelegate", "memory", ...)


def unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse(text: str) -> list[MountEntry]:
    """The mount table, in mount order (a later entry covers an earlier one). A line without
    the fields is left out."""
    entries = []
    for line in text.splitlines():
        fields = line.split()
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 4:
            continue
        entries.append(MountEntry(fields[2], unescape(fields[3]), unescape(fields[4]),
                                  fields[sep + 1], tuple(fields[sep + 3].split(","))))
    return entries
