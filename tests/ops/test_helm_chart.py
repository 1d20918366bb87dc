"""The Helm chart: ``helm lint`` and ``helm template`` through Helm's own Go SDK (helm-python-sdk),
rendered objects validated against the Kubernetes schemas (kubernetes-validate), and the
cross-references between them checked (selectors, ports, probes, secrets, rules, dashboard)."""

from __future__ import annotations

import json

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from gateway.cli import check_config
from tests.ops.catalogue import CHART, DASHBOARD, EXPORTED, RULES_DIR
from tests.ops.tools import promtool, run

KUBE_VERSIONS = (
    "1.27.0",
    "1.37.0",
)  # the oldest the chart declares (Chart.yaml kubeVersion) and the newest schemas
SINGLE = {"autoscaling": {"enabled": False}, "replicaCount": 1}
CORE_KINDS = {
    "Deployment",
    "Service",
    "ConfigMap",
    "Secret",
    "ServiceAccount",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
}


def render(values: dict | None = None, namespace: str = "llm") -> dict[tuple[str, str], dict]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values or {}, name="omnigate", namespace=namespace)
    objects: dict[tuple[str, str], dict] = {}
    for path, text in manifests.items():
        if not path.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"])
                assert key not in objects, key
                objects[key] = doc
    return objects


def one(objects: dict, kind: str) -> dict:
    found = [o for (k, _), o in objects.items() if k == kind]
    assert len(found) == 1, (kind, len(found))
    return found[0]


def fill_env(monkeypatch, objects: dict, pod: str = "omnigate-0") -> None:
    """The Deployment's environment as a pod would see it, the Secrets' values made up here."""
    import secrets

    made_up = {
        "OMNIGATE_ADMIN__API_KEY": secrets.token_hex(32),
        "OMNIGATE_AUDIT__SIGNING__KEY": secrets.token_hex(32),
        "OMNIGATE_AUDIT__POSTGRES_DSN": "postgresql://omnigate@db:5432/omnigate",
        "OMNIGATE_AUTH__DIRECTORY__POSTGRES_DSN": "postgresql://omnigate@db:5432/omnigate",
        "OMNIGATE_REDIS__URL": "redis://redis:6379/0",
    }
    (container,) = objects[("Deployment", "omnigate")]["spec"]["template"]["spec"]["containers"]
    for e in container["env"]:
        if e["name"].startswith("OMNIGATE_"):
            value = e["value"] if "value" in e else made_up[e["name"]]
            monkeypatch.setenv(e["name"], value.replace("$(POD_NAME)", pod))


def test_helm_lint_strict_is_clean():
    report = helm.lint(str(CHART), strict=True, namespace="llm")
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # Only informational notes (severity 1), no warnings or errors.
    assert all(m["severity"] <= 1 for m in report["messages"]), report["messages"]


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"admin": {"apiKey": "too-short"}}, "apiKey"),
        ({"autoscaling": {"inFlightTarget": 0}}, "inFlightTarget"),
        ({"no_such_key": 1}, "no_such_key"),
        ({"config": {"server": {"port": 8080}, "engines": []}}, "engines"),
    ],
)
def test_values_schema_refuses_bad_values(values, needle):
    report = helm.lint(str(CHART), values, strict=True)
    problems = " ".join(report["errors"] + [m["error"] for m in report["messages"] if m["severity"] >= 2])
    assert problems and needle in problems, report


def _default_engines() -> list[dict]:
    return list(yaml.safe_load((CHART / "values.yaml").read_text())["config"]["engines"])


@pytest.mark.parametrize("cap", [0, "8", 2.5])
def test_values_schema_refuses_an_engine_cap_that_is_not_a_count(cap):
    engines = [{**e, "max_in_flight": cap} for e in _default_engines()]
    report = helm.lint(str(CHART), {"config": {"engines": engines}}, strict=True)
    problems = " ".join(report["errors"] + [m["error"] for m in report["messages"] if m["severity"] >= 2])
    assert problems and "max_in_flight" in problems, report


