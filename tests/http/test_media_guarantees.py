"""Issue 15 end to end: whatever the chain, no client URL reaches an engine, and media work is bounded.

One gateway is configured the way the issue found it unsafe: a default chain with no media policy at
all, and a tenant policy set without ``media-fetch``. Every request goes over real sockets to the
scripted engine; what that engine received is checked, and a canary server on 127.0.0.1 records
whether anything reached it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.services import Services
from gateway.settings import Settings
from gateway.tenants import mint_key
from observability.metrics import Metrics
from policies.registry import PolicyConfigError
from policies.settings import PolicyChainConfig, PolicySpec
from tests import hostile_decoders
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer
from tests.media import Canary, data_uri, plain_image, png, tone, wav
from tests.unit.test_media_sandbox import ffconcat_script

pytestmark = pytest.mark.timeout(180)
KEY_BARE, KEY_DEFAULT, KEY_FRAMES = mint_key(), mint_key(), mint_key()
FRAME_BUDGET = 1000  # video.max_decoded_frames of the "frames" policy set (the default is 7,200)
GENERIC = "the media URL cannot be fetched"


@pytest.fixture(scope="module")
def canary(bg):
    c = bg.run(Canary().start())
    yield c
    bg.run(c.stop())


def _settings(upstreams, **extra) -> Settings:
    return gateway_settings(
        upstreams,
        PolicyChainConfig(pre=[PolicySpec(name="request-limits")]),  # no media-fetch, no media-limits
        policy_sets={
            "bare": PolicyChainConfig(pre=[PolicySpec(name="request-limits")]),
            "frames": PolicyChainConfig(
                pre=[
                    PolicySpec(name="request-limits"),
                    PolicySpec(name="media-limits", config={"video": {"max_decoded_frames": FRAME_BUDGET}}),
                ]
            ),
        },
        tenants=[
            {"name": "bare-tenant", "policy_set": "bare"},
            {"name": "plain-tenant"},
            {"name": "frames-tenant", "policy_set": "frames"},
        ],
        api_keys=[
            {"id": KEY_BARE.id, "tenant": "bare-tenant", "sha256": KEY_BARE.sha256},
            {"id": KEY_DEFAULT.id, "tenant": "plain-tenant", "sha256": KEY_DEFAULT.sha256},
            {"id": KEY_FRAMES.id, "tenant": "frames-tenant", "sha256": KEY_FRAMES.sha256},
        ],
        **extra,
    )


@pytest.fixture(scope="module")
def gw(bg, upstreams, tmp_path_factory):
    db = tmp_path_factory.mktemp("audit") / "audit.db"
    media = {"max_request_bytes": 3 * 1024 * 1024, "decode_deadline_s": 3, "decode_workers": 2}
    server = GatewayServer(
        bg, _settings(upstreams, media=media, audit={"sqlite_path": str(db)}), CollectorRegistry()
    ).start()
    yield server
    server.stop()


def _post(server, parts: list[dict], key=KEY_DEFAULT, timeout: float = 60) -> httpx.Response:
    body = {
        "model": OMNI_MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}],
    }
    return httpx.post(
        server.url + "/v1/chat/completions",
        json=body,
        timeout=timeout,
        headers={"authorization": f"Bearer {key.key}"},
    )


def _sent(upstream) -> str:
    return str(upstream.requests[-1]["messages"]) if upstream.requests else ""


@pytest.mark.parametrize("key", [KEY_DEFAULT, KEY_BARE], ids=["default-chain", "tenant-policy-set"])
@pytest.mark.parametrize("part", ["image_url", "audio_url", "video_url"])
def test_a_chain_without_media_fetch_never_lets_an_engine_fetch_a_url(gw, upstreams, canary, key, part):
    before = (upstreams.omni_a.request_count, len(canary.requests))
    resp = _post(gw, [{"type": part, part: {"url": f"http://127.0.0.1:{canary.port}/internal"}}], key=key)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "media_url_forbidden"
    assert err["param"] == f"messages.0.content.1.{part}.url"
    assert (upstreams.omni_a.request_count, len(canary.requests)) == before


def test_the_media_steps_are_in_every_resolved_chain(gw):
    names = [p.name for p in gw.services.chain.pre]
    assert names[:3] == ["request-limits", "media-fetch", "media-limits"]
    assert [p.name for p in gw.services.pipeline.chains["bare"].pre][1:3] == ["media-fetch", "media-limits"]
    assert all(not p.shadow for p in gw.services.chain.pre)


@pytest.mark.parametrize("where", ["policies", "policy_sets"])
@pytest.mark.parametrize("step", ["media-fetch", "media-limits"])
def test_a_media_step_in_shadow_mode_fails_the_boot_naming_the_chain(upstreams, where, step):
    shadow = PolicyChainConfig(pre=[PolicySpec(name=step, shadow=True)])
    extra = {"policies": shadow} if where == "policies" else {"policy_sets": {"lax": shadow}}
    settings = gateway_settings(upstreams, **extra)
    with pytest.raises(PolicyConfigError) as err:
        Services.build(settings, Metrics(CollectorRegistry()))
    prefix = "policies.pre[0].shadow" if where == "policies" else "policy_sets.lax: pre[0].shadow"
    assert str(err.value).startswith(prefix), err.value
    assert "shadow mode" in str(err.value)


def test_every_refused_address_gets_the_same_answer(gw, upstreams, canary):
    urls = [
        f"http://127.0.0.1:{canary.port}/",  # answers
        "http://127.0.0.1:1/",  # closed port
        "http://10.20.30.40/x.png",  # private
        "http://169.254.169.254/latest/meta-data/",  # metadata service
        "http://[fec0::1]/x",  # site-local
        "http://2130706433/",  # loopback, decimal
        "http://no-such-host.invalid/x.png",  # does not resolve
    ]
    answers = set()
    for url in urls:
        resp = _post(gw, [{"type": "image_url", "image_url": {"url": url}}])
        assert resp.status_code == 400, (url, resp.text)
        err = resp.json()["error"]
        answers.add((err["code"], err["message"]))
    assert answers == {("media_url_forbidden", f"messages.0.content.1.image_url.url: {GENERIC}")}
    assert canary.requests == []


def test_an_ffconcat_script_sent_as_audio_never_reads_a_host_file(gw, upstreams, tmp_path, monkeypatch):
    """The attack of tests/unit/test_media_sandbox.py through the front door, from the gateway's own cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recording-1.wav").write_bytes(wav(tone(2.0), 16000))
    script = base64.b64encode(ffconcat_script("recording-1.wav")).decode()
    before = upstreams.omni_a.request_count
    for part in (
        {"type": "input_audio", "input_audio": {"data": script, "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{script}"}},
        {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{script}"}},
    ):
        resp = _post(gw, [part])
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "invalid_media" and err["param"].startswith("messages.0.content.1.")
        assert "recording" not in err["message"] and "concat" not in err["message"]
    assert upstreams.omni_a.request_count == before


def test_many_large_parts_in_one_request_are_413_naming_the_part(gw, upstreams):
    """Eight 700 KB parts, each under every per-part cap; together over the request's 3 MiB."""
    blob = data_uri("audio/wav", wav(tone(22.0), 16000))
    before = upstreams.omni_a.request_count
    resp = _post(gw, [{"type": "audio_url", "audio_url": {"url": blob}} for _ in range(8)])
    assert resp.status_code == 413, resp.text
    err = resp.json()["error"]
    assert err["code"] == "media_too_large"
    assert err["param"] == "messages.0.content.5.audio_url.url"  # the part that crossed the budget
    assert upstreams.omni_a.request_count == before
    assert gw.services.media.inflight.used == 0  # the request's bytes were given back


def test_a_hanging_decoder_costs_its_request_a_400_while_others_are_served(gw, upstreams, monkeypatch):
    """A decoder made to hang inside C: the request gets a 400, a concurrent small request is not held up."""
    from policies.media import process

    monkeypatch.setattr(process, "process_part", hostile_decoders.hangs_in_c)
    image = {"type": "image_url", "image_url": {"url": data_uri("image/png", png(plain_image(64)))}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(_post, gw, [image])
        time.sleep(0.5)
        started = time.monotonic()
        clean = _post(gw, [])
        clean_s = time.monotonic() - started
        resp = hostile.result(timeout=60)
    assert clean.status_code == 200
    assert clean_s < 2.0, f"a clean request took {clean_s:.2f} s while a decoder hung"
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "invalid_media" and err["param"] == "messages.0.content.1.image_url.url"
    assert err["message"].endswith("the media took too long to decode")
    monkeypatch.undo()
    # The pool was replaced; ordinary media is decoded again.
    assert _post(gw, [image]).status_code == 200


def test_after_a_hot_reload_the_new_chain_still_fetches_and_bounds_media(bg, upstreams, canary, tmp_path):
    """A reload to a chain without any media policy: the added steps are started and serve like the first ones."""
    import yaml

    from gateway.reload import reload_config

    engine = {
        "name": "omni",
        "kind": "vllm-omni",
        "base_url": upstreams.omni_a.base_url,
        "model": "scripted",
        "serves": [OMNI_MODEL],
        "first_byte_timeout_s": 5,
        "read_timeout_s": 5,
    }
    doc = {
        "engines": [engine],
        "policies": {"pre": [{"name": "request-limits"}]},
        "audit": {"sqlite_path": str(tmp_path / "audit.db")},
        "logging": {"level": "warning"},
        "routing": {"controller": {"enabled": False}},
    }
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(doc))
    from gateway.settings import load_settings

    server = GatewayServer(bg, load_settings(path), CollectorRegistry(), config_path=str(path)).start()
    try:
        doc["policies"]["pre"] = [{"name": "request-limits", "config": {"max_messages": 64}}]
        path.write_text(yaml.safe_dump(doc))
        result = bg.run(reload_config(server.services, path))
        assert result.ok, result.message
        before = upstreams.omni_a.request_count
        body = {
            "model": OMNI_MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": f"http://127.0.0.1:{canary.port}/after-reload"},
                        }
                    ],
                }
            ],
        }
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["message"].endswith(GENERIC)
        assert canary.requests == [] and upstreams.omni_a.request_count == before
        image = {"type": "image_url", "image_url": {"url": data_uri("image/png", png(plain_image(64)))}}
        body["messages"][0]["content"] = [image]
        ok = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        # The new chain's media steps share the gateway's sandbox and byte budget.
        new = {p.name: p.impl for p in server.services.chain.pre}
        assert new["media-limits"].runtime is server.services.media
    finally:
        server.stop()


