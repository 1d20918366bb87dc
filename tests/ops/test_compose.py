"""ops/compose.yaml, validated by the real ``docker compose config`` (no Docker engine needed) and
checked against the files it mounts: gateway configs, vLLM-Omni deploy configs, Prometheus, the proxy."""

from __future__ import annotations

import json
import os
import re
import secrets
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from gateway.cli import check_config
from tests.ops.catalogue import OPS, ROOT
from tests.ops.tools import run, venv_tool

COMPOSE = OPS / "compose.yaml"
SIGNING_KEY = secrets.token_hex(32)  # as the env file's comment says to make one
SHARED = {"redis", "postgres", "prometheus", "grafana", "proxy"}
PROFILES = {
    "gpu": SHARED
    | {"gateway", "omni-int4", "omni-bf16", "weights-omni-int4", "weights-omni-bf16", "dcgm-exporter"},
    "cpu": SHARED | {"gateway-cpu"},
}


def _env(**extra: str) -> dict[str, str]:
    # Only what compose needs: nothing from the caller's environment leaks into the result.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    env.update(extra)
    return env


def compose_config(profile: str, **env: str) -> dict:
    result = run(
        [venv_tool("docker-compose"), "-f", str(COMPOSE), "--profile", profile, "config", "--format", "json"],
        env=_env(**{"OMNIGATE_ADMIN_KEY": "k" * 32, "OMNIGATE_AUDIT_SIGNING_KEY": SIGNING_KEY, **env}),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request) -> tuple[str, dict]:
    return request.param, compose_config(request.param)