def test_each_engine_s_cap_is_declared_within_the_engine_s_own_concurrency_and_can_be_set():
    """The chart's engines declare their caps (shared by every pod through Redis) at no more than the
    max_num_seqs their vLLM-Omni deploy configs run with; an engine's cap set in the values reaches the
    ConfigMap as set, the other engines' as the chart declares them."""
    ops = CHART.parents[1]
    for engine in _default_engines():
        deploy = yaml.safe_load((ops / "vllm-omni" / f"{engine['model']}.yaml").read_text())
        seqs = min(stage["max_num_seqs"] for stage in deploy["stages"])
        assert 1 <= engine["max_in_flight"] <= seqs, (engine["name"], engine["max_in_flight"], seqs)
    engines = [{**e, "max_in_flight": 2} if e["name"] == "omni-int4" else e for e in _default_engines()]
    rendered = _gateway_config(render({"config": {"engines": engines}}))
    caps = {e["name"]: e["max_in_flight"] for e in rendered["engines"]}
    assert caps == {"omni-int4": 2, "omni-bf16": 8}


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_rendered_objects_are_valid_kubernetes(kube_version):
    objects = render()
    assert {k for k, _ in objects} == CORE_KINDS | {"ServiceMonitor", "PrometheusRule"}
    for (kind, _name), obj in objects.items():
        if kind in CORE_KINDS:
            kubernetes_validate.validate(obj, kube_version, strict=True)