def test_fetched_parts_count_against_the_request_budget_while_they_stream(bg, upstreams, tmp_path):
    """Four 1 MB fetched parts, each under the per-part cap, side by side: 413 once together over 3 MiB."""
    from tests.media import MediaServer

    media = bg.run(MediaServer().start())
    chain = PolicyChainConfig(
        pre=[PolicySpec(name="media-fetch", config={"internal_hosts": [f"127.0.0.1:{media.port}"]})]
    )
    settings = gateway_settings(
        upstreams,
        chain,
        media={"max_request_bytes": 3 * 1024 * 1024},
        audit={"sqlite_path": str(tmp_path / "audit.db")},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    try:
        parts = [
            {
                "type": "audio_url",
                "audio_url": {
                    "url": media.add(f"a{i}.wav", "audio/wav", wav(tone(32.0, freq=200.0 + i), 16000))
                },
            }
            for i in range(4)
        ]
        before = upstreams.omni_a.request_count
        body = {"model": OMNI_MODEL, "messages": [{"role": "user", "content": parts}]}
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 413, resp.text
        err = resp.json()["error"]
        assert err["code"] == "media_too_large"
        assert err["param"] in {f"messages.0.content.{i}.audio_url.url" for i in range(4)}
        assert upstreams.omni_a.request_count == before
        assert server.services.media.inflight.used == 0
        # Under the budget, the same parts one at a time are served.
        ok = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=60,
            json={"model": OMNI_MODEL, "messages": [{"role": "user", "content": parts[:1]}]},
        )
        assert ok.status_code == 200, ok.text
    finally:
        server.stop()
        bg.run(media.stop())


