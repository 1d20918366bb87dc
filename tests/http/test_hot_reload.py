"""Config hot reload with real policies: chains opened before the swap, closed after their requests.

A served gateway runs the media steps, the NSFW screen and the grounding guard (in its default chain
and in a tenant's policy set), reloads its file, and keeps serving media URLs and grounded answers; a
reload leaks no thread, file descriptor or worker process; a stream in flight finishes on the chain it
started on, which closes after it; a chain that cannot start refuses the file.
"""

from __future__ import annotations

import gc
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.reload import reload_config
from gateway.settings import load_settings
from gateway.tenants import mint_key
from policies.registry import available_plugins
from tests.conftest import OMNI_MODEL
from tests.harness import GatewayServer, wait_until
from tests.media import MediaServer, plain_image, png
from tests.plugins import LIFECYCLE, PLUGINS
from tests.stores import redis_prefix
from tests.upstream import Script

pytestmark = pytest.mark.timeout(240)

ALL_PLUGINS = {**available_plugins(), **PLUGINS}
ADMIN_KEY = secrets.token_hex(32)
CONTEXT = "Use this document. The Eiffel Tower in Paris was completed on 31 March 1889."
QUESTION = "When was the Eiffel Tower completed?"
RIGHT = "The Eiffel Tower was completed on 31 March 1889."


@pytest.fixture(scope="module")
def media(bg):
    server = bg.run(MediaServer().start())
    server.add("photo.png", "image/png", png(plain_image(64)))
    yield server
    bg.run(server.stop())


def _chain(media: MediaServer, grounding_mode: str = "hold", stream: list[dict] | None = None) -> dict:
    return {
        "pre": [
            {"name": "media-fetch", "config": {"internal_hosts": [f"127.0.0.1:{media.port}"]}},
            {"name": "media-limits"},
            {"name": "nsfw-screen", "config": {"threshold": 0.9}},
        ],
        "stream": stream or [],
        "post": [{"name": "grounding", "config": {"mode": grounding_mode}}],
    }