def test_workload_wiring():
    objects = render()
    dep, svc, pdb, hpa = (
        one(objects, k) for k in ("Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler")
    )
    selector = dep["spec"]["selector"]["matchLabels"]
    pod = dep["spec"]["template"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == selector == pdb["spec"]["selector"]["matchLabels"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert svc["spec"]["ports"][0]["targetPort"] in ports
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    # The HPA owns the replica count and scales on a gauge the gateway really exports.
    assert "replicas" not in dep["spec"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": dep["metadata"]["name"],
    }
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric == "omnigate_requests_in_flight" and metric in EXPORTED
    assert hpa["spec"]["minReplicas"] >= 2 and pdb["spec"]["maxUnavailable"] == 1
    # Hardened pod with writable scratch space under the read-only root.
    sc = container["securityContext"]
    assert (
        sc["readOnlyRootFilesystem"]
        and not sc["allowPrivilegeEscalation"]
        and sc["capabilities"]["drop"] == ["ALL"]
    )
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert {"/tmp", "/var/cache/omnigate", "/var/lib/omnigate"} <= {
        m["mountPath"] for m in container["volumeMounts"]
    }


def test_config_map_holds_a_valid_gateway_config(tmp_path, capsys, monkeypatch):
    objects = render()
    fill_env(monkeypatch, objects)
    cm = objects[("ConfigMap", "omnigate")]
    path = tmp_path / "omnigate.yaml"
    path.write_text(cm["data"]["omnigate.yaml"])
    assert check_config(str(path)) == 0, capsys.readouterr().err
    config = yaml.safe_load(cm["data"]["omnigate.yaml"])
    dep = one(objects, "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["ports"][0]["containerPort"] == config["server"]["port"]
    assert container["args"][:3] == ["serve", "--config", "/etc/omnigate/omnigate.yaml"]
    # Streams get their grace period: preStop pause + graceful shutdown < termination grace.
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert (
        pre_stop + config["server"]["graceful_shutdown_s"]
        < dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    )
    # A changed config rolls the pods.
    assert dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    changed = render({"config": {**config, "logging": {"level": "debug", "json": True}}})
    assert (
        one(changed, "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        != dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    )


def test_admin_key_comes_from_a_secret():
    objects = render()
    dep = one(objects, "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    ref = next(e for e in container["env"] if e["name"] == "OMNIGATE_ADMIN__API_KEY")["valueFrom"][
        "secretKeyRef"
    ]
    secret = objects[("Secret", ref["name"])]
    assert ref["key"] in secret["data"]
    assert len(secret["data"][ref["key"]]) >= 48  # base64 of 48 generated characters at least
    # A given key is used as is; an existing Secret replaces the chart's.
    given = render({"admin": {"apiKey": "a" * 40}})
    assert one(given, "Secret")["data"]["admin-api-key"] == __import__("base64").b64encode(b"a" * 40).decode()
    existing = render({"admin": {"existingSecret": "ops-admin", "existingSecretKey": "token"}})
    assert not [k for k in existing if k[0] == "Secret"]
    (c2,) = one(existing, "Deployment")["spec"]["template"]["spec"]["containers"]
    ref2 = next(e for e in c2["env"] if e["name"] == "OMNIGATE_ADMIN__API_KEY")["valueFrom"]["secretKeyRef"]
    assert ref2 == {"name": "ops-admin", "key": "token"}


def test_service_monitor_scrapes_the_service_as_job_omnigate():
    objects = render()
    sm, svc = one(objects, "ServiceMonitor"), one(objects, "Service")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}
    (endpoint,) = sm["spec"]["endpoints"]
    # /metrics has a port of its own; the public http port does not serve it.
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert [p["name"] for p in svc["spec"]["ports"]] == ["http", "metrics"]
    # The alert rules select job="omnigate".
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "omnigate"


def test_prometheus_rule_is_the_canonical_rule_set_and_promtool_accepts_it(tmp_path):
    base = "https://runbooks.example.internal/omnigate/"
    rule = one(render({"prometheusRule": {"runbookBaseUrl": base}}), "PrometheusRule")
    canonical = []
    for p in sorted(RULES_DIR.glob("*.yaml"), key=lambda p: "0" if "recording" in p.name else "1"):
        canonical.extend(yaml.safe_load(p.read_text().replace("ops/runbooks/", base))["groups"])
    assert rule["spec"]["groups"] == canonical
    urls = [
        r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r
    ]
    assert urls and all(u.startswith(base) for u in urls)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = run([promtool(), "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_config_map_is_the_canonical_dashboard():
    cm = one({k: v for k, v in render().items() if k[1].endswith("-dashboard")}, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["omnigate.json"]) == json.loads(DASHBOARD.read_text())


def test_chart_copies_match_the_canonical_files():
    """The chart cannot read outside its directory, so it carries copies (`make ops-sync` refreshes them)."""
    for canonical in [*RULES_DIR.glob("*.yaml"), DASHBOARD]:
        copy = CHART / "files" / canonical.name
        assert copy.read_bytes() == canonical.read_bytes(), f"{copy} is stale: run make ops-sync"


def test_optional_parts_switch_off():
    objects = render(
        {
            "autoscaling": {"enabled": False},
            "podDisruptionBudget": {"enabled": False},
            "serviceMonitor": {"enabled": False},
            "prometheusRule": {"enabled": False},
            "grafanaDashboard": {"enabled": False},
            "replicaCount": 3,
        }
    )
    kinds = {k for k, _ in objects}
    assert not kinds & {"HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule"}
    assert not [n for _, n in objects if n.endswith("-dashboard")]
    assert one(objects, "Deployment")["spec"]["replicas"] == 3
    for obj in objects.values():
        kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)


def _env(objects: dict) -> dict[str, dict]:
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize(
    "values",
    [
        {"directory": {"backend": "sqlite"}},  # the HPA can add pods: its default ceiling is 10
        {"directory": {"backend": "sqlite"}, "autoscaling": {"enabled": False}, "replicaCount": 2},
        {
            "directory": {"backend": "sqlite"},
            "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3},
        },
        {"directory": {"backend": "postgres", "existingSecret": ""}},
    ],
)
def test_several_replicas_cannot_render_without_a_shared_directory(values):
    with pytest.raises(Exception, match="directory"):
        render(values)


def test_one_replica_may_keep_its_own_directory_and_several_share_postgres():
    single = render(
        {"directory": {"backend": "sqlite"}, "autoscaling": {"enabled": False}, "replicaCount": 1}
    )
    env = _env(single)
    assert env["OMNIGATE_AUTH__REPLICAS"]["value"] == "1"
    assert env["OMNIGATE_AUTH__DIRECTORY__BACKEND"]["value"] == "sqlite"
    assert "OMNIGATE_AUTH__DIRECTORY__POSTGRES_DSN" not in env
    env = _env(render())
    # The gateway is told the most replicas the HPA may run, so its own refusals match the chart's.
    assert env["OMNIGATE_AUTH__REPLICAS"]["value"] == "10"
    assert env["OMNIGATE_AUTH__DIRECTORY__POSTGRES_DSN"]["valueFrom"]["secretKeyRef"] == {
        "name": "omnigate-directory",
        "key": "dsn",
    }


def test_the_redis_url_comes_from_a_secret_as_the_one_redis_block():
    alone = {**SINGLE, "directory": {"backend": "sqlite"}, "redis": {"existingSecret": ""}}
    assert "OMNIGATE_REDIS__URL" not in _env(render(alone))  # one replica, no Secret named: it counts alone
    env = _env(render({"redis": {"existingSecret": "shared-redis"}}))
    assert env["OMNIGATE_REDIS__URL"]["valueFrom"]["secretKeyRef"] == {"name": "shared-redis", "key": "url"}


def test_metrics_port_is_wired_through_container_service_and_monitor():
    objects = render({"metrics": {"port": 9300}})
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8080, "metrics": 9300}
    assert _env(objects)["OMNIGATE_METRICS__PORT"]["value"] == "9300"
    svc = one(objects, "Service")
    assert {"name": "metrics", "port": 9300, "targetPort": "metrics", "protocol": "TCP"} in svc["spec"][
        "ports"
    ]
    on_http = render({"metrics": {"port": 0}})
    assert one(on_http, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "http"
    assert "OMNIGATE_METRICS__PORT" not in _env(on_http)


# -- engines the chart runs, on verified weights ---------------------------------------------------------
REVISION = "0123456789abcdef0123456789abcdef01234567"
ENGINE = {
    "name": "omni-int4",
    "image": "vllm/vllm-omni:v0.30.0",
    "model": "cpatonn/Qwen3-Omni-30B-A3B-Instruct-AWQ-4bit",
    "revision": REVISION,
    "servedModelName": "qwen3-omni-int4",
    "args": ["--omni", "--log-stats"],
}


def _engine_values(tmp_path) -> tuple[dict, object]:
    """A generated snapshot and the chart values pinning it (its files' sums, as weights-manifest prints)."""
    from gateway.weights import parse_manifest, write_manifest

    folder = tmp_path / "omni-int4" / "snapshots" / REVISION
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["Test"]}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    return {"engines": [{**ENGINE, "sha256": parse_manifest(write_manifest(folder))}]}, folder


def test_engines_start_only_after_their_weights_are_verified(tmp_path):
    from gateway.weights import parse_manifest, verify

    values, folder = _engine_values(tmp_path)
    objects = render(values)
    for (kind, _), obj in objects.items():
        if kind in CORE_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)
    dep = objects[("Deployment", "omnigate-omni-int4")]
    pod = dep["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (engine,) = pod["containers"]
    args = init["args"]
    assert args[:2] == ["verify-weights", "--download"]
    flag = dict(zip(args[2::2], args[3::2], strict=True))
    assert flag["--model"] == ENGINE["model"] and flag["--revision"] == REVISION
    # The engine loads the folder that was verified, by the path that names its revision.
    snapshot = f"/models/omni-int4/snapshots/{REVISION}"
    assert flag["--dir"] == snapshot and engine["args"][0] == snapshot
    assert f"--served-model-name={ENGINE['servedModelName']}" in engine["args"]
    assert {"--omni", "--log-stats"} <= set(engine["args"])
    assert "--enable-log-requests" in engine["args"]  # the engine's log joins the gateway's on the request id
    assert engine["env"] == [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    assert next(m for m in engine["volumeMounts"] if m["name"] == "models")["readOnly"] is True
    # The manifest the init container reads is the pinned one, and it verifies the snapshot it pins.
    manifest_mount = next(m for m in init["volumeMounts"] if m["mountPath"] == "/etc/omnigate/weights")
    volume = next(v for v in pod["volumes"] if v["name"] == manifest_mount["name"])
    cm = objects[("ConfigMap", volume["configMap"]["name"])]
    sums = parse_manifest(cm["data"]["sha256"])
    assert sums == values["engines"][0]["sha256"] and flag["--manifest"] == "/etc/omnigate/weights/sha256"
    assert verify(folder, sums, REVISION).ok
    (folder / "model.safetensors").write_bytes(b"\1" + (folder / "model.safetensors").read_bytes()[1:])
    assert not verify(folder, sums, REVISION).ok
    # A Service of the engine's name, and the gateway's own selectors never take in an engine pod.
    svc = objects[("Service", "omni-int4")]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    gateway = objects[("Deployment", "omnigate")]
    gateway_selector = gateway["spec"]["selector"]["matchLabels"]
    assert not gateway_selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert (
        not objects[("Service", "omnigate")]["spec"]["selector"].items()
        <= dep["spec"]["template"]["metadata"]["labels"].items()
    )


def test_tracing_goes_to_the_gateway_and_to_every_vllm_engine_the_chart_runs(tmp_path, monkeypatch):
    """One collector endpoint in the values: the gateway gets the standard OTEL_* variables (and, as
    rendered, builds its tracer from them), each vLLM engine exports its own spans there; without it,
    neither. A vLLM-Omni engine (``--omni``) is not given the flag: vLLM-Omni 0.30 refuses to start with it
    for Qwen3-Omni's pipeline (tests/realomni/test_traces.py holds that against the real server)."""
    from gateway.settings import Settings
    from observability import tracing

    values, _ = _engine_values(tmp_path)
    values = {**values, **SINGLE}
    off = render(values)
    (gw_off,) = off[("Deployment", "omnigate")]["spec"]["template"]["spec"]["containers"]
    assert not [e for e in gw_off["env"] if e["name"].startswith(("OTEL_", "OMNIGATE_TRACING"))]
    (engine_off,) = off[("Deployment", "omnigate-omni-int4")]["spec"]["template"]["spec"]["containers"]
    assert not [a for a in engine_off["args"] if a.startswith("--otlp")]

    collector = "http://otel-collector.observability:4318"
    on = render({**values, "tracing": {"otlpEndpoint": collector, "sampleRatio": 0.25}})
    for (kind, _), obj in on.items():
        if kind in CORE_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)
    (gw,) = on[("Deployment", "omnigate")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in gw["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == collector
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf" and env["OTEL_SERVICE_NAME"] == "omnigate"
    assert "k8s.pod.name=$(OTEL_K8S_POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]
    names = [e["name"] for e in gw["env"]]  # a variable is expanded only from one listed before it
    assert names.index("OTEL_K8S_POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    (omni,) = on[("Deployment", "omnigate-omni-int4")]["spec"]["template"]["spec"]["containers"]
    assert not [a for a in omni["args"] if a.startswith("--otlp")]
    assert not [e for e in omni["env"] if e["name"].startswith("OTEL_")]
    # the same engine as plain vLLM (no --omni): its spans join the trace
    plain = {**values["engines"][0], "image": "vllm/vllm-openai:v0.32.0", "args": ["--log-stats"]}
    vllm_on = render({**values, "engines": [plain], "tracing": {"otlpEndpoint": collector}})
    (engine,) = vllm_on[("Deployment", "omnigate-omni-int4")]["spec"]["template"]["spec"]["containers"]
    assert f"--otlp-traces-endpoint={collector}/v1/traces" in engine["args"]
    assert {"name": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "value": "http/protobuf"} in engine["env"]
    # As a pod runs it: the gateway's settings and the OTEL_* variables turn tracing on, sampled as set.
    for name, value in env.items():
        if name.startswith(("OTEL_", "OMNIGATE_TRACING")) and value is not None:
            monkeypatch.setenv(name, value.replace("$(OTEL_K8S_POD_NAME)", "omnigate-0"))
    engine_cfg = {"name": "e", "kind": "vllm", "base_url": "http://e:8000/v1", "model": "m", "serves": ["m"]}
    settings = Settings(engines=[engine_cfg])
    assert settings.tracing.sample_ratio == 0.25 and tracing.enabled(settings.tracing)
    tracer = tracing.build(settings.tracing)
    assert tracer is not None
    try:
        resource = tracer.provider.resource.attributes
        assert resource["service.name"] == "omnigate" and resource["k8s.pod.name"] == "omnigate-0"
    finally:
        tracer.shutdown()
    grpc = render(
        {
            **values,
            "engines": [plain],
            "tracing": {"otlpEndpoint": "otel-collector.observability:4317", "protocol": "grpc"},
        }
    )
    (engine,) = grpc[("Deployment", "omnigate-omni-int4")]["spec"]["template"]["spec"]["containers"]
    assert "--otlp-traces-endpoint=otel-collector.observability:4317" in engine["args"]


def test_another_pin_rolls_the_engine(tmp_path):
    values, _ = _engine_values(tmp_path)
    before = render(values)[("Deployment", "omnigate-omni-int4")]
    other = {**values["engines"][0], "sha256": {**values["engines"][0]["sha256"], "config.json": "f" * 64}}
    after = render({"engines": [other]})[("Deployment", "omnigate-omni-int4")]
    key = "checksum/weights"
    assert (
        before["spec"]["template"]["metadata"]["annotations"][key]
        != after["spec"]["template"]["metadata"]["annotations"][key]
    )


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"revision": "main"}, "revision"),  # a branch moves: only a commit pins
        ({"sha256": {}}, "sha256"),
        ({"sha256": {"config.json": "not-a-sum"}}, "sha256"),
        ({"servedModelName": None}, "servedModelName"),
    ],
)
def test_an_engine_without_a_full_pin_does_not_render(tmp_path, change, needle):
    values, _ = _engine_values(tmp_path)
    engine = {k: v for k, v in {**values["engines"][0], **change}.items() if v is not None}
    report = helm.lint(str(CHART), {"engines": [engine]}, strict=True)
    problems = " ".join(report["errors"] + [m["error"] for m in report["messages"] if m["severity"] >= 2])
    assert problems and needle in problems, report


def _gateway_config(objects: dict) -> dict:
    configmap = next(o for (k, n), o in objects.items() if k == "ConfigMap" and n == "omnigate")
    return yaml.safe_load(configmap["data"]["omnigate.yaml"])


def test_the_gateway_requires_the_pinned_model_and_revision_of_each_engine_the_chart_runs(
    tmp_path, monkeypatch
):
    values, _ = _engine_values(tmp_path)
    fill_env(monkeypatch, render(values))
    engines = {e["name"]: e for e in _gateway_config(render(values))["engines"]}
    # omni-int4 runs from the chart on verified weights: the gateway routes to it only while it lists them.
    assert engines["omni-int4"]["expected_revision"] == REVISION
    assert engines["omni-int4"]["expected_model"] == "qwen3-omni-int4"
    # omni-bf16 runs elsewhere: nothing is invented for it.
    assert "expected_revision" not in engines["omni-bf16"]
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(_gateway_config(render(values))))
    assert check_config(str(path)) == 0


def test_a_gateway_expectation_that_contradicts_the_pin_does_not_render(tmp_path):
    values, _ = _engine_values(tmp_path)
    config = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
    config["engines"][0]["expected_revision"] = "f" * 40
    with pytest.raises(
        helm.HelmRenderError, match=r"expected_revision .* is not the revision engines.. pins"
    ):
        render({**values, "config": config})
    config["engines"][0].pop("expected_revision")
    config["engines"][0]["expected_model"] = "some-other-model"
    with pytest.raises(helm.HelmRenderError, match="expected_model some-other-model"):
        render({**values, "config": config})


# -- several replicas: one audit chain, one routing state, one admission count -----------------------------


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"audit": {"store": "sqlite"}}, "audit.store"),
        ({"audit": {"existingSecret": ""}}, "audit.existingSecret"),
        ({"audit": {"signingKeySecretKey": ""}}, "signing"),
        ({"audit": {"witness": {"claimName": ""}}}, "witness"),
        ({"redis": {"existingSecret": ""}}, "redis.existingSecret"),
        ({"config": {"routing": {"state": {"backend": "memory"}}}}, "routing.state.backend"),
        ({"config": {"audit": {"store": "sqlite"}}}, "config.audit"),
        ({"config": {"audit": {"enabled": False}}}, "config.audit"),
        ({"config": {"traffic": {"enabled": False}}}, "config.traffic"),
        # The HPA's ceiling counts, not the replicas it starts with.
        (
            {
                "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2},
                "redis": {"existingSecret": ""},
            },
            "redis",
        ),
        ({"autoscaling": {"enabled": False}, "replicaCount": 2, "audit": {"store": "sqlite"}}, "audit"),
    ],
)
def test_several_replicas_cannot_render_without_the_shared_stores(values, needle):
    with pytest.raises(helm.HelmRenderError, match=needle):
        render(values)


