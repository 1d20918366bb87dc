"""SSRF: no spelling of an internal address, and no redirect, gets a request to the canary.

The canary listens on 127.0.0.1 and ::1. The gateway's fetcher allow-lists one
internal host (the media server, by host and port), which is how a legitimate
internal media host is opened and how the redirect attempts get a first hop.
"""

from __future__ import annotations

import socket
import urllib.parse

import httpx
import pytest
from prometheus_client import CollectorRegistry

from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer
from tests.media import Canary, MediaServer, plain_image, png

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def rig(bg, upstreams):
    media = bg.run(MediaServer().start())
    canary = bg.run(Canary().start())
    chain = PolicyChainConfig(
        pre=[
            PolicySpec(name="request-limits"),
            PolicySpec(
                name="media-fetch",
                config={
                    "internal_hosts": [f"127.0.0.1:{media.port}"],
                    "max_redirects": 3,
                    "total_timeout_s": 5,
                    "max_image_bytes": 1024 * 1024,
                },
            ),
            PolicySpec(name="media-limits"),
        ]
    )
    server = GatewayServer(bg, gateway_settings(upstreams, chain), CollectorRegistry()).start()
    yield server, media, canary
    server.stop()
    bg.run(media.stop())
    bg.run(canary.stop())


def _ask(server: GatewayServer, url: str) -> httpx.Response:
    body = {
        "model": OMNI_MODEL,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


def _bypass_urls(p: int, media: MediaServer) -> list[str]:
    direct = [
        f"http://127.0.0.1:{p}/",
        f"http://localhost:{p}/",
        f"http://LOCALHOST:{p}/",
        f"http://localhost.:{p}/",
        f"http://ⓛⓞⓒⓐⓛⓗⓞⓢⓣ:{p}/",  # IDNA folds it to "localhost"
        f"http://2130706433:{p}/",  # decimal
        f"http://0x7f000001:{p}/",  # hex
        f"http://017700000001:{p}/",  # octal
        f"http://0x7f.0.0.1:{p}/",  # dotted hex
        f"http://0177.0.0.1:{p}/",  # dotted octal
        f"http://127.1:{p}/",  # short form
        f"http://127.0.1:{p}/",
        f"http://127.0.0.1.:{p}/",  # trailing dot
        f"http://[::1]:{p}/",
        f"http://[0:0:0:0:0:0:0:1]:{p}/",
        f"http://[::ffff:127.0.0.1]:{p}/",  # IPv4-mapped
        f"http://[::ffff:7f00:1]:{p}/",
        f"http://0.0.0.0:{p}/",  # the unspecified address reaches local listeners on Linux
        f"http://0:{p}/",
        f"http://[::]:{p}/",
        f"http://user:secret@127.0.0.1:{p}/",
        f"http://example.com@127.0.0.1:{p}/",
        f"http://127.0.0.1:{p}#@example.com/",
        "file:///etc/passwd",
        f"gopher://127.0.0.1:{p}/_GET%20/",
        f"ftp://127.0.0.1:{p}/",
        f"dict://127.0.0.1:{p}/",
        f"http://[::1]:{p}/%2e%2e/",
        f"http://[fe80::1%25lo]:{p}/",
    ]
    hostname = socket.gethostname()
    try:
        if socket.gethostbyname(hostname).startswith("127."):
            direct.append(f"http://{hostname}:{p}/")  # a name this machine maps to loopback
    except OSError:
        pass
    hop = f"{media.base}/redirect?to="
    redirects = [
        hop + urllib.parse.quote(f"http://127.0.0.1:{p}/", safe=""),
        hop + urllib.parse.quote(f"http://localhost:{p}/", safe=""),
        hop + urllib.parse.quote(f"http://[::1]:{p}/", safe=""),
        hop + urllib.parse.quote(f"http://2130706433:{p}/", safe=""),
        hop + urllib.parse.quote("file:///etc/passwd", safe=""),
        hop
        + urllib.parse.quote(hop + urllib.parse.quote(f"http://0.0.0.0:{p}/", safe=""), safe=""),  # two hops
        f"{media.base}/loop",  # redirects forever: the hop bound ends it
    ]
    return direct + redirects


def test_canary_sees_no_request_across_bypass_attempts(rig, ups):
    server, media, canary = rig
    urls = _bypass_urls(canary.port, media)
    assert len(urls) >= 25
    for url in urls:
        resp = _ask(server, url)
        assert resp.status_code == 400, (url, resp.text)
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == "messages.0.content.1.image_url.url", url
        assert err["code"] in ("media_url_forbidden", "media_fetch_failed"), (url, err)
    assert canary.requests == [], canary.requests
    assert ups.omni_a.request_count == 0
    # The redirects were really followed up to the refused hop.
    assert sum(1 for h in media.hits if h.startswith("/redirect")) >= 6
    assert media.hits.count("/loop") == 4  # first hop + 3 redirects, then refused


def test_canary_is_reachable_when_allow_listed(bg, upstreams, ups):
    """The control: the same canary URL works once an operator allow-lists it, so the test above is sharp."""
    canary = bg.run(Canary().start())
    chain = PolicyChainConfig(
        pre=[
            PolicySpec(name="media-fetch", config={"internal_hosts": [f"127.0.0.1:{canary.port}"]}),
            PolicySpec(name="media-limits"),
        ]
    )
    server = GatewayServer(bg, gateway_settings(upstreams, chain), CollectorRegistry()).start()
    try:
        resp = _ask(server, f"http://127.0.0.1:{canary.port}/pic.png")
        assert resp.status_code == 200, resp.text
        assert len(canary.requests) == 1
        sent = upstreams.omni_a.requests[-1]["messages"][0]["content"][1]["image_url"]["url"]
        assert sent.startswith("data:image/png;base64,")
    finally:
        server.stop()
        bg.run(canary.stop())


def test_refusals_are_counted(rig, ups):
    server, _, canary = rig
    _ask(server, f"http://127.0.0.1:{canary.port}/")
    metrics = httpx.get(server.url + "/metrics").text
    assert 'omnigate_media_fetches_total{outcome="forbidden"}' in metrics


def test_byte_cap_is_enforced_while_streaming(rig, ups):
    server, media, _ = rig
    resp = _ask(server, f"{media.base}/endless")
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "media_too_large"


def test_http_errors_and_unreachable_hosts_are_400(rig, ups):
    server, media, _ = rig
    resp = _ask(server, f"{media.base}/m/missing.png")
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "media_fetch_failed"
    assert "404" in resp.json()["error"]["message"]


def test_allow_listed_media_is_fetched_and_sent_as_data(rig, ups):
    server, media, _ = rig
    url = media.add("small.png", "image/png", png(plain_image(64)))
    resp = _ask(server, url)
    assert resp.status_code == 200, resp.text
    sent = ups.omni_a.requests[-1]["messages"][0]["content"][1]["image_url"]["url"]
    assert sent.startswith("data:image/png;base64,")
    assert "http" not in sent[:30]
