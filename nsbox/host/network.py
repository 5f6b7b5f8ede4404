"""Host-side glue of the network modes: what goes into the plan, and the proxy of one run.

Modes (policy.Network): ``none`` (no interface up), ``loopback`` (lo up), ``allow`` (lo up and
a proxy listener inside, served here). docs/network.md describes the rules.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nsbox.errors import PolicyError
from nsbox.policy.policy import Network

if TYPE_CHECKING:
    from nsbox.host.netproxy import NetworkProxy

PROXY_HOST = "127.0.0.1"


def plan_net(network: Network) -> dict[str, Any]:
    """The ``net`` part of the plan; an empty allow-list is mode ``none``."""
    return {"mode": network.effective_mode, "proxy_port": network.proxy_port}


def proxy_env(network: Network) -> dict[str, str]:
    """What ordinary clients (curl, pip, urllib, requests) read to find the proxy; empty
    unless the effective mode is ``allow``."""
    if network.effective_mode != "allow":
        return {}
    url = f"http://{PROXY_HOST}:{network.proxy_port}"
    return {
        "HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
        # Empty: no destination bypasses the proxy (there is no other way out anyway).
        "NO_PROXY": "", "no_proxy": "",
    }


class RunNetwork:
    """The network side of one run in the host process: serves the listener the sandbox sends
    (allow mode) until ``close()``, then reports into the Result."""

    def __init__(self, network: Network,
                 ask: Callable[[str, int], bool] | None = None) -> None:
        self.network = network
        self.ask = ask  # put hosts not on the list to the embedding application
        self.proxy: NetworkProxy | None = None
        self.error: str | None = None

    def serve(self, fds: list[int]) -> None:
        """Called with the descriptors of the helper's "proxy" message; takes ownership."""
        if self.network.effective_mode != "allow" or self.proxy is not None or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return
        # The proxy and the rules load only for runs that use them.
        from nsbox.host.netproxy import NetworkProxy, ProxyLimits
        from nsbox.policy.netrules import parse_allow_list

        limits = ProxyLimits(
            max_connections=self.network.max_connections,
            max_bytes=self.network.max_bytes,
            connect_timeout=self.network.connect_timeout,
            idle_timeout=self.network.idle_timeout,
        )
        listener = socket.socket(fileno=fds[0])
        try:
            proxy = NetworkProxy(listener, parse_allow_list(self.network.allow), limits,
                                 ask=self.ask)
            self.proxy = proxy.start()
        except (OSError, RuntimeError) as exc:
            # No proxy: the listener closes, so the sandbox's connections are refused (fail
            # closed); the run goes on and the result says why.
            listener.close()
            self.error = f"the proxy could not start: {exc}"

    def close(self) -> None:
        """End the proxy: its threads, its connections and the listener (which also lets the
        sandbox's network namespace go)."""
        if self.proxy is not None:
            self.proxy.close()

    def report(self, reset: bool = False) -> dict[str, Any] | None:
        """``Result.extra["network"]``: None for the default mode, else the mode and, in allow
        mode, the proxy's log (since the last ``reset``)."""
        if self.network.mode == "none":
            return None
        data: dict[str, Any] = {"mode": self.network.effective_mode}
        if self.network.mode == "allow" and not self.network.allow:
            data["note"] = "empty allow-list: no network"
        if self.proxy is not None:
            data["proxy"] = f"{PROXY_HOST}:{self.network.proxy_port}"
            data.update(self.proxy.report(reset))
        if self.error is not None:
            data["error"] = self.error
        return data

    def report_since(self) -> dict[str, Any] | None:
        """``report`` of what happened since the last call only: each command of a session
        gets its own log, with its own bounds (the session's proxy serves them all)."""
        return self.report(reset=True)


def from_options(base: Network, mode: str | None, allow_hosts: tuple[str, ...]) -> Network:
    """The network of ``nsbox run --net MODE --allow-host HOST[:PORT]...``, over ``base``.

    ``--allow-host`` alone implies ``--net allow``; with ``--net none`` or ``loopback`` it is
    an error rather than silently ignored. Bad entries are PolicyErrors naming the entry.
    """
    if mode is None and not allow_hosts:
        return base
    if allow_hosts and mode not in (None, "allow"):
        raise PolicyError(
            f"needs --net allow, not --net {mode}", key="--allow-host",
            hint="drop --net, or use --net allow",
        )
    changes: dict[str, Any] = {"mode": "allow" if allow_hosts else mode}
    if allow_hosts:
        changes["allow"] = base.allow + tuple(allow_hosts)
    try:
        return dataclasses.replace(base, **changes)
    except PolicyError as exc:
        raise PolicyError(exc.message, key="--allow-host", hint=exc.hint) from None