def test_budgets_are_checked_from_probes_before_any_part_is_decoded(gw, upstreams):
    """Thirteen 1 MP JPEGs cut short (within vision_max_res, about 1,280 tokens each): their headers alone
    put the request over the modal budget, so the answer is the budget's, not the decode error each one
    would have raised."""
    from tests.media import jpeg

    whole = jpeg(plain_image(64).resize((1000, 1000)), quality=70)
    cut = whole[: len(whole) * 2 // 3]
    parts = [{"type": "image_url", "image_url": {"url": data_uri("image/jpeg", cut)}} for _ in range(13)]
    resp = _post(gw, parts)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "modal_budget_exceeded"
    one = _post(gw, parts[:1])  # alone, within budget: it is decoded, and refused as truncated
    assert one.status_code == 400 and one.json()["error"]["code"] == "invalid_media"


def test_one_modality_refusal_comes_before_decoding(bg, upstreams, tmp_path):
    chain = PolicyChainConfig(
        pre=[
            PolicySpec(name="media-fetch"),
            PolicySpec(name="media-limits", config={"one_modality_per_message": "refuse"}),
        ]
    )
    server = GatewayServer(
        bg,
        gateway_settings(upstreams, chain, audit={"sqlite_path": str(tmp_path / "a.db")}),
        CollectorRegistry(),
    ).start()
    try:
        garbage = base64.b64encode(b"RIFF\0\0\0\0WAVEjunk" * 10).decode()
        body = {
            "model": OMNI_MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": data_uri("image/png", png(plain_image(64)))},
                        },
                        {"type": "input_audio", "input_audio": {"data": garbage, "format": "wav"}},
                    ],
                }
            ],
        }
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "one_modality_per_message"
    finally:
        server.stop()


