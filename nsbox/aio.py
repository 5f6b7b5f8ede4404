"""The asyncio API: ``await nsbox.arun(...)`` and ``async with nsbox.AsyncSession(...)``.

Each call runs the blocking one (``nsbox.run``, ``Session.run``...) in a thread of its own,
so that many runs wait at once without filling the event loop's default executor. When the
awaiting task is cancelled, the run is killed (its launch socket gets a kill, as at an output
limit: the helper kills the whole sandbox), and the cancellation goes on only once the run has
ended: its processes are gone and its cgroup removed when ``CancelledError`` reaches the caller.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar, overload

from nsbox import api
from nsbox.launch import launcher
from nsbox.policy.policy import Policy
from nsbox.result import Result
from nsbox.session.run import run_cancellable
from nsbox.session.session import CopyLimits, FileInfo, Session

T = TypeVar("T")


async def _in_thread(work: Callable[[], T], cancel: Callable[[], None] | None = None) -> T:
    """``work()`` in a new thread. Cancelled, it calls ``cancel`` and waits for ``work`` to
    end before it lets the cancellation through."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not done.cancelled():
            if error is None:
                done.set_result(value)
            else:
                done.set_exception(error)

    def body() -> None:
        value, error = None, None
        try:
            value = work()
        except BaseException as exc:  # handed to the awaiting task
            error = exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the event loop is closed: nobody waits any more
            pass

    threading.Thread(target=body, name="nsbox-aio", daemon=True).start()
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        if cancel is not None:
            cancel()
        while not done.done():  # the run's end: its sandbox killed, its cgroup removed
            try:
                await asyncio.shield(done)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        if not done.cancelled():
            done.exception()  # retrieved: the cancellation is what the caller gets
        raise


@overload
async def arun(argv: Sequence[str], policy: Policy | None = None, *,
               input: bytes | str | None = None, stdin: bytes | str | int | None = None,
               text: Literal[False] = False, encoding: None = None, errors: None = None,
               check: bool = False, capture_output: bool | None = None,
               timeout: float | None = None, output_limit: int | None = None,
               env: dict[str, str] | None = None,
               workspace: str | os.PathLike[str] | None = None, cwd: str | None = None,
               passthrough: bool = False, audit: str | os.PathLike[str] | None = None,
               profile: str | os.PathLike[str] | None = None) -> Result[bytes]: ...
@overload
async def arun(argv: Sequence[str], policy: Policy | None = None, *,
               input: bytes | str | None = None, stdin: bytes | str | int | None = None,
               text: Literal[True], encoding: str | None = None, errors: str | None = None,
               check: bool = False, capture_output: bool | None = None,
               timeout: float | None = None, output_limit: int | None = None,
               env: dict[str, str] | None = None,
               workspace: str | os.PathLike[str] | None = None, cwd: str | None = None,
               passthrough: bool = False, audit: str | os.PathLike[str] | None = None,
               profile: str | os.PathLike[str] | None = None) -> Result[str]: ...
async def arun(argv: Sequence[str], policy: Policy | None = None, *,
               input: bytes | str | None = None, stdin: bytes | str | int | None = None,
               text: bool = False, encoding: str | None = None, errors: str | None = None,
               check: bool = False, capture_output: bool | None = None,
               timeout: float | None = None, output_limit: int | None = None,
               env: dict[str, str] | None = None,
               workspace: str | os.PathLike[str] | None = None, cwd: str | None = None,
               passthrough: bool = False, audit: str | os.PathLike[str] | None = None,
               profile: str | os.PathLike[str] | None = None) -> Result[Any]:
    """``nsbox.run`` for asyncio: the same arguments (``input``, ``text``, ``check``,
    ``timeout``...), the same Result and errors. Cancelling the task kills the sandbox; the
    ``CancelledError`` arrives once it is gone (docs/api.md, "asyncio")."""
    cancel = launcher.Cancel()
    arguments: dict[str, Any] = dict(
        input=input, stdin=stdin, text=text, encoding=encoding, errors=errors, check=check,
        capture_output=capture_output, timeout=timeout, output_limit=output_limit, env=env,
        workspace=workspace, cwd=cwd, passthrough=passthrough, audit=audit, profile=profile)
    return await _in_thread(
        lambda: api.run_cancellable(argv, policy, cancel=cancel, **arguments), cancel)