def test_several_replicas_share_one_signed_audit_chain_a_witness_and_redis(tmp_path, monkeypatch, capsys):
    objects = render()
    config = _gateway_config(objects)
    env = _env(objects)
    # One PostgreSQL chain, its DSN and signing key from a Secret, never in the ConfigMap.
    assert config["audit"]["store"] == "postgres"
    assert config["audit"]["signing"]["algorithm"] in ("hmac-sha256", "ed25519")
    assert "postgres_dsn" not in config["audit"] and "key" not in config["audit"]["signing"]
    assert env["OMNIGATE_AUDIT__POSTGRES_DSN"]["valueFrom"]["secretKeyRef"] == {
        "name": "omnigate-audit",
        "key": "dsn",
    }
    assert env["OMNIGATE_AUDIT__SIGNING__KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "omnigate-audit",
        "key": "signing-key",
    }
    # Each pod publishes its heads to a file of its own on a volume outside the database.
    assert env["OMNIGATE_AUDIT__WITNESS_PATH"]["value"] == "/var/lib/omnigate-witness/$(POD_NAME).jsonl"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    names = [
        e["name"] for e in one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    ]
    assert names.index("POD_NAME") < names.index("OMNIGATE_AUDIT__WITNESS_PATH")  # $(POD_NAME) is expanded
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    mount = next(
        m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/var/lib/omnigate-witness"
    )
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["persistentVolumeClaim"] == {"claimName": "omnigate-audit-witness"}
    # The routing state and admission in the one Redis.
    assert config["routing"]["state"]["backend"] == "redis"
    assert env["OMNIGATE_REDIS__URL"]["valueFrom"]["secretKeyRef"] == {"name": "omnigate-redis", "key": "url"}
    # And the gateway's own settings model takes it, with the Secrets' values filled in.
    fill_env(monkeypatch, objects)
    path = tmp_path / "omnigate.yaml"
    path.write_text(objects[("ConfigMap", "omnigate")]["data"]["omnigate.yaml"])
    assert check_config(str(path)) == 0, capsys.readouterr().err
    for (kind, _), obj in objects.items():
        if kind in CORE_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)


