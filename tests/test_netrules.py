"""Allow-list parsing and the address rules of the proxy."""

from __future__ import annotations

import ipaddress

import pytest

from nsbox.errors import PolicyError
from nsbox.policy.netrules import forbidden_reason, parse_entry
from nsbox.policy.policy import Network


@pytest.mark.parametrize(
    ("text", "host", "port", "wildcard"),
    [
        ("pypi.org", "pypi.org", None, False),
        ("API.Example.com:443", "api.example.com", 443, False),
        ("*.example.org", "example.org", None, True),
        ("files.pythonhosted.org.", "files.pythonhosted.org", None, False),
        ("127.0.0.1:8080", "127.0.0.1", 8080, False),
        ("[::1]:8080", "::1", 8080, False),
        ("::1", "::1", None, False),
    ],
)
def test_good_entries(text: str, host: str, port: int | None, wildcard: bool) -> None:
    entry = parse_entry(text)
    assert (entry.host, entry.port, entry.wildcard) == (host, port, wildcard)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("  ", "empty"),
        ("https://pypi.org", "no scheme"),
        ("pypi.org/simple", "without path"),
        ("user@pypi.org", "without path, user"),
        ("pypi.org:0", "outside 1-65535"),
        ("pypi.org:65536", "outside 1-65535"),
        ("pypi.org:https", "not a number"),
        ("pypi.org:", "not a number"),
        ("a.*.org", "wildcard is allowed only as the first label"),
        ("*example.org", "wildcard is allowed only as the first label"),
        ("example.*", "wildcard is allowed only as the first label"),
        ("*", "wildcard is allowed only as the first label"),
        ("*.org", "whole top-level domain"),
        ("bad_host!.org", "not a valid host name"),
        ("[::1", "unclosed"),
        ("[pypi.org]:443", "not an IPv6 address"),
        ("exa mple.org", "without path, user or spaces"),
    ],
)
def test_bad_entries_are_policy_errors_naming_the_entry(text: str, why: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_entry(text)
    assert info.value.key == "network.allow"
    assert repr(text) in str(info.value)
    assert why in str(info.value)


def test_network_policy_validates_its_allow_list() -> None:
    with pytest.raises(PolicyError, match=r"'https://x.org'.*no scheme"):
        Network(mode="allow", allow=("pypi.org", "https://x.org"))
    with pytest.raises(PolicyError, match="not a string"):
        Network(mode="allow", allow="pypi.org")  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="unknown mode 'all'"):
        Network(mode="all")  # type: ignore[arg-type]
    with pytest.raises(PolicyError) as info:
        Network(mode="allow", allow=("pypi.org",), proxy_port=0)
    assert info.value.key == "network.proxy_port"


def test_empty_allow_list_means_no_network() -> None:
    assert Network(mode="allow", allow=()).effective_mode == "none"
    assert Network(mode="allow", allow=("pypi.org",)).effective_mode == "allow"
    assert Network().effective_mode == "none"


def test_matching_uses_the_default_port_of_the_method() -> None:
    entry = parse_entry("pypi.org")
    assert entry.matches("pypi.org", 443, default_port=443)
    assert entry.matches("pypi.org", 80, default_port=80)
    assert not entry.matches("pypi.org", 80, default_port=443)
    assert not entry.matches("evil-pypi.org", 443, default_port=443)
    wild = parse_entry("*.example.org:8443")
    assert wild.matches("a.b.example.org", 8443, default_port=443)
    assert not wild.matches("example.org", 8443, default_port=443)
    assert not wild.matches("badexample.org", 8443, default_port=443)
    literal = parse_entry("127.0.0.1:81")
    assert literal.matches("127.0.0.1", 81, default_port=80)
    assert literal.matches("::ffff:127.0.0.1", 81, default_port=80)
    assert not literal.matches("localhost", 81, default_port=80)


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("10.1.2.3", "private"),
        ("172.31.255.255", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local (cloud metadata)"),
        ("100.100.100.200", "CGNAT"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.251", "multicast"),
        ("255.255.255.255", "reserved"),
        ("168.63.129.16", "cloud metadata"),
        ("::1", "loopback"),
        ("::", "unspecified"),
        ("fd00:ec2::254", "unique local"),
        ("fe80::1", "link-local"),
        ("ff02::1", "multicast"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "link-local"),
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of 169.254.169.254
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("::7f00:1", "IPv4-compatible"),
    ],
)
def test_forbidden_addresses(address: str, why: str) -> None:
    reason = forbidden_reason(ipaddress.ip_address(address))
    assert reason is not None and why in reason


@pytest.mark.parametrize(
    "address", ["93.184.215.14", "151.101.0.223", "2a04:4e42::223", "::ffff:151.101.0.223",
                "172.32.0.1", "100.128.0.1"]
)
def test_public_addresses_pass(address: str) -> None:
    assert forbidden_reason(ipaddress.ip_address(address)) is None
