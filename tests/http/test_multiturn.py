"""Multi-turn conversations as clients continue them: a spoken answer sent back by its audio id (OpenAI's
reference shape) or echoed whole (the SDKs' habit) reaches the engine as the text it said, never as audio;
an id the gateway did not serve, one that expired or one of another tenant's is a 400."""

from __future__ import annotations

import base64
import time

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.answer_audio import Spoken, audio_id
from gateway.tenants import mint_key
from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer
from tests.upstream import Script

pytestmark = pytest.mark.timeout(60)

SAID = "The capital of France is Paris."
SPEECH = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}


@pytest.fixture(scope="module")
def keys():
    return {name: mint_key() for name in ("alice", "bob")}


@pytest.fixture(scope="module")
def server(bg, upstreams, keys):
    settings = gateway_settings(
        upstreams,
        tenants=[{"name": "alice"}, {"name": "bob"}],
        api_keys=[{"id": k.id, "tenant": name, "sha256": k.sha256} for name, k in keys.items()],
    )
    s = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield s
    s.stop()


@pytest.fixture
def fresh(upstreams, server):
    upstreams.reset()
    server.bg.run(server.services.pool.probe_now())
    upstreams.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=2)
    return upstreams


def _post(server, keys, body: dict, tenant: str = "alice") -> httpx.Response:
    headers = {"Authorization": f"Bearer {keys[tenant].key}"}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=20)


def _ask(messages: list[dict], **more) -> dict:
    return {"model": OMNI_MODEL, "messages": messages, **SPEECH, **more}


def _assistant_turns(upstream) -> list[dict]:
    return [m for m in upstream.requests[-1]["messages"] if m["role"] == "assistant"]


def test_a_spoken_answer_sent_back_by_its_id_reaches_the_engine_as_its_transcript(server, keys, fresh):
    first = [{"role": "user", "content": "What is the capital of France?"}]
    answer = _post(server, keys, _ask(first))
    assert answer.status_code == 200, answer.text
    audio = answer.json()["choices"][0]["message"]["audio"]
    assert audio["transcript"] == SAID and audio["data"]

    turns = [
        *first,
        {"role": "assistant", "audio": {"id": audio["id"]}},
        {"role": "user", "content": "And Spain?"},
    ]
    again = _post(server, keys, _ask(turns))
    assert again.status_code == 200, again.text
    assert _assistant_turns(fresh.omni_a) == [{"role": "assistant", "content": SAID}]


def test_an_answer_echoed_whole_is_accepted_and_its_audio_never_forwarded(server, keys, fresh):
    first = [{"role": "user", "content": "What is the capital of France?"}]
    message = _post(server, keys, _ask(first)).json()["choices"][0]["message"]
    message.update(refusal=None, annotations=[], function_call=None, reasoning_content="I recall it.")
    turns = [*first, message, {"role": "user", "content": "Say it again."}]
    again = _post(server, keys, _ask(turns))
    assert again.status_code == 200, again.text
    sent = orjson.dumps(fresh.omni_a.requests[-1])
    assert message["audio"]["data"].encode() not in sent and b"I recall it." not in sent
    assert _assistant_turns(fresh.omni_a) == [{"role": "assistant", "content": SAID}]


def test_a_streamed_spoken_answer_can_be_sent_back_by_its_id(server, keys, fresh):
    first = [{"role": "user", "content": "What is the capital of France?"}]
    ids, transcript, audio = set(), [], b""
    headers = {"Authorization": f"Bearer {keys['alice'].key}"}
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json=_ask(first, stream=True),
        headers=headers,
        timeout=20,
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in orjson.loads(line[6:])["choices"]:
                piece = choice["delta"].get("audio")
                if piece:
                    ids.add(piece["id"])
                    transcript.append(piece.get("transcript") or "")
                    audio += base64.b64decode(piece.get("data") or "")
    assert len(ids) == 1 and "".join(transcript) == SAID and audio
    # The SDK's accumulated shape: the id with the transcript (no data), answered at once after [DONE].
    turn = {"role": "assistant", "audio": {"id": ids.pop(), "transcript": SAID}}
    again = _post(server, keys, _ask([*first, turn, {"role": "user", "content": "Thanks."}]))
    assert again.status_code == 200, again.text
    assert _assistant_turns(fresh.omni_a) == [{"role": "assistant", "content": SAID}]


def _refused(resp: httpx.Response, index: int = 1) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "audio_not_found"
    assert error["param"] == f"messages.{index}.audio.id"
    assert error["type"] == "invalid_request_error"


def test_an_unknown_audio_id_is_a_clear_400(server, keys, fresh):
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "audio": {"id": "audio_never-served"}},
        {"role": "user", "content": "Go on."},
    ]
    _refused(_post(server, keys, _ask(turns)))
    assert fresh.omni_a.requests == []


def test_an_expired_audio_id_is_a_clear_400(server, keys, fresh):
    answers = server.services.pipeline.answers
    gone = audio_id("expired-request")
    server.bg.run(answers.store.put(gone, Spoken("Old words.", time.time() - 1, "alice")))
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "audio": {"id": gone}}]
    _refused(_post(server, keys, _ask([*turns, {"role": "user", "content": "Go on."}])))
    # The same entry while it was live resolves: what refused it is its expiry.
    server.bg.run(answers.store.put(gone, Spoken("Old words.", time.time() + 60, "alice")))
    assert _post(server, keys, _ask([*turns, {"role": "user", "content": "Go on."}])).status_code == 200


def test_another_tenants_audio_id_is_refused_as_unknown(server, keys, fresh):
    first = [{"role": "user", "content": "What is the capital of France?"}]
    audio = _post(server, keys, _ask(first), tenant="alice").json()["choices"][0]["message"]["audio"]
    turns = [
        *first,
        {"role": "assistant", "audio": {"id": audio["id"]}},
        {"role": "user", "content": "More."},
    ]
    _refused(_post(server, keys, _ask(turns), tenant="bob"))
    assert _post(server, keys, _ask(turns), tenant="alice").status_code == 200


def test_a_text_model_takes_the_spoken_turn_as_text_too(server, keys, fresh):
    first = [{"role": "user", "content": "What is the capital of France?"}]
    audio = _post(server, keys, _ask(first)).json()["choices"][0]["message"]["audio"]
    body = {
        "model": TEXT_MODEL,
        "messages": [
            *first,
            {"role": "assistant", "audio": {"id": audio["id"]}},
            {"role": "user", "content": "Ok"},
        ],
    }
    resp = _post(server, keys, body)
    assert resp.status_code == 200, resp.text
    assert _assistant_turns(fresh.vllm) == [{"role": "assistant", "content": SAID}]


def test_the_in_process_store_is_bounded(bg):
    from gateway.answer_audio import MemoryAnswers

    store = MemoryAnswers(max_answers=3, max_chars=10)
    live = time.time() + 60

    async def fill() -> list:
        for i in range(5):
            await store.put(f"a{i}", Spoken("xy", live, None))
        kept = [await store.get(f"a{i}") for i in range(5)]
        await store.put("long", Spoken("z" * 9, live, None))  # over the characters: the oldest go first
        return [*kept, await store.get("a3"), await store.get("a4"), await store.get("long")]

    got = bg.run(fill())
    assert [g is not None for g in got[:5]] == [False, False, True, True, True]
    assert got[5:] == [None, None, Spoken("z" * 9, live, None)]
