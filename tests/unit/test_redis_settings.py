"""The one ``redis`` block: its file and environment forms, the per-feature Redis keys it replaced
refused by name, and one connection pool per replica that every shared feature draws from (the real
Redis at 127.0.0.1:6379)."""

from __future__ import annotations

import uuid

import pytest
import yaml
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from gateway.cli import _format_validation
from gateway.redis_client import SharedRedis
from gateway.services import Services
from gateway.settings import load_settings
from gateway.traffic_settings import RedisSettings
from observability.metrics import Metrics

REDIS_URL = "redis://127.0.0.1:6379/0"
OTHER_URL = "redis://127.0.0.1:6379/1"


def _file(tmp_path, doc: dict):
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_block_from_a_file_and_from_the_environment(tmp_path, monkeypatch):
    block = {"url": REDIS_URL, "timeout_s": 0.5, "max_connections": 8, "probe_s": 2}
    path = _file(tmp_path, {"redis": block})
    s = load_settings(path)
    assert s.redis.url is not None and s.redis.url.get_secret_value() == REDIS_URL
    assert (s.redis.timeout_s, s.redis.max_connections, s.redis.probe_s) == (0.5, 8, 2)
    assert REDIS_URL not in repr(s.redis)  # a URL may carry a password
    monkeypatch.setenv("OMNIGATE_REDIS__URL", OTHER_URL)
    monkeypatch.setenv("OMNIGATE_REDIS__MAX_CONNECTIONS", "16")
    s = load_settings(path)
    assert s.redis.url.get_secret_value() == OTHER_URL and s.redis.max_connections == 16


def test_unset_means_in_process_and_the_shared_routing_state_needs_it(tmp_path):
    assert load_settings(None).redis.url is None
    with pytest.raises(ValidationError, match=r"routing.state.backend is redis, but redis.url is not set"):
        load_settings(_file(tmp_path, {"routing": {"state": {"backend": "redis"}}}))
    with pytest.raises(ValidationError, match=r"auth.failures.store is redis, but redis.url is not set"):
        load_settings(_file(tmp_path, {"auth": {"failures": {"store": "redis"}}}))


#: per-feature Redis keys of development builds, never released: the ``redis`` block replaced them
OLD_KEYS = [
    ("rate_limits.redis_url", REDIS_URL),
    ("traffic.redis_url", REDIS_URL),
    ("routing.state.redis_url", REDIS_URL),
    ("traffic.redis_timeout_s", 0.5),
    ("traffic.redis_max_connections", 12),
    ("traffic.redis_probe_s", 3),
]


def _nested(dotted: str, value: object) -> dict:
    *parents, leaf = dotted.split(".")
    doc: dict = {leaf: value}
    for part in reversed(parents):
        doc = {part: doc}
    return doc


@pytest.mark.parametrize(("key", "value"), OLD_KEYS)
def test_a_per_feature_redis_key_is_refused_naming_it(tmp_path, key, value):
    doc = {**_nested(key, value), "redis": {"url": REDIS_URL}}
    with pytest.raises(ValidationError) as err:
        load_settings(_file(tmp_path, doc))
    errors = err.value.errors()
    assert [(".".join(map(str, e["loc"])), e["type"]) for e in errors] == [(key, "extra_forbidden")]
    # what the command line prints names the key and not its value (a URL may carry a password)
    printed = _format_validation(err.value)
    assert f"{key}: Extra inputs are not permitted" in printed and REDIS_URL not in printed


def test_the_old_environment_form_is_refused_too(monkeypatch):
    monkeypatch.setenv("OMNIGATE_TRAFFIC__REDIS_URL", REDIS_URL)
    with pytest.raises(ValidationError) as err:
        load_settings(None)
    assert [".".join(map(str, e["loc"])) for e in err.value.errors()] == ["traffic.redis_url"]


async def test_one_pool_serves_every_user_and_closes_once():
    redis = SharedRedis(RedisSettings(url=REDIS_URL, max_connections=4))
    a, b = redis.client(), redis.client()
    assert a.connection_pool is b.connection_pool is redis.pool
    key = f"omnigate-test:{uuid.uuid4().hex}"
    await a.set(key, b"1", px=5000)
    await a.aclose()  # a user closing its client leaves the pool to the others
    assert await b.get(key) == b"1"
    await b.delete(key)
    await redis.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        redis.client()


async def test_the_services_hand_one_pool_to_admission_rate_limits_failures_and_routing_state(tmp_path):
    prefix = f"omnigate-test:{uuid.uuid4().hex}"
    s = load_settings(
        _file(
            tmp_path,
            {
                "redis": {"url": REDIS_URL},
                "traffic": {"key_prefix": f"{prefix}:traffic"},
                "rate_limits": {"key_prefix": prefix},
                "routing": {"state": {"backend": "redis", "key_prefix": f"{prefix}:routing"}},
                "audit": {"enabled": False},
                "auth": {"required": False},
            },
        )
    )
    services = Services.build(s, Metrics(CollectorRegistry()))
    try:
        pool = services.redis.pool
        assert services.admission.store.client.connection_pool is pool
        assert services.controller.store._redis.connection_pool is pool
        services.limiter._connect()
        assert services.limiter._requests.storage.bridge.storage.connection_pool is pool
        services.auth_failures._limiter()
        assert services.auth_failures._shared.storage.bridge.storage.connection_pool is pool
    finally:
        await services.redis.aclose()
