"""The sandbox's stdin: the one place where what a caller gave as ``stdin`` (checked at the door,
nsbox/policy/inputs.py ``stdin``) becomes the descriptor the launch helper or a session's init
hands the command. Every door comes here: nsbox.run, Pool.run and Session.run (with a published
session's supervisor and the command line's ``nsbox run < file``) through
``launcher.submit_with_streams``.

Bytes go in a memfd; None is /dev/null; a pipe is passed as it is; a regular file, a device or
a socket is never passed: the sandbox gets the read end of a new pipe that a thread of this
process feeds from it (``inputs.stdin_kind`` says which, and why).
"""

from __future__ import annotations

import errno
import os
import select
import signal
import threading

from nsbox.policy import inputs

CHUNK = 1 << 16  # bytes a pump moves at a time: what a pipe holds by default


def sandbox_stdin(stdin: bytes | int | None) -> tuple[int, bool]:
    """A descriptor for the sandbox's stdin, and whether we opened it (the caller closes it
    once it is sent: a pump must see the sandbox's end close when the sandbox ends)."""
    if isinstance(stdin, int):
        kind = inputs.stdin_kind(stdin)  # again: the descriptor is used now, not at the door
        if kind == "pass":
            return stdin, False
        if kind == "pump":
            return pump(stdin), True
        stdin = None  # /dev/null: one of our own
    if stdin is None:
        return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC), True
    fd = os.memfd_create("nsbox-stdin", os.MFD_CLOEXEC)
    try:
        view = memoryview(stdin)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd, True


def pump(source: int) -> int:
    """The read end of a new pipe, fed from ``source`` by a daemon thread until ``source``'s
    end of file or until nobody reads the pipe any more (the sandbox ended, or it closed its
    stdin). The thread reads from a copy of ``source`` (so the caller may close theirs at
    once), a chunk at a time: a file of any size costs CHUNK bytes of memory at most."""
    src = os.dup(source)  # close-on-exec: os.dup makes it non-inheritable
    try:
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
    except BaseException:
        os.close(src)
        raise
    try:
        threading.Thread(target=_feed, args=(src, write_end), name="nsbox-stdin-pump",
                         daemon=True).start()
    except BaseException:
        for fd in (src, write_end, read_end):
            os.close(fd)
        raise
    return read_end


def _feed(src: int, sink: int) -> None:
    """Copy ``src`` into the pipe ``sink``, then close both."""
    # A write to a pipe nobody reads raises SIGPIPE before EPIPE: blocked in this thread alone,
    # the signal stays pending here (and dies with the thread) even in a process that has put
    # SIGPIPE back to its default, which would end it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    try:
        waiter = select.poll()
        waiter.register(src, select.POLLIN)
        waiter.register(sink, 0)  # POLLERR alone: the pipe has no reader left (pipe(7))
        splice = True
        while True:
            # Wait for data or for the reader to go: a device may have nothing to read for
            # ever, and this thread must not outlive the run by waiting for it.
            ready = dict(waiter.poll())
            if ready.get(sink, 0) & (select.POLLERR | select.POLLHUP):
                return
            try:
                if splice:
                    try:
                        if os.splice(src, sink, CHUNK) == 0:
                            return  # end of file
                        continue
                    except OSError as exc:
                        if exc.errno not in (errno.EINVAL, errno.ENOSYS):
                            raise
                        splice = False  # not every device splices: copy through here
                data = os.read(src, CHUNK)
            except BlockingIOError:  # a non-blocking source said ready, then had nothing
                continue
            if not data:
                return
            view = memoryview(data)
            while view:
                view = view[os.write(sink, view):]
    except OSError:
        return  # EPIPE: the sandbox is gone or closed its stdin; EIO from a device: its end
    finally:
        for fd in (src, sink):
            os.close(fd)
