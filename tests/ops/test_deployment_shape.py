"""The shapes users install, run as processes: the Helm chart with two replicas, and compose.

The chart is rendered as the ops tests render it (Helm's Go SDK) with two replicas; each pod is an
``omnigate serve`` process started with the Deployment's arguments and environment and the rendered
ConfigMap. What a cluster would fill in, the test fills in: the Secrets' values (this machine's
PostgreSQL, a fresh database per test, and its Redis, under key prefixes of the test's own), the pod's
name, a port and a folder for each pod's volumes, and the engines' addresses (the scripted engines of
tests/upstream.py). compose is rendered by ``docker compose config`` and its gateway service started
the same way. In those shapes: one audit chain across the pods verifies with its signatures and
against every pod's witness after a pod is killed and replaced; a pin made on one pod holds on the
other; an engine given a small cap in the chart's values never has more requests at once than that cap
from both pods together; a decompression-bomb PNG is refused by every chain the config ships.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from tests.harness import free_port, omnigate_command, wait_until
from tests.media import data_uri, plain_image, png, png_bomb
from tests.ops.catalogue import CHART
from tests.ops.test_helm_chart import render
from tests.otlp import Receiver
from tests.stores import fresh_pg_database, redis_prefix
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(240)

REDIS = "redis://127.0.0.1:6379/0"
PUBLIC_MODEL = "qwen3-omni-flash"
#: the primary engine's max_in_flight in the chart's values here (the chart's default is 8)
ENGINE_CAP = 2


# -- a pod as a process -------------------------------------------------------------------------------------
def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' dependent variables: $(NAME) of a variable defined before it."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


class Pod:
    """One gateway process: the rendered args and environment, its own port, folder and name."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        config: Path,
        folder: Path,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / "serve.log"
        args = list(args)
        # The rendered command on this machine's loopback, its config at the test's path.
        args[args.index("--config") + 1] = str(config)
        args[args.index("--host") + 1] = "127.0.0.1"
        args[args.index("--port") + 1] = str(self.port)
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [*omnigate_command(), *args],
            cwd=folder,  # the image's WORKDIR, the pod's own volume
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"pod {self.name} exited: {self.log()}")
        try:
            return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self) -> Pod:
        assert wait_until(self.ready, timeout=120, interval=0.2), self.log()
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, nothing sealed, as a node that goes away."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if not self._log.closed:
            self._log.close()


class Shape:
    """What a deployment renders, laid out on this machine: a config file and each pod's environment."""

    def __init__(
        self,
        tmp: Path,
        config: dict[str, Any],
        args: list[str],
        env: list[dict],
        secrets_: dict[tuple[str, str], str],
        *,
        dsn: str,
        paths: dict[str, Path] | None = None,
        extra: dict[str, str] | None = None,
    ) -> None:
        self.tmp = tmp
        self.dsn = dsn
        #: volume mounts of the pod, at the test's folders
        self.paths = paths or {}
        #: what a second fleet on the same Redis would set: key prefixes of the test's own
        self.extra = extra or {}
        self.config_path = tmp / "omnigate.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.config = config
        self.args = args
        self._env = env
        self._secrets = secrets_
        self.pods: list[Pod] = []
        self.admin_key = ""

    def environment(self, pod: str, paths: dict[str, Path]) -> dict[str, str]:
        out: dict[str, str] = {}
        for e in self._env:
            if "value" in e:
                value = expand(str(e["value"]), out)
            else:
                source = e["valueFrom"]
                if "secretKeyRef" in source:
                    ref = source["secretKeyRef"]
                    value = self._secrets[(ref["name"], ref["key"])]
                else:
                    assert source["fieldRef"]["fieldPath"] == "metadata.name", source
                    value = pod
            for mount, here in paths.items():
                value = value.replace(mount, str(here))
            out[e["name"]] = value
        if "OMNIGATE_METRICS__PORT" in out:  # each pod has its own network: here, its own port
            out["OMNIGATE_METRICS__PORT"] = str(free_port())
            out["OMNIGATE_METRICS__HOST"] = "127.0.0.1"
        return out

    def secret(self, name: str, key: str) -> str:
        return self._secrets[(name, key)]

    def start(self, pod: str) -> Pod:
        env = {**self.environment(pod, self.paths), **self.extra}
        self.admin_key = env["OMNIGATE_ADMIN__API_KEY"]
        p = Pod(pod, self.args, env, self.config_path, self.tmp / pod)
        self.pods.append(p)
        return p

    def stop(self) -> None:
        for p in self.pods:
            p.stop()

    @property
    def admin(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_key}"}