class Gateway:
    """A gateway served from a config file the test rewrites, with one key per tenant."""

    def __init__(self, bg, upstreams, tmp_path: Path, media: MediaServer, **doc) -> None:
        upstreams.reset()
        self.bg, self.upstreams, self.media = bg, upstreams, media
        self.keys = {"plain": mint_key(), "grouped": mint_key()}
        engine = {
            "name": "omni",
            "kind": "vllm-omni",
            "base_url": upstreams.omni_a.base_url,
            "model": "scripted",
            "serves": [OMNI_MODEL],
            "read_timeout_s": 10,
        }
        self.doc = {
            "engines": [engine],
            "policies": _chain(media),
            "policy_sets": {"grouped": _chain(media, "window")},
            "tenants": [{"name": "plain"}, {"name": "grouped", "policy_set": "grouped"}],
            "api_keys": [{"id": k.id, "tenant": t, "sha256": k.sha256} for t, k in self.keys.items()],
            "admin": {"api_key": ADMIN_KEY},
            "rate_limits": {"key_prefix": redis_prefix()},
            "audit": {"sqlite_path": str(tmp_path / "audit.db")},
            "logging": {"level": "warning"},
            "routing": {"controller": {"enabled": False}},
            **doc,
        }
        self.path = tmp_path / "omnigate.yaml"
        self.write()
        self.server = GatewayServer(
            bg, load_settings(self.path), CollectorRegistry(), plugins=ALL_PLUGINS, config_path=str(self.path)
        ).start()

    @property
    def services(self):
        return self.server.services

    def write(self) -> None:
        self.path.write_text(yaml.safe_dump(self.doc))

    def reload(self) -> dict:
        resp = httpx.post(
            self.server.url + "/admin/config/reload",
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
            timeout=60,
        )
        assert resp.status_code in (200, 400, 422), resp.text
        return resp.json()

    def chat(self, tenant: str = "plain", media_url: str | None = None, **body) -> httpx.Response:
        content: list[dict] = [{"type": "text", "text": QUESTION}]
        if media_url is not None:
            content.append({"type": "image_url", "image_url": {"url": media_url}})
        payload = {
            "model": OMNI_MODEL,
            "messages": [{"role": "system", "content": CONTEXT}, {"role": "user", "content": content}],
            **body,
        }
        return httpx.post(
            self.server.url + "/v1/chat/completions",
            json=payload,
            timeout=60,
            headers={"authorization": f"Bearer {self.keys[tenant].key}"},
        )

    def grounded_media_answer(self, tenant: str = "plain") -> None:
        """A request with a media URL the gateway fetches, answered and judged grounded."""
        self.upstreams.omni_a.enqueue(Script(flavour="omni", text=RIGHT))
        hits = len(self.media.hits)
        resp = self.chat(tenant, media_url=self.media.base + "/m/photo.png")
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"].startswith(RIGHT)
        assert "x-omnigate-grounding" not in resp.headers  # judged and passed, not flagged
        assert len(self.media.hits) == hits + 1
        sent = self.upstreams.omni_a.requests[-1]["messages"][-1]["content"]
        assert any(p.get("type") == "image_url" and p["image_url"]["url"].startswith("data:") for p in sent)

    def hello_stream(self) -> httpx.Response:
        payload = {"model": OMNI_MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        return httpx.post(
            self.server.url + "/v1/chat/completions",
            json=payload,
            timeout=30,
            headers={"authorization": f"Bearer {self.keys['plain'].key}"},
        )

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def gateway(bg, upstreams, tmp_path, media):
    made: list[Gateway] = []

    def make(**doc) -> Gateway:
        gw = Gateway(bg, upstreams, tmp_path, media, **doc)
        made.append(gw)
        return gw

    yield make
    for gw in made:
        gw.stop()


def _impls(gw: Gateway) -> list:
    chains = gw.services.pipeline.chains
    return [p.impl for c in (gw.services.chain, *chains.values()) for p in c.all()]


def test_after_a_reload_media_urls_and_grounded_answers_are_served_and_the_old_chain_is_closed(gateway):
    gw = gateway()
    gw.grounded_media_answer("plain")
    gw.grounded_media_answer("grouped")
    old = _impls(gw)
    old_fetchers = [p.fetcher for p in old if p.name == "media-fetch"]
    gw.doc["policies"]["post"][0]["config"]["threshold"] = 0.5
    gw.write()
    result = gw.reload()
    assert result["status"] == "reloaded", result
    assert result["restart_required"] == []
    new = _impls(gw)
    assert not {id(p) for p in new} & {id(p) for p in old}
    gw.grounded_media_answer("plain")
    gw.grounded_media_answer("grouped")
    # The new chain shares the gateway's scorer and media sandbox; the old one let go of its own sessions.
    assert {p.scorer for p in new if p.name == "grounding"} == {gw.services.scorer}
    assert all(p.runtime is gw.services.media for p in new if p.name == "media-limits")
    assert wait_until(lambda: all(f._session is None for f in old_fetchers), timeout=10)
    assert gw.services.media.sandbox._pool is not None  # the shared decoders were not stopped by the reload


def _descendants() -> int:
    """Processes below this one (the media sandbox's forkserver and its workers)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = 0, {os.getpid()}
    while frontier:
        children = {pid for pid, ppid in parents.items() if ppid in frontier}
        found += len(children)
        frontier = children
    return found


def _sessions() -> int:
    """aiohttp sessions alive and open (the engines' and the current media-fetch steps')."""
    gc.collect()
    return sum(isinstance(o, aiohttp.ClientSession) and not o.closed for o in gc.get_objects())


def _counts() -> tuple[int, int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd")), _descendants()


def test_twenty_reloads_leak_no_thread_descriptor_or_worker(gateway, bg):
    gw = gateway()
    # A session or pool left to the garbage collector is a leak even when the collector then frees it.
    left: list[str] = []
    bg.call(lambda: bg.loop.set_exception_handler(lambda loop, context: left.append(context["message"])))
    gw.grounded_media_answer()
    assert gw.reload()["status"] == "reloaded"
    gw.grounded_media_answer()
    time.sleep(0.5)
    threads0, fds0, procs0 = _counts()
    sessions0 = _sessions()
    for i in range(20):
        gw.doc["policies"]["pre"][2]["config"]["threshold"] = 0.9 - i / 100
        gw.write()
        assert gw.reload()["status"] == "reloaded"
        gw.grounded_media_answer("grouped" if i % 2 else "plain")

    def settled() -> bool:
        threads, fds, procs = _counts()
        return threads <= threads0 + 2 and fds <= fds0 + 8 and procs <= procs0

    try:
        assert wait_until(settled, timeout=15), f"before {(threads0, fds0, procs0)}, after {_counts()}"
        gc.collect()
        assert gw.services.pipeline.policies.retired == []
        assert _sessions() <= sessions0
        bg.call(gc.collect)
        assert [m for m in left if "nclosed" in m] == []
    finally:
        bg.call(lambda: bg.loop.set_exception_handler(None))


def test_a_stream_in_flight_finishes_on_its_chain_which_closes_after_it(gateway, upstreams):
    LIFECYCLE.clear()
    gw = gateway(
        policies={
            "pre": [{"name": "request-limits"}],
            "stream": [{"name": "recorder", "config": {"tag": "old"}}],
        },
        policy_sets={"grouped": {"pre": [{"name": "request-limits"}]}},
    )
    assert ("start", "old") in LIFECYCLE
    upstreams.omni_a.enqueue(
        Script(flavour="omni", text="one two three four five six seven eight", chunk_delay_s=0.25)
    )
    first = threading.Event()

    def read() -> str:
        payload = {"model": OMNI_MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        out = []
        with httpx.stream(
            "POST",
            gw.server.url + "/v1/chat/completions",
            json=payload,
            timeout=30,
            headers={"authorization": f"Bearer {gw.keys['plain'].key}"},
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                out.append(line)
                first.set()
        return "\n".join(out)

    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(read)
        assert first.wait(10)
        gw.doc["policies"]["stream"][0]["config"]["tag"] = "new"
        gw.write()
        assert gw.reload()["status"] == "reloaded"
        assert ("start", "new") in LIFECYCLE
        assert ("aclose", "old") not in LIFECYCLE  # its stream is still running
        body = streaming.result(30)
    assert "[old]" in body and "[new]" not in body and body.rstrip().endswith("data: [DONE]")
    assert wait_until(lambda: ("aclose", "old") in LIFECYCLE, timeout=5), LIFECYCLE
    old = [e for e in LIFECYCLE if e[1] == "old"]
    assert old[-1] == ("aclose", "old") and old.count(("aclose", "old")) == 1
    assert ("feed", "new") not in LIFECYCLE
    # New requests take the new chain.
    resp = gw.hello_stream()
    assert "[new]" in resp.text
    gw.stop()
    assert LIFECYCLE[-1] == ("aclose", "new")  # shutdown closes the current chain


def test_a_chain_that_cannot_start_refuses_the_file_and_the_old_chain_keeps_serving(gateway, upstreams):
    LIFECYCLE.clear()
    gw = gateway(
        policies={
            "pre": [{"name": "request-limits"}],
            "stream": [{"name": "recorder", "config": {"tag": "old"}}],
        },
        policy_sets={"grouped": {"pre": [{"name": "request-limits"}]}},
    )
    gw.doc["policies"]["stream"][0]["config"]["tag"] = "new"
    gw.doc["policies"]["post"] = [{"name": "fail-start"}]
    gw.write()
    error = gw.reload()["error"]
    assert error["message"].startswith("config not reloaded, the running config stays: ")
    assert "'fail-start' could not start" in error["message"]
    assert "the model file cannot be read" in error["message"]
    # What the refused chain had started is closed again; the old one was not touched.
    assert LIFECYCLE == [("start", "old"), ("start", "new"), ("aclose", "new")]
    resp = gw.hello_stream()
    assert resp.status_code == 200 and "[old]" in resp.text
    assert [p.name for p in gw.services.chain.post] == []


def test_routing_and_grounding_settings_are_reported_as_needing_a_restart(gateway):
    gw = gateway()
    booted = gw.services.settings
    gw.doc["routing"] = {"controller": {"enabled": False, "interval_s": 2.5}, "probe_interval_s": 7.0}
    gw.doc["grounding"] = {"max_wait_ms": 3.0}
    gw.write()
    result = gw.bg.run(reload_config(gw.services, gw.path))
    assert result.ok, result.message
    assert {"routing", "grounding"} <= set(result.restart_required)
    # What runs is what the reload reports: the settings the controller and the scorer were built with.
    assert gw.services.settings.routing == booted.routing == gw.services.controller.settings
    assert gw.services.settings.grounding == booted.grounding == gw.services.scorer.settings