def test_one_replica_may_keep_its_own_stores():
    objects = render(
        {
            **SINGLE,
            "directory": {"backend": "sqlite"},
            "audit": {"store": "sqlite", "witness": {"claimName": ""}},
            "redis": {"existingSecret": ""},
        }
    )
    config, env = _gateway_config(objects), _env(objects)
    assert config.get("audit", {}).get("store", "sqlite") == "sqlite"
    assert config.get("routing", {}).get("state", {}).get("backend", "memory") == "memory"
    assert not {"OMNIGATE_AUDIT__POSTGRES_DSN", "OMNIGATE_REDIS__URL", "OMNIGATE_AUDIT__WITNESS_PATH"} & set(
        env
    )


def test_every_chain_the_chart_ships_screens_the_media_its_engines_take(tmp_path, monkeypatch):
    from gateway.chains import build_policy_sets
    from gateway.settings import load_settings
    from policies.registry import build_chain

    objects = render()
    fill_env(monkeypatch, objects)
    path = tmp_path / "omnigate.yaml"
    path.write_text(objects[("ConfigMap", "omnigate")]["data"]["omnigate.yaml"])
    settings = load_settings(path)
    assert any(e.modalities()[0] - {"text"} for e in settings.engines)
    chains = {"default": build_chain(settings.policies), **build_policy_sets(settings)}
    for name, chain in chains.items():
        assert "nsfw-screen" in chain.describe()["pre"], name