def _engines_to(config: dict[str, Any], upstreams: dict[str, ScriptedUpstream]) -> None:
    """The config's engines at the scripted engines' addresses (the only change made to a rendered config)."""
    for e in config["engines"]:
        e["base_url"] = upstreams[e["name"]].base_url


# -- the chart, two replicas --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def omni(bg) -> Iterator[dict[str, ScriptedUpstream]]:
    ups = {
        "omni-int4": ScriptedUpstream(Script(flavour="omni")),
        "omni-bf16": ScriptedUpstream(Script(flavour="omni")),
    }
    for u in ups.values():
        bg.run(u.start())
    yield ups
    for u in ups.values():
        bg.run(u.stop())


class Fleet:
    """The chart's two pods, running, and a tenant key the directory they share holds."""

    def __init__(self, shape: Shape, pods: list[Pod], key: str) -> None:
        self.shape, self.pods, self.key = shape, pods, key


@pytest.fixture(scope="module")
def collector(bg) -> Iterator[Receiver]:
    """The OTLP/HTTP collector the chart's ``tracing.otlpEndpoint`` points at."""
    r = bg.run(Receiver().start())
    yield r
    bg.run(r.stop())


@pytest.fixture(scope="module")
def chart(tmp_path_factory, omni, collector) -> Iterator[Fleet]:
    """The chart rendered with two replicas and tracing on, both pods started. The chain test, last, kills
    one."""
    tmp_path = tmp_path_factory.mktemp("chart")
    # A small cap for the INT4 engine, set as a user would: the chart's engines, that entry changed.
    engines = yaml.safe_load((CHART / "values.yaml").read_text())["config"]["engines"]
    engines = [{**e, "max_in_flight": ENGINE_CAP} if e["name"] == "omni-int4" else e for e in engines]
    tracing = {"otlpEndpoint": collector.url.removesuffix("/v1/traces")}
    objects = render(
        {
            "autoscaling": {"enabled": False},
            "replicaCount": 2,
            "config": {"engines": engines},
            "tracing": tracing,
        }
    )
    dep = objects[("Deployment", "omnigate")]
    assert dep["spec"]["replicas"] == 2
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    config = yaml.safe_load(objects[("ConfigMap", "omnigate")]["data"]["omnigate.yaml"])
    caps = {e["name"]: e["max_in_flight"] for e in config["engines"]}
    assert caps == {"omni-int4": ENGINE_CAP, "omni-bf16": 8}, caps
    _engines_to(config, omni)
    chart_secrets = {
        (name, key): base64.b64decode(value).decode()
        for (kind, name), obj in objects.items()
        if kind == "Secret"
        for key, value in obj["data"].items()
    }
    prefix = redis_prefix()
    with fresh_pg_database() as dsn:
        chart_secrets |= {
            ("omnigate-directory", "dsn"): dsn,
            ("omnigate-audit", "dsn"): dsn,
            ("omnigate-audit", "signing-key"): secrets.token_hex(32),
            ("omnigate-redis", "url"): REDIS,
        }
        witness = tmp_path / "witness"
        witness.mkdir()
        mount = next(m for m in container["volumeMounts"] if m["name"] == "audit-witness")["mountPath"]
        shape = Shape(
            tmp_path,
            config,
            container["args"],
            container["env"],
            chart_secrets,
            dsn=dsn,
            paths={mount: witness},
            extra={
                "OMNIGATE_TRAFFIC__KEY_PREFIX": f"{prefix}:traffic",
                "OMNIGATE_ROUTING__STATE__KEY_PREFIX": f"{prefix}:routing",
                "OMNIGATE_RATE_LIMITS__KEY_PREFIX": f"{prefix}:rate",
            },
        )
        try:
            a, b = shape.start("omnigate-a"), shape.start("omnigate-b")
            a.wait_ready(), b.wait_ready()
            key = _tenant_key(a, shape)
            # The key made on one pod holds on the other: the directory they share.
            assert wait_until(lambda: _served(b, key), timeout=30, interval=0.3)
            yield Fleet(shape, [a, b], key)
        finally:
            shape.stop()


