"""The system's interfaces every side shares: ctypes bindings of the syscalls the standard
library lacks (``libc``), Landlock's (``landlock``), the no-symlink walk (``paths``), the mount
table (``mountinfo``) and the messages between the processes (``wire``).

No code here: the launch helper and the sandbox import these modules without the package's
``__init__``, so this one stays empty too.
"""