# -- the rollback rules of the chart's engine layout --------------------------------------------------------
def _chart_settings(tmp_path, monkeypatch, values: dict | None = None):
    from gateway.settings import load_settings

    objects = render(values)
    fill_env(monkeypatch, objects)
    path = tmp_path / "omnigate.yaml"
    path.write_text(objects[("ConfigMap", "omnigate")]["data"]["omnigate.yaml"])
    return load_settings(path)


def test_every_rule_the_chart_ships_watches_an_engine_and_shifts_to_a_variant_it_runs(tmp_path, monkeypatch):
    """The gateway's default rules roll INT4 back to INT8 first and watch canaries: the chart's layout has
    neither, so its config carries rules of its own, each with a target its engines have."""
    settings = _chart_settings(tmp_path, monkeypatch)
    controller = settings.routing.controller
    assert controller.enabled
    engines = settings.engines
    variants = {e.variant for e in engines}
    names = [r.name for r in controller.rules]
    assert {"int4-latency", "int4-latency-whole", "wer-drift", "latency-batch"} <= set(names), names
    for rule in controller.rules:
        watched = [e for e in engines if rule.select.matches(e.name, e.variant, e.role)]
        assert watched, f"rule {rule.name} watches no engine of the chart: leave it out"
        if rule.action.kind == "shift":
            missing = set(rule.action.to_variants) - variants
            assert not missing, f"rule {rule.name} shifts to {sorted(missing)}, which no engine here is"
        if rule.signal == "accuracy":
            assert settings.routing.accuracy.enabled, f"rule {rule.name} reads a sentinel that is off"
        if rule.signal == "tokens_per_joule":
            assert all(e.telemetry is not None for e in watched), f"rule {rule.name} has no power source"
        if rule.action.sleep_idle:
            raise AssertionError(f"rule {rule.name} sleeps engines, which share no GPU in the chart")