def test_requests_together_cannot_hold_more_media_than_the_process_budget(bg, upstreams, tmp_path):
    """Two requests of 1 MB audio against a 1.5 MB process budget: the second waits, then gets a 503,
    while the first's stream holds its bytes; once the first ends, the second is served."""
    import asyncio

    from tests.upstream import Script

    media = {"max_request_bytes": 1_500_000, "max_inflight_bytes": 1_500_000, "inflight_wait_s": 0.5}
    server = GatewayServer(
        bg,
        gateway_settings(upstreams, media=media, audit={"sqlite_path": str(tmp_path / "a.db")}),
        CollectorRegistry(),
    ).start()
    slow = Script(flavour="omni", text=" ".join(["word"] * 200), chunk_delay_s=0.05)
    for upstream in (upstreams.omni_a, upstreams.omni_b):
        upstreams.bg.call(lambda u=upstream: setattr(u, "default", slow))
    part = {"type": "audio_url", "audio_url": {"url": data_uri("audio/wav", wav(tone(30.0), 16000))}}
    body = {"model": OMNI_MODEL, "stream": True, "messages": [{"role": "user", "content": [part]}]}

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as first:
                assert first.status_code == 200
                lines = first.aiter_lines()  # kept: a dropped iterator closes the response
                await anext(lines)  # the first request is in flight, holding its bytes
                second = await client.post(
                    server.url + "/v1/chat/completions", json={**body, "stream": False}
                )
            upstreams.reset()  # the first stream was closed; answers are quick again
            await asyncio.sleep(0.2)
            third = await client.post(server.url + "/v1/chat/completions", json={**body, "stream": False})
            return second, third

    try:
        second, third = asyncio.run(go())  # the client on a loop of its own, not the gateway's
        assert second.status_code == 503, second.text
        assert second.json()["error"]["code"] == "overloaded" and second.headers.get("retry-after") == "1"
        assert third.status_code == 200, third.text
        assert server.services.media.inflight.used == 0
    finally:
        upstreams.reset()
        server.stop()


def _forwarded_frames(sent: dict) -> list[int]:
    """Frames in each video (or run of frame images) of one engine request, counted by decoding them."""
    from tests.media import decode_data_uri, video_facts

    counts = []
    for message in sent["messages"]:
        content = message["content"] if isinstance(message["content"], list) else []
        videos = [p["video_url"]["url"] for p in content if p["type"] == "video_url"]
        counts += [video_facts(decode_data_uri(url)[1])[0] for url in videos]
        images = sum(1 for p in content if p["type"] == "image_url")
        counts += [images] if images and not videos else []
    return counts


@pytest.mark.parametrize(
    ("key", "budget"),
    [(KEY_DEFAULT, 7200), (KEY_FRAMES, FRAME_BUDGET)],
    ids=["default-budget", "budget-1000"],
)
@pytest.mark.parametrize("last_s", [119.0, 100_000.0], ids=["claims-119s", "claims-28h"])
def test_a_video_with_lying_timestamps_is_decoded_within_the_frame_budget(gw, upstreams, key, budget, last_s):
    """8,000 frames 1/6000 s apart, then one at 119 s (or 28 hours): the header says two minutes (or
    more, trimmed to 120 s), so 2 fps sampling plans 240 frames and walks a stream whose frames all
    claim its first 1.3 s. Decoding stops after ``video.max_decoded_frames``: the engine gets exactly
    the samples that fall among the first ``budget`` frames (one per 0.5 s of their timestamps, so 3
    under the default 7,200 and 1 under 1,000), never the last frame, which lies past the budget (an
    unbounded decode of the 119 s one sends 4).
    A small request sent meanwhile is answered as usual."""
    from tests.media import lying_video

    data = lying_video(frames=8000, last_s=last_s)
    part = {"type": "video_url", "video_url": {"url": data_uri("video/mp4", data)}}
    before = upstreams.omni_a.request_count
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(_post, gw, [part], key)
        time.sleep(0.2)
        started = time.monotonic()
        clean = _post(gw, [])
        clean_s = time.monotonic() - started
        resp = hostile.result(timeout=120)
    assert clean.status_code == 200, clean.text
    assert clean_s < 2.0, f"a clean request took {clean_s:.2f} s while a lying video was decoded"
    assert resp.status_code == 200, resp.text
    assert upstreams.omni_a.request_count == before + 2
    sent = [r for r in upstreams.omni_a.requests[-2:] if "video_url" in str(r["messages"])]
    assert len(sent) == 1
    expected = 1 + int((budget - 1) / 6000 / 0.5)  # samples at 0, 0.5, 1.0 s among the decoded frames
    assert _forwarded_frames(sent[0]) == [expected]
    degraded = resp.headers.get("x-omnigate-degraded", "")
    assert ("video-trimmed" in degraded) == (last_s > 120)