def _tenant_key(pod: Pod, shape: Shape, tenant: dict[str, Any] | None = None) -> str:
    admin = shape.admin
    tenant = tenant or {"name": "acme"}
    r = httpx.post(pod.url + "/admin/tenants", json=tenant, headers=admin, timeout=20)
    assert r.status_code == 201, r.text
    r = httpx.post(pod.url + "/admin/keys", json={"tenant": tenant["name"]}, headers=admin, timeout=20)
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


def _chat(pod: Pod, key: str, content: Any = "hi") -> httpx.Response:
    body = {"model": PUBLIC_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16}
    return httpx.post(
        pod.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
    )


def _served(pod: Pod, key: str) -> bool:
    r = _chat(pod, key)
    return r.status_code == 200


def _verify(shape: Shape, signing_key: str, expect: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMNIGATE_AUDIT__POSTGRES_DSN": shape.dsn,
        "OMNIGATE_AUDIT__SIGNING__KEY": signing_key,
        "OMNIGATE_REDIS__URL": REDIS,
        "OMNIGATE_AUTH__DIRECTORY__POSTGRES_DSN": shape.dsn,
    }
    args = [*omnigate_command(), "audit", "verify", "--config", str(shape.config_path), "--json"]
    for path in expect:
        args += ["--expect-file", str(path)]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)