def test_the_chart_s_rules_are_the_gateway_s_defaults_restricted_to_its_engines(tmp_path, monkeypatch):
    """A rule the chart shares with the defaults watches the same signal with the same thresholds, so a
    change to a default rule is made here too; only its targets (and offload) follow the layout."""
    from engines.rollout.rules import default_rules

    defaults = {r.name: r for r in default_rules()}
    settings = _chart_settings(tmp_path, monkeypatch)
    variants = {e.variant for e in settings.engines}
    for rule in settings.routing.controller.rules:
        assert rule.name in defaults, rule.name
        want = defaults[rule.name]
        kept = [v for v in want.action.to_variants if v in variants]
        assert rule.action.to_variants == kept, rule.name
        got = rule.model_dump(exclude={"action"})
        assert got == want.model_dump(exclude={"action"}), rule.name
        action = rule.model_dump()["action"]
        expected = want.model_dump()["action"] | {"to_variants": kept, "sleep_idle": False}
        assert action == expected, rule.name


@pytest.mark.parametrize(
    ("rule", "needle"),
    [
        (
            {
                "name": "to-int8",
                "select": {"variants": ["int4"]},
                "signal": "wer",
                "above": 0.05,
                "recover_below": 0.03,
                "action": {"kind": "shift", "to_variants": ["int8", "bf16"]},
            },
            "to-int8: shifts to int8, which no engine of config.engines is",
        ),
        (
            {
                "name": "canary-errors",
                "select": {"roles": ["canary"]},
                "signal": "error_rate",
                "above": 0.05,
                "recover_below": 0.04,
                "action": {"kind": "set_weight", "weight": 0.0},
            },
            "canary-errors: watches no engine of config.engines",
        ),
    ],
    ids=["dead-target", "no-engine"],
)
def test_a_rule_without_a_target_or_an_engine_in_the_layout_does_not_render(rule, needle):
    with pytest.raises(helm.HelmRenderError, match=needle):
        render({"config": {"routing": {"controller": {"rules": [rule]}}}})
    # with a canary engine and an INT8 engine configured, the same rule renders
    engines = yaml.safe_load((CHART / "values.yaml").read_text())["config"]["engines"]
    engines = [*engines, {**engines[1], "name": "omni-int8", "variant": "int8", "role": "canary"}]
    objects = render({"config": {"engines": engines, "routing": {"controller": {"rules": [rule]}}}})
    config = yaml.safe_load(objects[("ConfigMap", "omnigate")]["data"]["omnigate.yaml"])
    assert [r["name"] for r in config["routing"]["controller"]["rules"]] == [rule["name"]]
