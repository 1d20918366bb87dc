"""One tenant's prompts cannot steer the rollback controller: over real sockets, scripted engines, two tenants.

The engines' time to first token grows with the prompt (a fixed cost plus a prefill rate), as a real
engine's does. The gateway carries the shipped ``int4-latency`` rule (its signal, threshold and action as
shipped, with short timers so a test is quick). A tenant that sends a 40,000-character prompt every second
makes the engine's raw P99 TTFT cross the threshold, and must not move anyone's traffic off INT4; an engine
that gets slow for every prompt still rolls INT4 back.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from engines.rollout.rules import Rule, default_rules
from gateway.settings import Settings
from gateway.tenants import mint_key
from tests.harness import BackgroundLoop, GatewayServer, wait_until
from tests.http.rollout_helpers import ADMIN_KEY, MODEL, Trio, engines, settings
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(180)

HUGE = "lorem ipsum " * 3334  # 40,008 characters, about 10,000 tokens
THRESHOLD = next(r for r in default_rules() if r.name == "int4-latency").above


class PrefillUpstream(ScriptedUpstream):
    """A vLLM-Omni engine whose first token takes ``base_s`` plus ``per_1k_tokens_s`` per 1,000 prompt tokens.

    It counts a token per four characters of the messages' text and reports that as the usage's
    ``prompt_tokens``, as an engine reports what it prefilled.
    """

    def __init__(self) -> None:
        super().__init__(Script(flavour="omni"))
        self.base_s = 0.02
        self.per_1k_tokens_s = 0.15

    async def _serve_chat(self, request, state):
        body = orjson.loads(await request.read())  # aiohttp keeps the body: the base class reads it again
        chars = sum(len(m["content"]) for m in body["messages"] if isinstance(m.get("content"), str))
        tokens = max(1, chars // 4)
        delay = self.base_s + self.per_1k_tokens_s * tokens / 1000
        # Queued and taken by the base class before it awaits anything, so no other request can take it.
        self._queue.insert(0, replace(self.default, prompt_tokens=tokens, first_byte_delay_s=delay))
        return await super()._serve_chat(request, state)


class PrefillTrio(Trio):
    def __init__(self, bg: BackgroundLoop) -> None:
        self.bg = bg
        self.int4, self.int8, self.bf16 = PrefillUpstream(), PrefillUpstream(), PrefillUpstream()
        for u in self.all:
            bg.run(u.start())

    def reset(self) -> None:
        super().reset()
        for u in self.all:
            self.set(u, base_s=0.02, per_1k_tokens_s=0.15)


@pytest.fixture(scope="module")
def prefill(bg):
    t = PrefillTrio(bg)
    yield t
    t.stop()


def _shipped_rule() -> Rule:
    shipped = next(r for r in default_rules() if r.name == "int4-latency")
    return shipped.model_copy(update={"for_s": 1.0, "min_samples": 5, "recover_for_s": 600})


def _start(bg, trio: Trio, tmp_path) -> tuple[GatewayServer, dict[str, dict[str, str]]]:
    keys = {name: mint_key() for name in ("steady", "bulk")}
    base = settings(engines(trio), [_shipped_rule()], window_s=6.0)
    s = Settings(
        engines=base.engines,
        routing=base.routing,
        admin={"api_key": ADMIN_KEY},
        logging={"level": "warning"},
        audit={"sqlite_path": str(tmp_path / "audit.db")},
        tenants=[{"name": name} for name in keys],
        api_keys=[{"id": k.id, "tenant": name, "sha256": k.sha256} for name, k in keys.items()],
    )
    server = GatewayServer(bg, s, CollectorRegistry()).start()
    return server, {name: {"authorization": f"Bearer {k.key}"} for name, k in keys.items()}


def _stream(url: str, headers: dict[str, str], prompt: str) -> bool:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": prompt}]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as resp:
        text = resp.read().decode()
    return resp.status_code == 200 and '"error"' not in text and text.rstrip().endswith("data: [DONE]")


class Traffic:
    """The steady tenant's short prompts, two at a time, and the bulk tenant's huge ones, about one a second."""

    def __init__(self, url: str, keys: dict[str, dict[str, str]]) -> None:
        self.url, self.keys = url, keys
        self.stop = threading.Event()
        self.results: dict[str, list[bool]] = {"steady": [], "bulk": []}
        self._threads = [threading.Thread(target=self._steady) for _ in range(2)]
        # Each huge prompt takes about 1.5 s to its first token: two senders make about one a second.
        self._threads += [threading.Thread(target=self._bulk) for _ in range(2)]

    def _steady(self) -> None:
        while not self.stop.is_set():
            self.results["steady"].append(_stream(self.url, self.keys["steady"], "hi"))

    def _bulk(self) -> None:
        while not self.stop.is_set():
            self.results["bulk"].append(_stream(self.url, self.keys["bulk"], HUGE))

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=60)


def _shifts(server: GatewayServer) -> list:
    recent = server.bg.call(lambda: list(server.services.controller.recent))
    return [t for t in recent if t.action == "shift"]


def _int4_signal(server: GatewayServer, name: str) -> tuple[float, float | None] | None:
    snap = server.bg.call(lambda: server.services.controller.last_snapshot)
    if snap is None:
        return None
    return snap.now, snap.engines["omni-int4"].values.get(name)


def test_one_tenants_huge_prompts_do_not_move_traffic_off_int4(bg, prefill, tmp_path):
    prefill.reset()
    server, keys = _start(bg, prefill, tmp_path)
    rule = _shipped_rule()
    try:
        held: dict[str, float] = {}

        def raw_p99_held_past_for_s() -> bool:
            # The condition the raw TTFT P99 would have fired on: above the threshold for 3 x for_s.
            reading = _int4_signal(server, "upstream_ttft_p99")
            if reading is None or reading[1] is None or reading[1] <= THRESHOLD:
                held.pop("since", None)
                return False
            now = reading[0]
            return now - held.setdefault("since", now) >= 3 * rule.for_s

        with Traffic(server.url, keys) as traffic:
            assert wait_until(raw_p99_held_past_for_s, timeout=90, interval=0.05)
        assert traffic.results["bulk"] and all(traffic.results["bulk"])
        assert len(traffic.results["steady"]) > 20 and all(traffic.results["steady"])
        assert _shifts(server) == []
        table = server.bg.call(lambda: server.services.pool.table)
        assert table.weights[MODEL]["omni-int4"] == 1.0
        assert prefill.counts()["bf16"] == 0 and prefill.counts()["int4"] > 0
    finally:
        server.stop()


def test_an_engine_slow_for_every_prompt_still_rolls_int4_back(bg, prefill, tmp_path):
    prefill.reset()
    server, keys = _start(bg, prefill, tmp_path)
    try:
        prefill.set(prefill.int4, base_s=THRESHOLD + 0.2)  # the fixed cost of every first token
        with Traffic(server.url, keys) as traffic:
            assert wait_until(lambda: bool(_shifts(server)), timeout=90, interval=0.05)
        assert all(traffic.results["steady"]) and all(traffic.results["bulk"])
        [shift] = _shifts(server)
        assert (shift.reason, shift.engine) == ("int4-latency", "omni-int4")
        assert shift.detail["value"] > THRESHOLD and shift.detail["targets"] == {MODEL: ["omni-bf16"]}
        before = prefill.counts()
        assert all(_stream(server.url, keys["steady"], "hi") for _ in range(5))
        after = prefill.counts()
        assert after["bf16"] - before["bf16"] >= 4  # all but the 5 % trickle
    finally:
        server.stop()
