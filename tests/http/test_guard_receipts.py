"""Guard receipts: what each guard looked at, in the audit record, the response header and the search.

A request with two images and a spoken part through a chain of the media screens (nsfw-screen on the
images, audio-screen on the speech) and a text guard served over HTTP (tests/plugins.py ``served-guard``):
the nsfw-screen's receipt names both images with their sizes as the engine got them and the model's weights
digest; the audio-screen's the speech's length; the served guard's the messages and characters it read.
With the served guard's model down, ``on_error: fail_closed`` (the default) refuses the request with 503
``guard_unavailable`` and its receipt says why; ``fail_open`` serves it, and the receipt, the header and
the search say it was not scanned.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from policies.registry import available_plugins
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import GatewayServer, audit_payload, free_port
from tests.media import data_uri, plain_image, png, speech, video
from tests.plugins import PLUGINS
from tests.stores import fresh_pg_database
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(180)

ADMIN = "8c1f0e9a7b3d2e8f4a6c1b9d0e7f3a2c5b8d4e1f"


@pytest.fixture(scope="module")
def engine(bg):
    up = ScriptedUpstream(Script(flavour="vllm", text="I see two pictures and hear you."))
    bg.run(up.start())
    yield up
    bg.run(up.stop())


@pytest.fixture(scope="module")
def guard_model(bg):
    """The served guard's model: a classifier endpoint scoring every text as harmless."""

    async def classify(request: web.Request) -> web.Response:
        await request.json()
        return web.json_response({"score": 0.01})

    async def start() -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_post("/classify", classify)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, port

    runner, port = bg.run(start())
    yield f"http://127.0.0.1:{port}/classify"
    bg.run(runner.cleanup())


def _gateway(
    bg, engine, tmp_path, guard_url: str, on_error: str = "fail_closed", audit: dict | None = None
) -> GatewayServer:
    pre = [
        PolicySpec(name=n)
        for n in ("load-shedding", "request-limits", "media-fetch", "media-limits", "nsfw-screen")
    ]
    pre += [
        PolicySpec(name="audio-screen"),
        PolicySpec(name="served-guard", on_error=on_error, config={"url": guard_url}),
    ]
    settings = Settings(
        engines=[
            EngineConfig(
                name="e",
                kind="vllm",
                base_url=engine.base_url,
                model="m",
                serves=["m"],
                input_modalities=["text", "image", "audio", "video"],
                video_input="video",
            )
        ],
        policies=PolicyChainConfig(pre=pre),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
        auth={"required": False},
        admin={"api_key": ADMIN},
        audit=audit or {"sqlite_path": str(tmp_path / "audit.db")},
    )
    return GatewayServer(
        bg, settings, CollectorRegistry(), plugins={**available_plugins(), **PLUGINS}
    ).start()


def _body() -> dict:
    image = {"type": "image_url", "image_url": {"url": data_uri("image/png", png(plain_image(320)))}}
    other = {"type": "image_url", "image_url": {"url": data_uri("image/png", png(plain_image(200)))}}
    spoken = {
        "type": "input_audio",
        "input_audio": {"data": _b64(speech("what do you see")), "format": "wav"},
    }
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Describe what you are given."},
            {"role": "user", "content": [{"type": "text", "text": "Look and listen."}, image, other, spoken]},
        ],
    }


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def _record(server: GatewayServer, rid: str) -> dict:
    return audit_payload(server.url, ADMIN, rid)


def _receipts(payload: dict) -> dict[str, dict]:
    return {p["name"]: p for p in payload["policies"]}


def test_receipts_name_every_part_each_guard_saw(bg, engine, guard_model, tmp_path):
    server = _gateway(bg, engine, tmp_path, guard_model)
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json=_body(), timeout=60)
        assert r.status_code == 200, r.text
        guards = dict(kv.split("=") for kv in r.headers["x-omnigate-guards"].split(", "))
        assert guards["nsfw-screen"] == "accept" and guards["served-guard"] == "accept"
        assert guards["audio-screen"] == "accept"
        receipts = _receipts(_record(server, r.headers["x-request-id"]))
    finally:
        server.stop()

    nsfw = receipts["nsfw-screen"]
    assert nsfw["complete"] is True and nsfw["mode"] == "enforce"
    saw = nsfw["saw"]
    assert saw["model"] == "open-nsfw" and saw["model_digest"].startswith("sha256:")
    assert saw["threshold"] == 0.8
    images = [p for p in saw["parts"] if p["kind"] == "image"]
    assert [p["part"] for p in images] == ["messages.1.content.1", "messages.1.content.2"]
    assert [(p["width"], p["height"]) for p in images] == [(320, 320), (200, 200)]
    assert all(0 <= p["score"] < 0.8 for p in images)

    heard = receipts["audio-screen"]["saw"]
    (audio,) = heard["parts"]
    # Paths are the parts as the engine gets them: media-limits moved the speech to a message of its own
    # (one non-text modality per message), so the client's messages.1.content.3 is messages.2.content.0.
    assert audio["part"] == "messages.2.content.0" and audio["kind"] == "audio"
    assert 300 < audio["ms"] < 5000 and heard["model"] == "whisper-tiny.en"
    assert heard["model_digest"].startswith("sha256:")

    text = receipts["served-guard"]["saw"]
    assert text["text"] == {
        "messages": [0, 1],
        "chars": len("Describe what you are given.") + len("Look and listen."),
    }
    assert receipts["served-guard"]["complete"] is True


