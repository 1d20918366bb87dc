"""Gateways with fast control loops over their own scripted upstreams; a client reading whole answers."""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass

import httpx
import orjson

from engines.adapters.settings import EngineConfig
from engines.rollout.rules import Rule
from engines.rollout.settings import (
    CircuitSettings,
    ControllerSettings,
    RoutingSettings,
    SentinelSettings,
    SharedStateSettings,
    SignalSettings,
)
from gateway.settings import Settings
from tests.harness import BackgroundLoop
from tests.upstream import Script, ScriptedUpstream

MODEL = "omni"
REDIS = "redis://127.0.0.1:6379/0"
ADMIN_KEY = secrets.token_hex(32)  # the boot refuses typed keys
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


class Trio:
    """Three scripted vLLM-Omni engines serving one model: INT4 (primary), INT8 and BF16 (fallbacks)."""

    def __init__(self, bg: BackgroundLoop) -> None:
        self.bg = bg
        self.int4 = ScriptedUpstream(Script(flavour="omni"))
        self.int8 = ScriptedUpstream(Script(flavour="omni"))
        self.bf16 = ScriptedUpstream(Script(flavour="omni"))
        for u in self.all:
            bg.run(u.start())

    @property
    def all(self) -> list[ScriptedUpstream]:
        return [self.int4, self.int8, self.bf16]

    def reset(self) -> None:
        def _reset() -> None:
            for u in self.all:
                u.default = Script(flavour="omni")
                u.clear_queue()
                u.reset_stats()
                u.kv_cache_usage_perc = 0.0
                u.num_requests_running = None
                u.gpu_fb_used_mib = u.gpu_fb_free_mib = None

        self.bg.call(_reset)

    def set(self, upstream: ScriptedUpstream, **attrs) -> None:
        def _set() -> None:
            for k, v in attrs.items():
                setattr(upstream, k, v)

        self.bg.call(_set)

    def counts(self) -> dict[str, int]:
        return self.bg.call(
            lambda: {
                "int4": self.int4.request_count,
                "int8": self.int8.request_count,
                "bf16": self.bf16.request_count,
            }
        )

    def stop(self) -> None:
        for u in self.all:
            self.bg.run(u.stop())


def engines(
    trio: Trio, canary: ScriptedUpstream | None = None, canary_weight: float = 0.3
) -> list[EngineConfig]:
    out = [
        EngineConfig(
            name="omni-int4",
            kind="vllm-omni",
            base_url=trio.int4.base_url,
            model="q-awq",
            variant="int4",
            serves=[MODEL],
            first_byte_timeout_s=5,
            read_timeout_s=5,
        ),
        EngineConfig(
            name="omni-int8",
            kind="vllm-omni",
            base_url=trio.int8.base_url,
            model="q-w8",
            variant="int8",
            role="fallback",
            serves=[MODEL],
            first_byte_timeout_s=5,
            read_timeout_s=5,
        ),
        EngineConfig(
            name="omni-bf16",
            kind="vllm-omni",
            base_url=trio.bf16.base_url,
            model="q",
            variant="bf16",
            role="fallback",
            serves=[MODEL],
            first_byte_timeout_s=5,
            read_timeout_s=5,
        ),
    ]
    if canary is not None:
        out.append(
            EngineConfig(
                name="omni-next",
                kind="vllm-omni",
                base_url=canary.base_url,
                model="q-next",
                variant="int4",
                role="canary",
                weight=canary_weight,
                serves=[MODEL],
                first_byte_timeout_s=5,
                read_timeout_s=5,
            )
        )
    return out


def settings(
    engine_list: list[EngineConfig],
    rules: list[Rule],
    *,
    probe_interval_s: float = 0.2,
    state: SharedStateSettings | None = None,
    sentinel: SentinelSettings | None = None,
    circuit: CircuitSettings | None = None,
    min_dwell_s: float = 0.0,
    cooldown_s: float = 0.0,
    window_s: float = 3.0,
    interval_s: float = 0.1,
    seed: int | None = 1,
    redis_url: str | None = None,
) -> Settings:
    routing = RoutingSettings(
        probe_interval_s=probe_interval_s,
        circuit=circuit or CircuitSettings(base_ejection_s=0.5, max_ejection_s=2),
        signals=SignalSettings(window_s=window_s, scrape_interval_s=0.1, scrape_timeout_s=1),
        sentinel=sentinel or SentinelSettings(),
        controller=ControllerSettings(
            interval_s=interval_s,
            min_dwell_s=min_dwell_s,
            cooldown_s=cooldown_s,
            max_switches_per_hour=100,
            rules=rules,
        ),
        state=state or SharedStateSettings(),
        seed=seed,
    )
    return Settings(
        engines=engine_list,
        routing=routing,
        admin={"api_key": ADMIN_KEY},
        logging={"level": "warning"},
        auth={"required": False},  # these tests drive routing; the front door has its own
        # Redis (its own URL, or the local one for a shared state), with admission under the test's prefix.
        **(
            {"redis": {"url": redis_url or REDIS}, "traffic": {"key_prefix": f"{state.key_prefix}:traffic"}}
            if state is not None and state.backend == "redis"
            else {}
        ),
    )


@dataclass
class Answer:
    status: int
    text: str = ""
    audio_bytes: int = 0
    error: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def chat(url: str, speech: bool = False, timeout: float = 30.0) -> Answer:
    """One streamed request, read to the end; an error frame after the 200 counts as a failure."""
    body: dict = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    if speech:
        body |= {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            resp.read()
            return Answer(resp.status_code, error=resp.json().get("error"))
        answer = Answer(200)
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = orjson.loads(line[6:])
            if "error" in doc:
                answer.error = doc["error"]
                continue
            for choice in doc.get("choices") or ():
                delta = choice.get("delta") or {}
                answer.text += delta.get("content") or ""
                audio = delta.get("audio") or {}
                answer.text += audio.get("transcript") or ""
                if audio.get("data"):
                    answer.audio_bytes += len(base64.b64decode(audio["data"]))
        return answer


def admin(url: str, path: str, body: dict | None = None, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if body is None:
        return httpx.get(url + "/admin/routing" + path, headers=headers, timeout=10)
    return httpx.post(url + "/admin/routing" + path, json=body, headers=headers, timeout=10)
