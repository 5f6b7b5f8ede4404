"""Is an address the host's own? The kernel's routing answers, once per destination checked.

The proxy runs in the launcher's network namespace, so a connection to any address of the
launcher's own interfaces (a public IPv4, a global IPv6, not only loopback) ends on this host,
at every service listening on 0.0.0.0 or [::]. Rather than listing the interfaces' addresses
(and missing local routes such as ``ip route add local 198.18.0.0/24 dev lo``), the proxy asks
what the kernel would do with a packet to the address, as ``ip route get`` does: an
RTM_GETROUTE request on a netlink socket (rtnetlink(7)). A route of type RTN_LOCAL means the
packet is delivered here. It is one round trip of a few microseconds at the time of the check,
so an address added during the run counts from then on.
"""

from __future__ import annotations

import errno
import socket
import struct

from nsbox.policy.netrules import IPAddress

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid (netlink(7))
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope,
#                                       type, flags (rtnetlink(7))
_RTATTR = struct.Struct("=HH")  # len, type
_NLMSG_ERROR = 2
_RTM_NEWROUTE = 24
_RTM_GETROUTE = 26
_NLM_F_REQUEST = 1
_RTA_DST = 1
_RTN_LOCAL = 2
_TYPE_OFFSET = _NLMSGHDR.size + 7  # rtm_type in the answer
# The lookup's own refusals: no route, or a route that refuses (unreachable, prohibit,
# blackhole). A connection to the address fails the same way, so it cannot reach this host.
_NO_ROUTE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EACCES, errno.EINVAL}


def is_this_host(addr: IPAddress, timeout: float = 1.0) -> bool:
    """Would a connection to ``addr`` from this network namespace end on this host? Raises
    OSError when the kernel cannot be asked: the caller refuses the address then."""
    packed = addr.packed
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    body = (_RTMSG.pack(family, len(packed) * 8, 0, 0, 0, 0, 0, 0, 0)
            + _RTATTR.pack(_RTATTR.size + len(packed), _RTA_DST) + packed)
    request = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), _RTM_GETROUTE, _NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.settimeout(timeout)
        sock.sendto(request + body, (0, 0))
        answer = sock.recv(65536)
    if len(answer) < _NLMSGHDR.size + 4:
        raise OSError(errno.EPROTO, f"short netlink answer to the route lookup of {addr}")
    kind = _NLMSGHDR.unpack_from(answer)[1]
    if kind == _NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", answer, _NLMSGHDR.size)
        if -err in _NO_ROUTE:
            return False
        raise OSError(-err, f"route lookup of {addr}: {errno.errorcode.get(-err, err)}")
    if kind != _RTM_NEWROUTE or len(answer) <= _TYPE_OFFSET:
        raise OSError(errno.EPROTO, f"unexpected netlink answer {kind} to the route lookup")
    return answer[_TYPE_OFFSET] == _RTN_LOCAL