def test_a_guard_whose_model_is_down_fails_closed(bg, engine, tmp_path):
    down = f"http://127.0.0.1:{free_port()}/classify"  # nothing listens there
    server = _gateway(bg, engine, tmp_path, down)
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json=_body(), timeout=60)
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "guard_unavailable" and "served-guard" in error["message"]
        assert "127.0.0.1" not in error["message"]  # the model's address is not the client's business
        receipt = _receipts(_record(server, r.headers["x-request-id"]))["served-guard"]
    finally:
        server.stop()
    assert receipt["verdict"] == "unavailable" and receipt["complete"] is False
    assert receipt["saw"]["missed"] == [{"part": "*", "why": "guard_unavailable"}]
    assert receipt["saw"]["on_error"] == "fail_closed"


@pytest.fixture(params=["sqlite", "postgres"])
def audit_store(request, tmp_path):
    """The two audit stores each search receipts in their own SQL (JSON functions of SQLite, jsonb of
    PostgreSQL)."""
    if request.param == "sqlite":
        yield {"sqlite_path": str(tmp_path / "audit.db")}
        return
    with fresh_pg_database() as dsn:
        yield {"store": "postgres", "postgres_dsn": dsn}


def test_fail_open_serves_and_says_it_was_not_scanned(bg, engine, tmp_path, audit_store):
    down = f"http://127.0.0.1:{free_port()}/classify"
    server = _gateway(bg, engine, tmp_path, down, on_error="fail_open", audit=audit_store)
    headers = {"authorization": f"Bearer {ADMIN}"}
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json=_body(), timeout=60)
        assert r.status_code == 200, r.text
        assert "served-guard=not_scanned" in r.headers["x-omnigate-guards"]
        rid = r.headers["x-request-id"]
        receipt = _receipts(_record(server, rid))["served-guard"]
        assert receipt["verdict"] == "not_scanned" and receipt["complete"] is False
        assert receipt["saw"]["on_error"] == "fail_open"
        # "requests where served-guard did not scan everything": found by the search, the others not
        found = httpx.get(
            server.url + "/admin/audit/records", params={"unscanned": "served-guard"}, headers=headers
        ).json()["records"]
        assert [x["request_id"] for x in found] == [rid]
        assert "served-guard:not_scanned (not all scanned)" in found[0]["policies"]
        none = httpx.get(
            server.url + "/admin/audit/records", params={"unscanned": "nsfw-screen"}, headers=headers
        ).json()["records"]
        assert none == []
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("on_error", ["fail_closed", "fail_open"])
def test_a_post_check_whose_model_is_down_follows_its_on_error(bg, engine, tmp_path, stream, on_error):
    """The answer's check (held back whole when streamed) cannot reach its model: refused before any of
    the answer goes out (closed), or served with the receipt saying it was not scanned (open)."""
    down = f"http://127.0.0.1:{free_port()}/classify"
    settings = Settings(
        engines=[EngineConfig(name="e", kind="vllm", base_url=engine.base_url, model="m", serves=["m"])],
        policies=PolicyChainConfig(
            pre=[], post=[PolicySpec(name="served-check", on_error=on_error, config={"url": down})]
        ),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
        auth={"required": False},
        admin={"api_key": ADMIN},
        audit={"sqlite_path": str(tmp_path / "audit.db")},
    )
    plugins = {**available_plugins(), **PLUGINS}
    server = GatewayServer(bg, settings, CollectorRegistry(), plugins=plugins).start()
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        receipt = _receipts(_record(server, r.headers["x-request-id"]))["served-check"]
    finally:
        server.stop()
    if on_error == "fail_closed":
        assert r.status_code == 503 and r.json()["error"]["code"] == "guard_unavailable"
        assert receipt["verdict"] == "unavailable"
    else:
        assert r.status_code == 200 and "pictures" in r.text  # the answer, whole or in pieces
        assert receipt["verdict"] == "not_scanned"
    assert receipt["complete"] is False and receipt["saw"]["on_error"] == on_error


def test_a_videos_receipt_says_how_many_of_its_frames_were_scored(bg, engine, guard_model, tmp_path):
    server = _gateway(bg, engine, tmp_path, guard_model)
    clip = video(20.0, fps=4, frame_fn=lambda i: np.full((240, 320, 3), (40, 60, 200), np.uint8))
    part = {"type": "video_url", "video_url": {"url": data_uri("video/mp4", clip)}}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, part]}],
    }
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        receipts = _receipts(_record(server, r.headers["x-request-id"]))
    finally:
        server.stop()
    (seen,) = receipts["nsfw-screen"]["saw"]["parts"]
    # media-limits forwards 40 frames (2 a second over 20 s); the screen scores 16 of them
    # (max_video_frames), and the engine gets the video cut to those
    assert (seen["kind"], seen["frames"], seen["of"]) == ("video", 16, 40)