def test_docker_compose_config_validates_each_profile(profile):
    name, config = profile
    assert set(config["services"]) == PROFILES[name]
    result = run(
        [venv_tool("docker-compose"), "-f", str(COMPOSE), "--profile", name, "config", "--quiet"],
        env=_env(OMNIGATE_ADMIN_KEY="k" * 32, OMNIGATE_AUDIT_SIGNING_KEY=SIGNING_KEY),
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_the_admin_key_is_required():
    result = run(
        [venv_tool("docker-compose"), "-f", str(COMPOSE), "--profile", "cpu", "config", "--quiet"], env=_env()
    )
    assert result.returncode != 0
    assert "OMNIGATE_ADMIN_KEY" in result.stderr


def test_every_bind_mount_exists(profile):
    _, config = profile
    for name, svc in config["services"].items():
        for v in svc.get("volumes", []):
            if v["type"] == "bind":
                assert Path(v["source"]).exists(), f"{name} mounts missing {v['source']}"
                assert v.get("read_only"), f"{name} mounts {v['source']} writable"


def _gateway(config: dict) -> tuple[str, dict]:
    return next((n, s) for n, s in config["services"].items() if n.startswith("gateway"))


def _mounted(svc: dict, target: str) -> Path:
    return Path(next(v["source"] for v in svc["volumes"] if v["target"] == target))


def test_gateway_config_is_valid_and_reachable_by_proxy_and_prometheus(profile, capsys, monkeypatch):
    _name, config = profile
    _gw_name, gw = _gateway(config)
    assert gw["command"][:3] == ["serve", "--config", "/etc/omnigate/omnigate.yaml"]
    config_file = _mounted(gw, "/etc/omnigate/omnigate.yaml")
    for key, value in gw["environment"].items():  # the file as the service starts it: its environment over it
        if key.startswith("OMNIGATE_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("OMNIGATE_ADMIN__API_KEY", secrets.token_hex(32))  # "k" * 32 is refused as weak
    assert check_config(str(config_file)) == 0, capsys.readouterr().err
    settings = yaml.safe_load(config_file.read_text())
    port = settings["server"]["port"]
    assert gw["networks"]["default"]["aliases"] == ["omnigate"]
    assert gw["environment"]["OMNIGATE_ADMIN__API_KEY"] == "k" * 32
    # The one Redis block, set from the environment, names the compose file's own Redis service.
    redis_url = gw["environment"]["OMNIGATE_REDIS__URL"]
    assert redis_url.startswith("redis://redis:") and "redis" in config["services"]
    assert "redis" in gw["depends_on"]
    assert str(port) in gw["expose"]
    assert config["services"]["proxy"]["environment"]["OMNIGATE_UPSTREAM"] == f"omnigate:{port}"
    prom = yaml.safe_load((OPS / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "omnigate")
    assert job["static_configs"][0]["targets"] == [f"omnigate:{port}"]
    # Grace period for open streams: compose waits longer than the gateway does.
    assert float(gw["stop_grace_period"].rstrip("s")) > settings["server"]["graceful_shutdown_s"]
    build = gw["build"]
    assert (Path(build["context"]) / build["dockerfile"]).resolve() == (OPS / "Dockerfile").resolve()


def _deploy_config(svc: dict) -> dict:
    arg = next(a for a in svc["command"] if a.startswith("--deploy-config="))
    inside = Path(arg.split("=", 1)[1])
    mount = next(v for v in svc["volumes"] if inside.is_relative_to(v["target"]))
    return yaml.safe_load((Path(mount["source"]) / inside.relative_to(mount["target"])).read_text())


def test_gpu_engines_carry_the_serving_flags():
    config = compose_config("gpu")
    gw = yaml.safe_load((OPS / "config" / "compose-gpu.yaml").read_text())
    engines = {urlparse(e["base_url"]).hostname: e for e in gw["engines"]}
    assert set(engines) == {"omni-int4", "omni-bf16"}
    expected_tp = {"omni-int4": 1, "omni-bf16": 2}
    for name, engine in engines.items():
        svc = config["services"][name]
        assert svc["entrypoint"] == ["vllm", "serve"]
        args = svc["command"]
        assert "--omni" in args
        assert "--log-stats" in args  # vLLM-Omni's /metrics (queue, KV cache, per-stage TTFT) needs it
        assert "--enable-log-requests" in args  # its log names each request by the gateway's request id
        assert f"--served-model-name={engine['model']}" in args
        assert f"--port={urlparse(engine['base_url']).port}" in args
        assert svc["ipc"] == "host"
        deploy = _deploy_config(svc)
        assert deploy["enable_prefix_caching"] is True
        stages = {s["stage_id"]: s for s in deploy["stages"]}
        assert set(stages) == {0, 1, 2}
        thinker = stages[0]
        assert thinker["tensor_parallel_size"] == expected_tp[name]
        assert thinker["max_model_len"] == 65536
        assert all(s["max_num_seqs"] == 8 for s in stages.values())
        # The GPUs the stages use are the ones the service reserves, none more.
        reserved = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert reserved["capabilities"] == ["gpu"] and reserved["driver"] == "nvidia"
        per_gpu: dict[int, float] = defaultdict(float)
        for s in stages.values():
            for d in s["devices"].split(","):
                per_gpu[int(d)] += s["gpu_memory_utilization"]
        assert sorted(per_gpu) == list(range(len(reserved["device_ids"])))
        assert len(thinker["devices"].split(",")) == thinker["tensor_parallel_size"]
        # Headroom under the 90 % VRAM alert.
        assert max(per_gpu.values()) <= 0.85 + 1e-9, per_gpu
        # Connectors named by stages are defined.
        for s in stages.values():
            for connector in (s.get("input_connectors") or {}).values():
                assert connector in deploy["connectors"]
    assert engines["omni-int4"]["variant"] == "int4" and engines["omni-bf16"]["variant"] == "bf16"
    assert engines["omni-bf16"]["role"] == "fallback"
    # Prometheus scrapes each engine's own metrics where compose runs it.
    prom = yaml.safe_load((OPS / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "vllm-omni")
    targets = {t for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{h}:{urlparse(e['base_url']).port}" for h, e in engines.items()}


@pytest.mark.parametrize("collector", ["", "http://otel-collector:4318"])
def test_the_gateway_traces_to_the_collector_and_the_omni_engines_are_not_given_the_flag(collector):
    """One OTEL_EXPORTER_OTLP_ENDPOINT turns the gateway's traces on. The vLLM-Omni engines never get
    --otlp-traces-endpoint, set or not: vLLM-Omni 0.30 refuses to start with it for Qwen3-Omni's
    pipeline (tests/realomni/test_traces.py holds that fact against the real server)."""
    config = compose_config("gpu", OTEL_EXPORTER_OTLP_ENDPOINT=collector)
    assert config["services"]["gateway"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == collector
    for name in ("omni-int4", "omni-bf16"):
        svc = config["services"][name]
        argv = [*svc["entrypoint"], *svc["command"]]
        assert not [a for a in argv if "otlp" in a], argv
        assert not [k for k in svc.get("environment") or {} if k.startswith("OTEL_")]


def test_gpu_reservations_do_not_overlap():
    config = compose_config("gpu")
    ids = [
        i
        for n in ("omni-int4", "omni-bf16")
        for i in config["services"][n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    ]
    assert len(ids) == len(set(ids)) == 3


def test_proxy_template_variables_are_all_set():
    config = compose_config("cpu")
    proxy = config["services"]["proxy"]
    template = _mounted(proxy, "/etc/nginx/templates/omnigate.conf.template").read_text()
    wanted = set(re.findall(r"\$\{([A-Z0-9_]+)\}", template))
    assert wanted and wanted <= set(proxy["environment"]), wanted - set(proxy["environment"])
    assert all(v.startswith("OMNIGATE_") for v in wanted)
    # The image's envsubst step touches only these, never nginx's own $variables.
    assert proxy["environment"]["NGINX_ENVSUBST_FILTER"] == "^OMNIGATE_"
    published = {p["target"] for p in proxy["ports"]}
    assert published == {int(proxy["environment"]["OMNIGATE_PROXY_PORT"])}


def test_images_are_pinned():
    for name, svc in compose_config("gpu")["services"].items():
        image = svc["image"]
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{name}: {image}"


def test_env_example_names_every_variable_without_a_default():
    text = COMPOSE.read_text()
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", text))
    example = {
        line.split("=", 1)[0]
        for line in (OPS / "env.example").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert required and required <= example
    assert (ROOT / ".dockerignore").is_file()


REVISION = "0123456789abcdef0123456789abcdef01234567"


def test_each_engine_starts_only_after_its_pinned_weights_are_verified(tmp_path):
    from gateway.cli import main
    from gateway.weights import parse_manifest

    config = compose_config(
        "gpu",
        OMNI_INT4_REVISION=REVISION,
        OMNI_BF16_REVISION="f" * 40,
        OMNI_INT4_CHECKPOINT="org/int4-checkpoint",
    )
    for engine, revision in (("omni-int4", REVISION), ("omni-bf16", "f" * 40)):
        svc = config["services"][engine]
        check = config["services"][f"weights-{engine}"]
        assert svc["depends_on"][f"weights-{engine}"]["condition"] == "service_completed_successfully"
        args = check["command"]
        assert args[:2] == ["verify-weights", "--download"]
        flag = dict(zip(args[2::2], args[3::2], strict=True))
        assert flag["--revision"] == revision
        # The engine loads the folder that was verified, by the path that names its revision.
        snapshot = f"/models/{engine}/snapshots/{revision}"
        assert flag["--dir"] == snapshot and svc["command"][0] == snapshot
        assert svc["environment"]["HF_HUB_OFFLINE"] == "1"
        models = next(v for v in svc["volumes"] if v["target"] == "/models")
        assert models["read_only"] and models["source"] == next(
            v["source"] for v in check["volumes"] if v["target"] == "/models"
        )
        # The manifest it reads is a file of ops/weights/ (read-only), and the shipped one fails closed.
        manifest = Path(flag["--manifest"])
        mount = next(v for v in check["volumes"] if manifest.is_relative_to(v["target"]))
        shipped = Path(mount["source"]) / manifest.relative_to(mount["target"])
        assert mount["read_only"] and shipped.is_file()
        with pytest.raises(ValueError):
            parse_manifest(shipped.read_text())
        folder = tmp_path / engine / "snapshots" / revision
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        assert (
            main(["verify-weights", "--dir", str(folder), "--manifest", str(shipped), "--revision", revision])
            == 1
        )
    assert (
        dict(
            zip(
                config["services"]["weights-omni-int4"]["command"][2::2],
                config["services"]["weights-omni-int4"]["command"][3::2],
                strict=True,
            )
        )["--model"]
        == "org/int4-checkpoint"
    )


def test_an_unpinned_engine_cannot_pass_its_check():
    config = compose_config("gpu")  # no revision in the environment
    args = config["services"]["weights-omni-int4"]["command"]
    revision = dict(zip(args[2::2], args[3::2], strict=True))["--revision"]
    from gateway.weights import is_commit

    assert not is_commit(revision)


def test_the_gateway_requires_the_revisions_the_weights_checks_verified(monkeypatch):
    from gateway.settings import load_settings

    config = compose_config("gpu", OMNI_INT4_REVISION=REVISION, OMNI_BF16_REVISION="f" * 40)
    env = config["services"]["gateway"]["environment"]
    assert env["OMNIGATE_ADMIN__API_KEY"] == "k" * 32  # the anchor's variable is kept beside the new ones
    for key, value in env.items():
        if key.startswith("OMNIGATE_"):
            monkeypatch.setenv(key, value)
    settings = load_settings(OPS / "config" / "compose-gpu.yaml")
    by_name = {e.name: e for e in settings.engines}
    for engine, revision in (("omni-int4", REVISION), ("omni-bf16", "f" * 40)):
        assert by_name[engine].expected_revision == revision
        # ... the revision the engine's weights check verified and its folder is named after
        assert config["services"][engine]["command"][0] == f"/models/{engine}/snapshots/{revision}"


# -- the shipped shape keeps the docs' promises ------------------------------------------------------------


def _settings(profile: str, monkeypatch) -> tuple[dict, dict, object]:
    """compose's config for a profile, its gateway service, and the gateway's settings as that service
    starts them (the mounted file with the service's environment over it)."""
    from gateway.settings import load_settings

    config = compose_config(profile)
    _, gw = _gateway(config)
    for key, value in gw["environment"].items():
        if key.startswith("OMNIGATE_"):
            monkeypatch.setenv(key, value)
    return config, gw, load_settings(_mounted(gw, "/etc/omnigate/omnigate.yaml"))


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_the_audit_trail_is_signed_in_compose_s_postgresql_with_a_witness_beside_it(name, monkeypatch):
    config, gw, settings = _settings(name, monkeypatch)
    audit = settings.audit
    assert audit.enabled and audit.store == "postgres"
    dsn = urlparse(audit.postgres_dsn.get_secret_value())
    pg = config["services"]["postgres"]
    assert dsn.hostname == "postgres" and dsn.port == 5432
    assert (
        dsn.username == pg["environment"]["POSTGRES_USER"]
        and dsn.password == pg["environment"]["POSTGRES_PASSWORD"]
    )
    assert dsn.path == "/" + pg["environment"]["POSTGRES_DB"]
    assert gw["depends_on"]["postgres"]["condition"] == "service_healthy"
    # Signed with the key from the env file, which compose requires.
    assert audit.signing.key is not None and audit.signing.key.get_secret_value() == SIGNING_KEY
    result = run(
        [venv_tool("docker-compose"), "-f", str(COMPOSE), "--profile", name, "config", "--quiet"],
        env=_env(OMNIGATE_ADMIN_KEY="k" * 32),
    )
    assert result.returncode != 0 and "OMNIGATE_AUDIT_SIGNING_KEY" in result.stderr
    # The signed heads go to a volume of their own, not the database's.
    assert audit.witness_path is not None
    volume = next(v for v in gw["volumes"] if audit.witness_path.is_relative_to(v["target"]))
    assert volume["type"] == "volume" and volume["source"] not in {v["source"] for v in pg.get("volumes", [])}


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_chain_in_front_of_an_engine_that_takes_media_screens_it(name, monkeypatch):
    from gateway.chains import build_policy_sets
    from policies.registry import build_chain

    _, _, settings = _settings(name, monkeypatch)
    if not any(e.modalities()[0] - {"text"} for e in settings.engines):
        return
    chains = {"default": build_chain(settings.policies), **build_policy_sets(settings)}
    for chain_name, chain in chains.items():
        assert "nsfw-screen" in chain.describe()["pre"], chain_name


def test_the_gpu_profile_reads_power_and_memory_from_a_dcgm_exporter(monkeypatch):
    config, _, settings = _settings("gpu", monkeypatch)
    dcgm = config["services"]["dcgm-exporter"]
    assert dcgm["profiles"] == ["gpu"] and "dcgm-exporter" in dcgm["image"]
    seen = dcgm["deploy"]["resources"]["reservations"]["devices"][0]
    for engine in settings.engines:
        svc = config["services"][urlparse(str(engine.base_url)).hostname]
        ids = svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        tel = engine.telemetry
        # Each engine's GPUs, by the index the exporter labels them with (it sees every GPU of the host).
        assert tel.dcgm_url is not None and urlparse(str(tel.dcgm_url)).hostname == "dcgm-exporter"
        assert str(urlparse(str(tel.dcgm_url)).port) in dcgm["expose"]
        assert sorted(tel.gpus) == sorted(ids) and seen.get("count") in ("all", -1)
    moved = compose_config(
        "gpu", OMNIGATE_AUDIT_SIGNING_KEY=SIGNING_KEY, OMNI_BF16_GPU_A="4", OMNI_BF16_GPU_B="5"
    )
    env = moved["services"]["gateway"]["environment"]
    assert [
        env["OMNIGATE_ENGINES__1__TELEMETRY__GPUS__0"],
        env["OMNIGATE_ENGINES__1__TELEMETRY__GPUS__1"],
    ] == [
        "4",
        "5",
    ]


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_shipped_rule_watches_an_engine_and_has_its_target_in_the_layout(name, monkeypatch):
    _, _, settings = _settings(name, monkeypatch)
    controller = settings.routing.controller
    if not controller.enabled:
        return
    engines = settings.engines
    variants = {e.variant for e in engines}
    for rule in controller.rules:
        watched = [e for e in engines if rule.select.matches(e.name, e.variant, e.role)]
        assert watched, f"rule {rule.name} watches no engine of this layout: leave it out"
        if rule.action.kind == "shift":
            missing = set(rule.action.to_variants) - variants
            assert not missing, f"rule {rule.name} shifts to {sorted(missing)}, which no engine here is"
        if rule.signal == "accuracy":
            assert settings.routing.accuracy.enabled, f"rule {rule.name} reads a sentinel that is off"


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_offload_is_promised_only_where_the_engines_sleep_and_share_a_gpu(name, monkeypatch):
    config, _, settings = _settings(name, monkeypatch)
    if not any(
        r.action.sleep_idle for r in settings.routing.controller.rules if settings.routing.controller.enabled
    ):
        return
    devices: dict[str, set[str]] = {}
    for engine in settings.engines:
        svc = config["services"][urlparse(str(engine.base_url)).hostname]
        assert "--enable-sleep-mode" in svc["command"], engine.name
        devices[engine.name] = set(svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"])
    shared = [a for a in devices for b in devices if a != b and devices[a] & devices[b]]
    assert shared, "sleep_idle sleeps only engines that share a GPU with the one under pressure"
