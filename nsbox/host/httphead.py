"""The HTTP side of allow mode's proxy (nsbox/host/netproxy.py): the request head a client
sends, what it names, and the error answers.

Only two forms are accepted: ``CONNECT host:port`` and a plain HTTP request with an absolute
URI (``GET http://host[:port]/path``), whose head is rewritten for the upstream server with
``Connection: close`` so one client connection is one upstream request. Every refusal is a
``Denied`` with the HTTP status to answer and a short reason for the log.
"""

from __future__ import annotations

import re

from nsbox.policy.netrules import (
    DEFAULT_CONNECT_PORT,
    DEFAULT_HTTP_PORT,
    normalize_host,
    parse_address,
    unmap,
)

MAX_HEAD = 64 * 1024  # bytes of request line + headers
_VISIBLE_LINE = re.compile(r"[!-~]+ [!-~]+ [!-~]+")
_NUMERIC = re.compile(r"[0-9]+|0x[0-9a-f]*")
# Hop-by-hop headers (RFC 9110, 7.6.1) and the proxy's own; never forwarded upstream.
_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate",
    "te", "trailer", "upgrade",
}


class Denied(Exception):
    """A refusal: the HTTP status to answer and the reason for the log. A reason may quote
    the sandbox's request as it came; whoever shows it to a person escapes it
    (nsbox/visible.py), as every sandbox-made text."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


_STATUS_TEXT = {
    400: "Bad Request", 403: "Forbidden", 405: "Method Not Allowed", 431: "Request Header Fields "
    "Too Large", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout",
}


def error_response(status: int, reason: str) -> bytes:
    body = f"nsbox proxy: {reason}\n".encode()
    head = (
        f"HTTP/1.1 {status} {_STATUS_TEXT.get(status, 'Error')}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


def parse_head(head: bytes) -> tuple[str, str, int, int, bytes]:
    """Method, host, port, default port and (plain HTTP) the head to send upstream."""
    lines = head.decode("latin-1").split("\r\n")
    if not _VISIBLE_LINE.fullmatch(lines[0]):
        # RFC 9112 3: the request line is visible ASCII and single spaces. Nothing else of it
        # is ever shown, put to a person (--ask) or connected to (rule net-authority).
        raise Denied(400, f"a control, non-ASCII or other invisible character in the request "
                          f"line {lines[0][:200]} (rule net-authority)")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise Denied(400, "not an HTTP/1.x request")
    method, target, version = parts
    if method == "CONNECT":
        host, port = authority(target, DEFAULT_CONNECT_PORT)
        return method, host, port, DEFAULT_CONNECT_PORT, b""
    if not target.lower().startswith("http://"):
        raise Denied(
            405 if target.startswith("/") else 403,
            "only CONNECT and absolute http:// requests are proxied",
        )
    after = target[len("http://"):]
    cut = min((i for i in (after.find("/"), after.find("?")) if i >= 0), default=len(after))
    place, path = after[:cut], after[cut:] or "/"
    if path.startswith("?"):
        path = "/" + path
    host, port = authority(place, DEFAULT_HTTP_PORT)
    out = [f"{method} {path} {version}", f"Host: {place}"]
    dropped = set(_HOP_BY_HOP)
    for line in lines[1:]:
        name = line.split(":", 1)[0].strip().lower()
        if name == "connection":
            dropped.update(t.strip().lower() for t in line.split(":", 1)[-1].split(","))
    for line in lines[1:]:
        name = line.split(":", 1)[0].strip().lower()
        if name not in dropped and name != "host":
            out.append(line)
    out.append("Connection: close")
    return method, host, port, DEFAULT_HTTP_PORT, ("\r\n".join(out) + "\r\n\r\n").encode(
        "latin-1"
    )


def authority(text: str, default_port: int) -> tuple[str, int]:
    """``host[:port]`` of a request target: the normalized host (or IP literal) and port."""
    if "@" in text:
        raise Denied(400, "user information in the request target")
    if "%" in text:
        # ipaddress takes any text after "%" as an IPv6 scope id, and the connection drops
        # it: "[::ffff:127.0.0.1%<anything>]" would read as one host and reach another.
        raise Denied(400, f"an IPv6 scope id (or a %-escape) in the host of {text[:200]} "
                          "(rule net-authority)")
    host, port_text = text, ""
    if text.startswith("["):
        close = text.find("]")
        host, port_text = text[: close + 1], text[close + 1 :].removeprefix(":")
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
    port = default_port
    if port_text:
        if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
            raise Denied(400, f"bad port in {text[:200]} (rule net-authority)")
        port = int(port_text)
    literal = parse_address(host)
    if literal is not None:
        return str(unmap(literal)), port  # one form: ::ffff:a.b.c.d is a.b.c.d
    name = normalize_host(host)
    if name is None:
        raise Denied(400, f"bad host name {host[:200]} (rule net-authority)")
    if _NUMERIC.fullmatch(name.rsplit(".", 1)[-1]):
        # "2130706433", "127.1", "0x7f.1": the resolver reads these as IPv4 addresses
        # (inet_aton(3)); only the dotted quad is an address here.
        raise Denied(400, f"{name} is a number, not a host name: write an IPv4 address as "
                          "a.b.c.d (rule net-authority)")
    return name, port
