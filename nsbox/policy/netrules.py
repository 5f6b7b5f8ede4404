"""The rules of the network proxy: allow-list entries and which addresses may be reached.

An allow-list entry is ``host[:port]``: a DNS name (``pypi.org``), a wildcard over the
sub-domains of a name (``*.example.org``, which does not match ``example.org`` itself) or an IP
literal (``127.0.0.1:8080``, ``[::1]:8080``). Without a port an entry allows 443 for CONNECT and
80 for plain HTTP requests.

Names are resolved on the host side and the proxy connects to an address it has checked here.
Addresses that lead to the host itself (its loopback, and any address of its own interfaces:
rule "this host"), its local networks or a cloud provider's metadata service are refused unless
the allow-list names that very address as a literal.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nsbox.errors import PolicyError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_CONNECT_PORT = 443
DEFAULT_HTTP_PORT = 80

# RFC 1123 labels; the underscore is tolerated because real service names use it.
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
_KEY = "network.allow"


@dataclass(frozen=True)
class AllowEntry:
    """One parsed allow-list entry. ``host`` is lower-case, without brackets or a final dot."""

    text: str  # as the user wrote it, for messages and the log
    host: str
    port: int | None  # None: 443 for CONNECT, 80 for plain HTTP
    wildcard: bool = False  # host is the parent domain; matches strict sub-domains only
    address: IPAddress | None = None  # set when the entry is an IP literal

    def matches(self, host: str, port: int, default_port: int) -> bool:
        """Does a request for ``host:port`` (host normalized) fall under this entry?"""
        if port != (self.port if self.port is not None else default_port):
            return False
        if self.address is not None:
            literal = parse_address(host)
            return literal is not None and unmap(literal) == unmap(self.address)
        if self.wildcard:
            return host.endswith("." + self.host)
        return host == self.host


def _bad(entry: str, why: str) -> PolicyError:
    return PolicyError(
        f"bad allow-list entry {entry!r}: {why}",
        key=_KEY,
        hint="write host[:port], e.g. pypi.org, api.example.com:443, '*.example.org', "
        "127.0.0.1:8080 or [::1]:8080",
    )


def parse_address(text: str) -> IPAddress | None:
    """The IP address ``text`` spells (IPv6 with or without brackets), else None. Never one
    with a scope id ("fe80::1%eth0"): ipaddress takes any text there, and a connection to the
    address drops it."""
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if "%" in text:
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def unmap(addr: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (::ffff:a.b.c.d) stands for its IPv4 address."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def normalize_host(host: str) -> str | None:
    """Lower-case a DNS name and drop a final dot; None if it is not a valid name."""
    host = host.lower()
    if host.endswith("."):
        host = host[:-1]
    if not host or len(host) > 253 or not host.isascii():
        return None
    if all(_LABEL.match(label) for label in host.split(".")):
        return host
    return None


def _parse_port(entry: str, text: str) -> int:
    if not text.isdigit() or not text.isascii():
        raise _bad(entry, f"port {text!r} is not a number")
    port = int(text)
    if not 1 <= port <= 65535:
        raise _bad(entry, f"port {port} is outside 1-65535")
    return port


def parse_entry(entry: str) -> AllowEntry:
    """Parse and validate one ``host[:port]`` entry; raises PolicyError naming it."""
    if not isinstance(entry, str):
        raise _bad(repr(entry), "not a string")
    text = entry.strip()
    if not text:
        raise _bad(entry, "empty")
    if "://" in text:
        raise _bad(entry, "no scheme: the proxy decides http or https by the request")
    if any(c in text for c in "/?#@ \t"):
        raise _bad(entry, "only host[:port], without path, user or spaces")

    host, port_text = text, None
    if text.startswith("["):  # [v6] or [v6]:port
        close = text.find("]")
        if close < 0:
            raise _bad(entry, "unclosed '['")
        host, rest = text[: close + 1], text[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise _bad(entry, "expected ':port' after ']'")
            port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    # More than one colon without brackets: a bare IPv6 address, no port.

    port = _parse_port(entry, port_text) if port_text is not None else None
    address = parse_address(host)
    if address is not None:
        return AllowEntry(entry, str(address), port, address=address)
    if host.startswith("["):
        raise _bad(entry, f"{host} is not an IPv6 address")

    wildcard = host.startswith("*.")
    name = host[2:] if wildcard else host
    if "*" in name:
        raise _bad(entry, "a wildcard is allowed only as the first label, as in '*.example.org'")
    normalized = normalize_host(name)
    if normalized is None:
        raise _bad(entry, f"{name!r} is not a valid host name")
    if wildcard and "." not in normalized:
        raise _bad(entry, f"'*.{normalized}' would match a whole top-level domain")
    return AllowEntry(entry, normalized, port, wildcard=wildcard)


def parse_allow_list(entries: tuple[str, ...] | list[str]) -> tuple[AllowEntry, ...]:
    return tuple(parse_entry(e) for e in entries)


# --- addresses that lead back to the host, its networks or metadata services -------------------

# Explicit tables instead of ipaddress's is_private/is_global, whose meaning changed between
# Python releases; each range carries the reason shown in the log.
_DENIED_V4 = [
    (ipaddress.ip_network(net), why)
    for net, why in (
        ("0.0.0.0/8", "unspecified"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "shared address space (CGNAT)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local (cloud metadata)"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation"),
        ("192.88.99.0/24", "6to4 relay"),
        ("192.168.0.0/16", "private"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),
        # Azure's host wire-server answers metadata-like requests on a public address.
        ("168.63.129.16/32", "cloud metadata"),
    )
]
_DENIED_V6 = [
    (ipaddress.ip_network(net), why)
    for net, why in (
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::/96", "IPv4-compatible"),
        ("64:ff9b:1::/48", "local NAT64"),
        ("100::/64", "discard"),
        ("2001::/32", "Teredo"),
        ("2001:db8::/32", "documentation"),
        ("fc00::/7", "unique local (private; includes cloud metadata fd00:ec2::254)"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local"),
        ("ff00::/8", "multicast"),
    )
]
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_6TO4 = ipaddress.ip_network("2002::/16")


THIS_HOST = "this host"  # the rule of an address of the host's own interfaces


def forbidden_reason(
    addr: IPAddress, this_host: Callable[[IPAddress], bool] | None = None
) -> str | None:
    """Why the proxy must not connect to ``addr`` (unless listed literally), or None.
    ``this_host`` tells whether an address is one of the host's own (nsbox/host/ownaddress.py:
    a public or global address of its interfaces leads to its services as surely as loopback);
    it may raise OSError, which the caller turns into a refusal."""
    if isinstance(addr, ipaddress.IPv6Address):
        embedded: ipaddress.IPv4Address | None = addr.ipv4_mapped or addr.sixtofour
        if embedded is None and addr in _NAT64:
            embedded = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
        if embedded is not None:
            inner = forbidden_reason(embedded, this_host)
            if inner:
                return f"{inner} (embedded {embedded})"
            if addr.ipv4_mapped is not None:
                return None  # the connection goes to the IPv4 address itself
        table = _DENIED_V6
    else:
        table = _DENIED_V4
    for net, why in table:
        if addr in net:
            return f"{why} address {addr}"
    if this_host is not None and this_host(addr):
        return f"{THIS_HOST} address {addr} (an address of its own interfaces)"
    return None


def literally_listed(entries: tuple[AllowEntry, ...], addr: IPAddress, port: int,
                     default_port: int) -> bool:
    """Is ``addr:port`` itself named by an IP-literal entry?"""
    return any(
        e.address is not None
        and unmap(e.address) == unmap(addr)
        and port == (e.port if e.port is not None else default_port)
        for e in entries
    )


def check_network(net: Any) -> None:
    """Validate a policy.Network (its __post_init__); raises PolicyError naming the field."""
    if net.mode not in ("none", "loopback", "allow"):
        raise PolicyError(
            f"unknown mode {net.mode!r}", key="network.mode", hint="use none, loopback or allow"
        )
    if isinstance(net.allow, str):
        raise PolicyError("must be a list of host[:port] entries, not a string", key=_KEY)
    parse_allow_list(net.allow)
    if not isinstance(net.proxy_port, int) or not 1 <= net.proxy_port <= 65535:
        raise PolicyError(f"{net.proxy_port!r} is not a port (1-65535)", key="network.proxy_port")
    for name in ("max_connections", "max_bytes"):
        value = getattr(net, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PolicyError(f"{value!r} is not a positive integer", key=f"network.{name}")
    for name in ("connect_timeout", "idle_timeout"):
        value = getattr(net, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise PolicyError(f"{value!r} is not a positive number of seconds",
                              key=f"network.{name}")
