"""The one parser of /proc/self/mountinfo (nsbox/_sys/mountinfo.py), which the path rules, the
cgroup layout and the doctor read the mount table with."""

from __future__ import annotations

import os

from nsbox._sys import mountinfo as _mountinfo


def test_a_line_with_optional_fields_and_escapes() -> None:
    text = ("36 35 98:0 /mnt\\0401 /mnt/par\\134ent rw,noatime master:1 shared:2 - ext3 "
            "/dev/root rw,errors=continue\n"
            "40 36 0:35 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    first, second = _mountinfo.parse(text)
    assert first == _mountinfo.MountEntry("98:0", "/mnt 1", "/mnt/par\\ent", "ext3",
                                          ("rw", "errors=continue"))
    assert (second.point, second.fstype, second.options) == (
        "/sys/fs/cgroup", "cgroup2", ("rw", "nsdelegate"))


def test_a_line_without_its_fields_is_left_out() -> None:
    text = "1 2 3:4 / /a rw\n\n1 2 3:4 / /b rw - ext4\n5 6 7:8 / /c rw - tmpfs tmpfs rw\n"
    assert [m.point for m in _mountinfo.parse(text)] == ["/c"]


def test_this_process_mount_table() -> None:
    with open("/proc/self/mountinfo") as f:
        mounts = _mountinfo.parse(f.read())
    root = os.stat("/").st_dev
    assert any(m.point == "/" and m.dev == f"{os.major(root)}:{os.minor(root)}" for m in mounts)