def test_each_pod_exports_its_spans_and_joins_the_client_s_trace_to_the_engine(chart, omni, collector):
    """The chart's tracing values, as its pods run them: each pod continues the client's trace, exports its
    spans to the collector under the chart's service name and its own pod name, and hands the trace to
    the engine in the attempt's ``traceparent``."""
    for pod in chart.pods:
        trace = secrets.token_hex(16)
        for u in omni.values():
            u.headers.clear()
        body = {"model": PUBLIC_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        r = httpx.post(
            pod.url + "/v1/chat/completions",
            json=body,
            headers={
                "authorization": f"Bearer {chart.key}",
                "traceparent": f"00-{trace}-{secrets.token_hex(8)}-01",
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        # the batch processor exports within its schedule delay (OTEL_BSP_SCHEDULE_DELAY, 5 s by default)
        assert wait_until(
            lambda t=trace: any(s.name.startswith("chat ") for s in collector.of_trace(t)),
            timeout=20,
            interval=0.2,
        ), pod.name
        spans = collector.of_trace(trace)
        names = {s.name for s in spans}
        assert {"admission", "audit commit"} <= names and any(n.startswith("chat ") for n in names), names
        assert {s.resource.get("k8s.pod.name") for s in spans} == {pod.name}
        assert {s.resource.get("service.name") for s in spans} == {"omnigate"}
        attempt = next(s for s in spans if s.name.startswith("chat "))
        sent = [h["traceparent"] for u in omni.values() for h in u.headers if "traceparent" in h]
        assert sent == [f"00-{trace}-{attempt.span_id}-01"], sent


def test_a_pin_on_one_pod_holds_on_the_other(chart, omni):
    shape, (a, b), key = chart.shape, chart.pods, chart.key
    r = httpx.post(
        a.url + "/admin/routing/pin",
        json={"model": PUBLIC_MODEL, "variant": "bf16", "actor": "sre"},
        headers=shape.admin,
        timeout=20,
    )
    assert r.status_code == 200 and r.json()["changed"], r.text

    def pinned_on_b() -> bool:
        routing = httpx.get(b.url + "/admin/routing", headers=shape.admin, timeout=10).json()
        return bool(routing["pins"] == {PUBLIC_MODEL: "bf16"})

    assert wait_until(pinned_on_b, timeout=20, interval=0.2)
    before = {n: u.request_count for n, u in omni.items()}
    for _ in range(6):
        assert _chat(b, key).status_code == 200
    assert omni["omni-bf16"].request_count - before["omni-bf16"] == 6
    assert omni["omni-int4"].request_count == before["omni-int4"]
    r = httpx.post(
        b.url + "/admin/routing/unpin", json={"model": PUBLIC_MODEL}, headers=shape.admin, timeout=20
    )
    assert r.status_code == 200, r.text
    assert wait_until(
        lambda: httpx.get(a.url + "/admin/routing", headers=shape.admin, timeout=10).json()["pins"] == {},
        timeout=20,
        interval=0.2,
    )


def test_an_engine_never_has_more_requests_in_flight_from_the_pods_than_its_cap(chart, omni, bg):
    """The INT4 engine's cap (2 here) is the engine's, not a pod's: 12 slow requests at once, half through
    each pod, and the engine never holds more than 2 of them. The others go to the BF16 fallback or wait
    for a slot; each ends served or, past max_wait_s, 503 engine_busy. Were the caps a pod's own, each pod
    would send it 2."""
    shape, pods, key = chart.shape, chart.pods, chart.key
    capped = omni["omni-int4"]
    slow = Script(flavour="omni", text="slow words", first_byte_delay_s=1.0)

    def script(default: Script) -> None:
        for up in omni.values():
            up.default = default

    def start_slow() -> None:
        script(slow)
        for up in omni.values():
            up.reset_stats()

    per_pod = 3 * ENGINE_CAP
    bg.call(start_slow)
    try:
        with ThreadPoolExecutor(per_pod * len(pods)) as workers:
            answers = list(workers.map(lambda p: _chat(p, key), [p for p in pods for _ in range(per_pod)]))
    finally:
        bg.call(lambda: script(Script(flavour="omni")))
    assert len(answers) == per_pod * len(pods)
    for r in answers:  # each one ended: served, or refused after its wait for a slot
        ok = r.status_code == 200 or (r.status_code == 503 and r.json()["error"]["code"] == "engine_busy")
        assert ok, (r.status_code, r.text)
    served = sum(r.status_code == 200 for r in answers)
    assert sum(up.completed for up in omni.values()) == served
    assert capped.max_in_flight <= ENGINE_CAP, f"the engine had {capped.max_in_flight} requests at once"
    assert capped.max_in_flight == ENGINE_CAP  # and the cap was used, not starved
    # Every slot is given back: no lease of the engine is left in Redis.
    prefix = shape.extra["OMNIGATE_TRAFFIC__KEY_PREFIX"]  # the caps' leases live under the traffic prefix
    client = redis.Redis.from_url(REDIS)
    try:
        leases = [f"{{{prefix}}}:engine:{name}" for name in omni]
        assert wait_until(lambda: sum(client.zcard(k) for k in leases) == 0, timeout=30, interval=0.2)
    finally:
        client.close()


def _chains(config: dict[str, Any]) -> list[str | None]:
    """The default chain and every policy set the config ships."""
    return [None, *sorted(config.get("policy_sets") or {})]


BOMB = [
    {"type": "text", "text": "what is in this picture?"},
    {"type": "image_url", "image_url": {"url": data_uri("image/png", png_bomb())}},
]
CLEAN = [
    {"type": "text", "text": "what is in this picture?"},
    {"type": "image_url", "image_url": {"url": data_uri("image/png", png(plain_image(64)))}},
]


def _bomb_refused_everywhere(
    shape: Shape, pods: list[Pod], upstreams: dict[str, ScriptedUpstream], key: str
) -> None:
    """Every chain, on every pod: a tenant for each policy set the config ships, the default chain's key."""
    keys: dict[str | None, str] = {None: key}
    for i, chain in enumerate(_chains(shape.config)[1:]):
        keys[chain] = _tenant_key(pods[0], shape, {"name": f"set{i}", "policy_set": chain})
    for pod in pods:
        for chain, k in keys.items():
            assert wait_until(lambda k=k, p=pod: _served(p, k), timeout=30, interval=0.3)
            before = sum(u.request_count for u in upstreams.values())
            r = _chat(pod, k, BOMB)
            assert r.status_code == 400, (chain, r.status_code, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_media" and err["param"].startswith("messages.0.content.1"), err
            assert sum(u.request_count for u in upstreams.values()) == before, chain
            # and the chain still serves an ordinary picture
            assert _chat(pod, k, CLEAN).status_code == 200, chain


def test_a_decompression_bomb_is_refused_by_every_chain_the_chart_ships(chart, omni):
    _bomb_refused_everywhere(chart.shape, chart.pods, omni, chart.key)


def test_the_chart_s_pods_write_one_signed_chain_that_survives_a_killed_pod(chart):
    """Runs last in the module: it kills a pod of the fleet."""
    shape, (a, b), key = chart.shape, chart.pods, chart.key
    for pod in (a, b, a, b):
        assert _chat(pod, key).status_code == 200
    a.kill()
    c = shape.start("omnigate-c").wait_ready()
    for pod in (c, b, c):
        assert _chat(pod, key).status_code == 200
    # A stopped gateway seals its head: a signed checkpoint, published to its witness.
    for pod in (b, c):
        pod.proc.send_signal(signal.SIGTERM)
    b.stop(), c.stop()
    (witness,) = shape.paths.values()
    witnesses = sorted(witness.glob("*.jsonl"))
    # Whichever pod stopped last sealed the head both wrote to (the other may have had nothing left to seal).
    assert {p.stem for p in witnesses} & {"omnigate-b", "omnigate-c"}, witnesses
    done = _verify(shape, shape.secret("omnigate-audit", "signing-key"), witnesses)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True, report
    assert report["records"] >= 8, report  # the tenant, the key and the requests, from three pods
    assert report["checkpoints_signed"] >= 1 and report["uncovered_records"] == 0, report
    # Signed with the Secret's key: another key does not verify the same chain.
    forged = _verify(shape, secrets.token_hex(32), witnesses)
    assert forged.returncode != 0, forged.stdout


# -- compose, gpu profile -----------------------------------------------------------------------------------
REVISIONS = {"omni-int4": "0123456789abcdef0123456789abcdef01234567", "omni-bf16": "f" * 40}


@pytest.fixture(scope="module")
def compose(tmp_path_factory, bg) -> Iterator[tuple[Shape, dict[str, ScriptedUpstream]]]:
    """compose's gpu profile as ``docker compose config`` renders it: its gateway service as a process,
    the engines as scripted vLLM-Omni servers that list the model and verified snapshot compose serves."""
    from tests.ops.test_compose import _gateway, _mounted, compose_config

    tmp_path = tmp_path_factory.mktemp("compose")
    rendered = compose_config(
        "gpu",
        OMNIGATE_ADMIN_KEY=secrets.token_hex(32),
        OMNIGATE_AUDIT_SIGNING_KEY=secrets.token_hex(32),
        OMNI_INT4_REVISION=REVISIONS["omni-int4"],
        OMNI_BF16_REVISION=REVISIONS["omni-bf16"],
    )
    _, gw = _gateway(rendered)
    config = yaml.safe_load(_mounted(gw, "/etc/omnigate/omnigate.yaml").read_text())
    upstreams: dict[str, ScriptedUpstream] = {}
    for engine in config["engines"]:
        svc = rendered["services"][engine["name"]]
        served = next(a.split("=", 1)[1] for a in svc["command"] if a.startswith("--served-model-name="))
        up = ScriptedUpstream(Script(flavour="omni"), models=[served])
        up.roots[served] = svc["command"][0]  # vLLM lists the folder it loaded as the model's root
        bg.run(up.start())
        upstreams[engine["name"]] = up
    _engines_to(config, upstreams)
    # The gateway's volume (its home, the witness file on it) at a folder of the test's.
    home = next(v["target"] for v in gw["volumes"] if v["source"] == "gateway-state")
    witness = tmp_path / "witness"
    witness.mkdir()
    config["audit"]["witness_path"] = config["audit"]["witness_path"].replace(home, str(witness))
    prefix = redis_prefix()
    try:
        with fresh_pg_database() as dsn:
            env = dict(gw["environment"])
            # compose's own PostgreSQL and Redis, here this machine's
            assert env["OMNIGATE_AUDIT__POSTGRES_DSN"].endswith("@postgres:5432/omnigate")
            assert env["OMNIGATE_REDIS__URL"] == "redis://redis:6379/0"
            env["OMNIGATE_AUDIT__POSTGRES_DSN"] = dsn
            env["OMNIGATE_REDIS__URL"] = REDIS
            # no GPU here: the exporter's address answers nothing
            for k in [k for k in env if k.endswith("__DCGM_URL")]:
                env[k] = f"http://127.0.0.1:{free_port()}/metrics"
            shape = Shape(
                tmp_path,
                config,
                gw["command"],
                [{"name": k, "value": v} for k, v in env.items()],
                {},
                dsn=dsn,
                paths={home: witness},
                extra={
                    "OMNIGATE_TRAFFIC__KEY_PREFIX": f"{prefix}:traffic",
                    "OMNIGATE_ROUTING__STATE__KEY_PREFIX": f"{prefix}:routing",
                    "OMNIGATE_RATE_LIMITS__KEY_PREFIX": f"{prefix}:rate",
                },
            )
            try:
                gateway = shape.start("gateway").wait_ready()
                key = _tenant_key(gateway, shape)
                yield shape, upstreams, key
            finally:
                shape.stop()
    finally:
        for up in upstreams.values():
            bg.run(up.stop())


def test_a_decompression_bomb_is_refused_by_every_chain_compose_ships(compose):
    shape, upstreams, key = compose
    _bomb_refused_everywhere(shape, [shape.pods[-1]], upstreams, key)


def test_compose_s_gateway_keeps_its_signed_chain_and_its_pins_across_a_kill(compose):
    """Runs last in the module: the gateway is killed and started again (restart: unless-stopped)."""
    shape, upstreams, key = compose
    gateway = shape.pods[-1]
    for _ in range(3):
        assert _chat(gateway, key).status_code == 200
    r = httpx.post(
        gateway.url + "/admin/routing/pin",
        json={"model": PUBLIC_MODEL, "variant": "bf16", "actor": "sre"},
        headers=shape.admin,
        timeout=20,
    )
    assert r.status_code == 200 and r.json()["changed"], r.text
    gateway.kill()
    again = shape.start("gateway").wait_ready()
    # The routing state is compose's Redis's: the pin outlived the process.
    assert httpx.get(again.url + "/admin/routing", headers=shape.admin, timeout=10).json()["pins"] == {
        PUBLIC_MODEL: "bf16"
    }
    before = upstreams["omni-bf16"].request_count
    for _ in range(3):
        assert _chat(again, key).status_code == 200
    assert upstreams["omni-bf16"].request_count - before == 3
    again.stop()
    (witness,) = shape.paths.values()
    heads = sorted(witness.glob("*"))
    assert heads, f"no signed head reached the witness volume (exit {again.proc.returncode}): {again.log()}"
    signing_key = next(e["value"] for e in shape._env if e["name"] == "OMNIGATE_AUDIT__SIGNING__KEY")
    done = _verify(shape, signing_key, heads)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["records"] >= 6 and report["checkpoints_signed"] >= 1, report
    assert report["uncovered_records"] == 0, report
    forged = _verify(shape, secrets.token_hex(32), heads)
    assert forged.returncode != 0, forged.stdout
