"""The idle footprint: what a gateway that needs no media policies, audio transcoding or rate limits loads.

numpy and libsndfile (about 18 MB resident) come with the policies and audio paths that
use them; redis and ``limits`` (about 7 MB) with the first tenant that has a rate limit.
A plain text gateway, serving a streamed request, loads none of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid

from prometheus_client import CollectorRegistry

from core.settings import TenantConfig
from gateway.ratelimit import RateLimiter
from gateway.redis_client import SharedRedis
from gateway.traffic_settings import RateLimitSettings, RedisSettings
from observability.metrics import Metrics

HEAVY = ("numpy", "soundfile", "redis", "limits", "PIL", "av", "onnxruntime", "torch", "litellm")

_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from starlette.testclient import TestClient
    from gateway.app import create_app
    from gateway.settings import Settings

    settings = Settings.model_validate({
        "engines": [{"name": "text", "kind": "vllm", "base_url": sys.argv[1], "model": "scripted",
                     "variant": "fp16", "serves": ["text-model"]}],
        "policies": {"pre": [{"name": "load-shedding"}, {"name": "request-limits"}]},
        "audit": {"sqlite_path": sys.argv[2]},
        "routing": {"controller": {"enabled": False}},
        "logging": {"level": "warning"},
    })
    with TestClient(create_app(settings)) as client:
        # as a client (or a load balancer) does: wait for the engines' first probe (/readyz), then ask
        deadline = time.monotonic() + 30
        while client.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        body = {"model": "text-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            text = "".join(resp.iter_text())
        assert resp.status_code == 200, text
        assert text.rstrip().endswith("data: [DONE]"), text
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[3].split(","))))
    """
)


def test_a_text_gateway_serves_without_loading_media_audio_or_rate_limit_libraries(
    upstreams, tmp_path
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, upstreams.vllm.base_url, str(tmp_path / "audit.db"), ",".join(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


async def test_the_rate_limiter_connects_only_for_a_tenant_with_a_limit() -> None:
    redis = SharedRedis(RedisSettings(url="redis://127.0.0.1:6379/0"))
    limiter = RateLimiter(
        RateLimitSettings(key_prefix=f"omnigate-test-{uuid.uuid4().hex}"), Metrics(CollectorRegistry()), redis
    )
    await limiter.admit(TenantConfig(name="unlimited"))
    await limiter.charge(TenantConfig(name="unlimited"), 500)
    assert not redis.opened
    try:
        await limiter.admit(TenantConfig(name="limited", requests_per_minute=1000))
        assert redis.opened
    finally:
        await limiter.aclose()
        await redis.aclose()
