"""A gateway as the console's tests run it: its own scripted engines, tenants and keys, audit, admin key."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client import CollectorRegistry

from gateway.settings import load_settings
from gateway.tenants import MintedKey, mint_key
from tests.harness import BackgroundLoop, GatewayServer
from tests.stores import redis_prefix
from tests.upstream import Script, ScriptedUpstream

# Keys as an operator generates them (`openssl rand -hex 32`): the gateway refuses weak ones at start-up.
ADMIN_KEY = secrets.token_hex(32)
SIGNING_KEY = secrets.token_hex(32)
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
OMNI = "omni"
TEXT = "text"
SPARE = "spare"


class Engines:
    """Four scripted upstreams: an omni model in two variants, a text model, and a spare engine to stop."""

    def __init__(self, bg: BackgroundLoop) -> None:
        self.bg = bg
        self.int4 = ScriptedUpstream(Script(flavour="omni"))
        self.bf16 = ScriptedUpstream(Script(flavour="omni"))
        self.text = ScriptedUpstream(Script(flavour="vllm"))
        self.spare = ScriptedUpstream(Script(flavour="vllm"))
        for u in self.all:
            bg.run(u.start())

    @property
    def all(self) -> list[ScriptedUpstream]:
        return [self.int4, self.bf16, self.text, self.spare]

    def stop(self) -> None:
        for u in self.all:
            self.bg.run(u.stop())


def config(
    eng: Engines,
    tmp_path: Path,
    keys: dict[str, MintedKey],
    *,
    console: bool = True,
    audit: dict[str, Any] | None = None,
    admin_key: str = ADMIN_KEY,
    controller: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    def engine(
        name: str, up: ScriptedUpstream, kind: str, variant: str, serves: str, **kw: Any
    ) -> dict[str, Any]:
        return {
            "name": name,
            "kind": kind,
            "base_url": up.base_url,
            "model": name,
            "variant": variant,
            "serves": [serves],
            "first_byte_timeout_s": 5,
            "read_timeout_s": 5,
            **kw,
        }

    return {
        "engines": [
            engine("omni-int4", eng.int4, "vllm-omni", "int4", OMNI),
            engine("omni-bf16", eng.bf16, "vllm-omni", "bf16", OMNI, role="fallback"),
            engine("text-vllm", eng.text, "vllm", "fp16", TEXT),
            engine("spare-vllm", eng.spare, "vllm", "fp8", SPARE),
        ],
        "admin": {"api_key": admin_key, "console": {"enabled": console}},
        "policies": {"pre": [{"name": "request-limits"}]},
        # strict enforces 8 messages and, in shadow mode, records what a limit of 1 would have refused
        "policy_sets": {
            "strict": {
                "pre": [
                    {"name": "request-limits", "config": {"max_messages": 8}},
                    {"name": "request-limits", "shadow": True, "config": {"max_messages": 1}},
                ]
            }
        },
        "tenants": [{"name": "acme", "priority": "interactive"}, {"name": "globex", "policy_set": "strict"}],
        "api_keys": [{"id": k.id, "tenant": t, "sha256": k.sha256} for t, k in keys.items()],
        "rate_limits": {"key_prefix": redis_prefix()},
        "audit": audit or {"sqlite_path": str(tmp_path / "audit.db"), "signing": {"key": SIGNING_KEY}},
        "routing": {
            "probe_interval_s": 0.2,
            "controller": controller or {"enabled": False},
            **({"state": state} if state else {}),
            "signals": {"window_s": 3.0, "scrape_interval_s": 0.1, "scrape_timeout_s": 1},
        },
        "logging": {"level": "warning"},
        # A shared routing state is the one Redis's, with admission under a prefix of the test's own.
        **(
            {
                "redis": {"url": "redis://127.0.0.1:6379/0"},
                "traffic": {"key_prefix": f"{redis_prefix()}:traffic"},
            }
            if state and state.get("backend") == "redis"
            else {}
        ),
    }


def start(bg: BackgroundLoop, doc: dict[str, Any], path: Path) -> GatewayServer:
    path.write_text(yaml.safe_dump(doc))
    return GatewayServer(bg, load_settings(path), CollectorRegistry(), config_path=str(path)).start()


def tenant_keys() -> dict[str, MintedKey]:
    return {"acme": mint_key(), "globex": mint_key()}


def chat(
    server: GatewayServer, key: str, model: str = TEXT, messages: int = 1, content: str = "hi"
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": model, "messages": [{"role": "user", "content": content}] * messages}
    return httpx.post(server.url + "/v1/chat/completions", headers=headers, json=body, timeout=10)


def request_id(server: GatewayServer, key: str, status: int = 200, **kw: Any) -> str:
    """Send one request, check its status, return the request id the gateway gave it (its audit key)."""
    r = chat(server, key, **kw)
    assert r.status_code == status, r.text
    return r.headers["x-request-id"]


#: a rollback rule that fires fast: INT4's time to first token above 150 ms for 0.2 s moves omni to BF16
FAST_RULE = {
    "enabled": True,
    "interval_s": 0.1,
    "min_dwell_s": 0,
    "cooldown_s": 0,
    "max_switches_per_hour": 100,
    "rules": [
        {
            "name": "int4-latency",
            "select": {"variants": ["int4"]},
            "signal": "ttft_p99",
            "above": 0.15,
            "for_s": 0.2,
            "min_samples": 3,
            "recover_below": 0.05,
            "recover_for_s": 600,
            "action": {"kind": "shift", "to_variants": ["bf16"], "trickle_weight": 0.0},
        }
    ],
}


def stream_chat(server: GatewayServer, key: str, model: str = OMNI) -> int:
    """One streamed request read to the end (time to first token is measured on streams); its status."""
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json=body,
        timeout=30,
        headers={"authorization": f"Bearer {key}"},
    ) as r:
        r.read()
        return r.status_code


def admin(server: GatewayServer, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, server.url + "/admin" + path, headers=ADMIN, timeout=10, **kw)
