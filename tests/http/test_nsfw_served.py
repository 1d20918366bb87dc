"""``nsfw-screen`` with its classifier served (KServe v2, TorchServe) against the in-process model's scores.

The served side is tests/served_vision.py: the same Open-NSFW weights behind each protocol's REST API,
run on the tensor or the bytes the gateway sends. Verdicts and scores must match the local backend's.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from prometheus_client import CollectorRegistry

from policies.media.models import NSFWModel
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer, audit_payload, free_port
from tests.media import data_uri, plain_image, png, skin_image
from tests.served_vision import LABELS, VisionServer

pytestmark = pytest.mark.timeout(180)

ADMIN = "0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b"


@pytest.fixture(scope="module")
def local() -> dict[str, float]:
    """The in-process model's scores of the two pictures, as the local backend gives them."""
    plain, skin = NSFWModel().score([plain_image(), skin_image()])
    assert skin > plain * 5, (plain, skin)
    return {"plain": plain, "skin": skin, "threshold": (plain + skin) / 2}


@pytest.fixture(scope="module")
def vision(bg):
    server = bg.run(VisionServer().start())
    yield server
    bg.run(server.stop())


def _gateway(bg, upstreams, tmp_path, served: dict, threshold: float, on_error: str = "fail_closed", **kw):
    config = {"threshold": threshold, "label": "nsfw", "served": served, **kw}
    chain = PolicyChainConfig(
        pre=[
            PolicySpec(name="media-fetch"),
            PolicySpec(name="media-limits"),
            PolicySpec(name="nsfw-screen", on_error=on_error, config=config),
        ]
    )
    settings = gateway_settings(
        upstreams,
        chain,
        auth={"required": False},
        admin={"api_key": ADMIN},
        audit={"sqlite_path": str(tmp_path / "audit.db")},
    )
    return GatewayServer(bg, settings, CollectorRegistry()).start()


def _served(url: str, endpoint: str, **kw) -> dict:
    labels = {"labels": LABELS} if endpoint == "kserve-v2" else {}
    return {"url": url, "model": "open-nsfw", "endpoint": endpoint, **labels, **kw}


def _post(server: GatewayServer, im) -> httpx.Response:
    part = {"type": "image_url", "image_url": {"url": data_uri("image/png", png(im))}}
    body = {
        "model": OMNI_MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}],
    }
    headers = {"x-secret-header": "never-to-the-guard"}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def _receipt(server: GatewayServer, r: httpx.Response) -> dict:
    payload = audit_payload(server.url, ADMIN, r.headers["x-request-id"])
    return {p["name"]: p for p in payload["policies"]}["nsfw-screen"]


@pytest.mark.parametrize(
    ("endpoint", "layout"), [("kserve-v2", "NHWC"), ("kserve-v2", "NCHW"), ("torchserve", "NHWC")]
)
def test_served_verdicts_match_the_local_model(bg, upstreams, tmp_path, vision, local, endpoint, layout):
    server = _gateway(
        bg, upstreams, tmp_path, _served(vision.url, endpoint), local["threshold"], layout=layout
    )
    before = vision.calls
    try:
        refused = _post(server, skin_image())
        served = _post(server, plain_image())
        receipts = [_receipt(server, refused), _receipt(server, served)]
    finally:
        server.stop()
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "content_policy_violation"
    assert served.status_code == 200, served.text
    assert vision.calls - before == 2
    for receipt, want in zip(receipts, (local["skin"], local["plain"]), strict=True):
        saw = receipt["saw"]
        assert saw["model"] == "open-nsfw" and saw["threshold"] == pytest.approx(local["threshold"])
        (part,) = saw["parts"]
        assert part["kind"] == "image" and part["width"] == 400 and part["height"] == 400
        assert part["score"] == pytest.approx(want, abs=1e-3)
    for request in vision.requests:  # only pixels: none of the client's headers reach the guard
        assert "x-secret-header" not in request.headers


def test_concurrent_requests_share_kserve_calls(bg, upstreams, tmp_path, vision, local):
    served = _served(vision.url, "kserve-v2", max_wait_ms=1000, max_batch=32, timeout_s=10)
    server = _gateway(bg, upstreams, tmp_path, served, local["threshold"])
    before = vision.calls
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            codes = [r.status_code for r in pool.map(lambda _: _post(server, plain_image()), range(6))]
    finally:
        server.stop()
    assert codes == [200] * 6
    assert vision.calls - before < 6  # windows shared across requests
    assert max(vision.batch_sizes) > 1


@pytest.mark.parametrize("endpoint", ["kserve-v2", "torchserve"])
@pytest.mark.parametrize("why", ["down", "slow"])
@pytest.mark.parametrize("on_error", ["fail_closed", "fail_open"])
def test_an_unavailable_classifier_follows_on_error(
    bg, upstreams, tmp_path, vision, local, endpoint, why, on_error
):
    url = f"http://127.0.0.1:{free_port()}" if why == "down" else vision.url
    served = _served(url, endpoint, timeout_s=0.5)
    server = _gateway(bg, upstreams, tmp_path, served, local["threshold"], on_error=on_error)
    vision.delay_s = 2.0 if why == "slow" else 0.0
    try:
        r = _post(server, plain_image())
        receipt = _receipt(server, r)
    finally:
        vision.delay_s = 0.0
        server.stop()
    if on_error == "fail_closed":
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "guard_unavailable" and "127.0.0.1" not in error["message"]
        assert receipt["verdict"] == "unavailable"
    else:
        assert r.status_code == 200, r.text
        assert "nsfw-screen=not_scanned" in r.headers["x-omnigate-guards"]
        assert receipt["verdict"] == "not_scanned"


@pytest.mark.parametrize(
    ("served", "why"),
    [
        ({"endpoint": "classify"}, "kserve-v2 or torchserve"),
        ({"endpoint": "kserve-v2"}, "served.labels"),
        ({"endpoint": "kserve-v2", "labels": ["safe", "unsafe"]}, "served.labels"),
    ],
)
def test_a_served_config_that_cannot_score_fails_the_boot(served, why):
    from pydantic import ValidationError

    from policies.nsfw import NSFWConfig

    with pytest.raises(ValidationError, match=why):
        NSFWConfig(served={"url": "http://nsfw:8000", "model": "open-nsfw", **served})
