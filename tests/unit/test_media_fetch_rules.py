"""The fetcher's address rules, checked without opening a socket (some of these addresses must never be dialled)."""

from __future__ import annotations

import ipaddress

import pytest
from pydantic import ValidationError
from yarl import URL

from core.errors import MediaURLForbidden
from policies.media.fetch import AddressPolicy, FetchConfig, SafeFetcher, literal_ip, refusal


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("100.64.0.1", "not-global"),  # shared address space (CGNAT)
        ("127.0.0.1", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("192.0.2.10", "private"),  # documentation
        ("::1", "loopback"),
        ("::", "unspecified"),
        ("fe80::1", "link-local"),
        ("fc00::1", "private"),
        ("ff02::1", "multicast"),
        ("::ffff:8.8.8.8", "ipv4-mapped"),  # mapped forms are refused even for public addresses
        ("::ffff:169.254.169.254", "ipv4-mapped"),
        ("2002:a9fe:a9fe::1", "embedded-ipv4"),  # 6to4 around 169.254.169.254
        ("64:ff9b::7f00:1", "embedded-ipv4"),  # NAT64 around 127.0.0.1
        ("::7f00:1", "embedded-ipv4"),  # IPv4-compatible 127.0.0.1
    ],
)
def test_refused_addresses(address, reason):
    assert refusal(ipaddress.ip_address(address)) == reason


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "2002:808:808::1"])
def test_public_addresses_pass(address):
    assert refusal(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize(
    ("host", "ip"),
    [
        ("2852039166", "169.254.169.254"),
        ("0xa9fea9fe", "169.254.169.254"),
        ("0251.0376.0251.0376", "169.254.169.254"),
        ("0xa9.254.0xa9.254", "169.254.169.254"),
        ("10.1", "10.0.0.1"),
        ("127.1", "127.0.0.1"),
        ("::ffff:a9fe:a9fe", "::ffff:a9fe:a9fe"),
        ("example.com", None),
        ("1e100.net", None),
    ],
)
def test_every_ipv4_spelling_is_read_as_its_address(host, ip):
    got = literal_ip(host)
    assert (str(got) if got is not None else None) == ip


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://2852039166/",
        "http://0xa9fea9fe/",
        "http://[::ffff:169.254.169.254]/",
        "http://10.0.0.1/",
        "http://192.168.0.1:8080/",
        "http://[fd00::1]/",
        "http://0251.0376.0251.0376/",
        "http://100.100.100.200/",
        "https://[fe80::a9fe:a9fe]/",
    ],
)
def test_metadata_and_private_urls_are_refused_before_any_socket(url):
    fetcher = SafeFetcher(FetchConfig())  # never started: a refusal here cannot have dialled anything
    with pytest.raises(MediaURLForbidden) as exc:
        fetcher.check_url(URL(url), "messages.0.content.0.image_url.url")
    assert exc.value.param == "messages.0.content.0.image_url.url"
    assert exc.value.status == 400


def test_allow_list_entries_open_exactly_what_they_name():
    policy = AddressPolicy(["media.corp.internal", "10.1.2.3:8443", "[fd00::5]:443", "192.168.50.0/24"])
    lo = ipaddress.ip_address("10.9.9.9")
    assert policy.check("media.corp.internal", 80, lo) is None
    assert policy.check("MEDIA.corp.internal.", 443, lo) is None
    assert policy.check("other.corp.internal", 80, lo) == "private"
    assert policy.check("x", 8443, ipaddress.ip_address("10.1.2.3")) is None
    assert policy.check("x", 80, ipaddress.ip_address("10.1.2.3")) == "private"
    assert policy.check("x", 443, ipaddress.ip_address("fd00::5")) is None
    assert policy.check("x", 1, ipaddress.ip_address("192.168.50.7")) is None
    assert policy.check("x", 1, ipaddress.ip_address("192.168.51.7")) == "private"


@pytest.mark.parametrize("entry", ["http://x/", "a b", "[fd00::1]x", "host:99999", "host:port"])
def test_bad_allow_list_entries_fail_the_config(entry):
    with pytest.raises(ValidationError):
        FetchConfig(internal_hosts=[entry])