class AsyncSession:
    """A Session for asyncio: ``async with nsbox.AsyncSession(...) as s``, then
    ``await s.run([...])``, ``await s.write_file(...)``, ``await s.read_file(...)``.

    Takes the arguments of nsbox.Session. Cancelling a ``run`` kills that command and what it
    started (the session goes on); leaving the ``async with`` block, also by a cancellation,
    ends the session and its sandbox. ``session`` is the underlying Session.
    """

    def __init__(self, policy: Policy | None = None, **kwargs: Any) -> None:
        self._args = (policy, kwargs)
        self.session: Session | None = None

    async def start(self) -> AsyncSession:
        """Start the session's sandbox (``async with`` does it)."""
        if self.session is None:
            policy, kwargs = self._args
            started: list[Session] = []

            def start() -> Session:
                started.append(Session(policy, **kwargs))
                return started[0]

            try:
                self.session = await _in_thread(start)
            except asyncio.CancelledError:
                for session in started:  # it started all the same: end it
                    await _in_thread(session.close)
                raise
        return self

    def _open(self) -> Session:
        if self.session is None:
            from nsbox.errors import SessionClosed

            raise SessionClosed("the session is not started: use `async with` or start()")
        return self.session

    async def __aenter__(self) -> AsyncSession:
        return await self.start()

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End the session: every process, mount and file of the sandbox is gone on return."""
        if self.session is not None:
            session = self.session
            await _in_thread(session.close)

    @overload
    async def run(self, argv: Sequence[str], *, input: bytes | str | None = None,
                  stdin: bytes | str | int | None = None, text: Literal[False] = False,
                  encoding: None = None, errors: None = None, check: bool = False,
                  capture_output: bool | None = None, timeout: float | None = None,
                  output_limit: int | None = None, env: dict[str, str] | None = None,
                  cwd: str | None = None, passthrough: bool = False) -> Result[bytes]: ...
    @overload
    async def run(self, argv: Sequence[str], *, input: bytes | str | None = None,
                  stdin: bytes | str | int | None = None, text: Literal[True],
                  encoding: str | None = None, errors: str | None = None, check: bool = False,
                  capture_output: bool | None = None, timeout: float | None = None,
                  output_limit: int | None = None, env: dict[str, str] | None = None,
                  cwd: str | None = None, passthrough: bool = False) -> Result[str]: ...
    async def run(self, argv: Sequence[str], *, input: bytes | str | None = None,
                  stdin: bytes | str | int | None = None, text: bool = False,
                  encoding: str | None = None, errors: str | None = None, check: bool = False,
                  capture_output: bool | None = None, timeout: float | None = None,
                  output_limit: int | None = None, env: dict[str, str] | None = None,
                  cwd: str | None = None, passthrough: bool = False) -> Result[Any]:
        """``Session.run`` for asyncio (the same arguments). Cancelling it kills the command
        and everything it started; the session goes on."""
        session = self._open()
        cancel = launcher.Cancel()
        arguments: dict[str, Any] = dict(
            input=input, stdin=stdin, text=text, encoding=encoding, errors=errors, check=check,
            capture_output=capture_output, timeout=timeout, output_limit=output_limit,
            env=env, cwd=cwd, passthrough=passthrough)
        return await _in_thread(
            lambda: run_cancellable(session, argv, cancel=cancel, **arguments), cancel)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """``Session.write_file`` for asyncio."""
        session = self._open()
        await _in_thread(lambda: session.write_file(path, data, mode))

    async def read_file(self, path: str, *, max_size: int | None = None) -> bytes:
        """``Session.read_file`` for asyncio."""
        session = self._open()
        return await _in_thread(lambda: session.read_file(path, max_size=max_size))

    async def files(self, patterns: Iterable[str] = ("*",), root: str = "/workspace"
                    ) -> list[FileInfo]:
        """``Session.files`` for asyncio."""
        session = self._open()
        return await _in_thread(lambda: session.files(patterns, root))

    async def copy_out(self, dest: str, patterns: Iterable[str] = ("*",),
                       root: str = "/workspace") -> list[FileInfo]:
        """``Session.copy_out`` for asyncio."""
        session = self._open()
        return await _in_thread(lambda: session.copy_out(dest, patterns, root))


__all__ = ["AsyncSession", "CopyLimits", "arun"]
