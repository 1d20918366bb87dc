"""``omnigate check-config`` and the settings sources (YAML, then ``OMNIGATE_`` environment)."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from engines.adapters.settings import DEFAULT_PUBLIC_MODEL
from gateway.settings import load_settings
from tests.harness import ServeProcess, wait_until

EXAMPLE = Path(__file__).resolve().parents[2] / "ops" / "config" / "omnigate.yaml"


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_check_config_prints_engines_and_chain(tmp_path):
    # The example's placeholder secrets do not boot (tests/unit/test_front_door_settings.py); generated ones do.
    text = EXAMPLE.read_text()
    for placeholder in ("sk-replace-me", "replace-with-the-output-of-openssl-rand-hex-32"):
        assert placeholder in text, placeholder
        text = text.replace(placeholder, secrets.token_hex(32))
    cfg = tmp_path / "omnigate.yaml"
    cfg.write_text(text)
    out = _cli("check-config", str(cfg))
    assert out.returncode == 0, out.stderr
    assert "omni-int4: kind=vllm-omni variant=int4" in out.stdout
    assert "serves: qwen3-omni-flash" in out.stdout
    assert "pre: load-shedding -> request-limits" in out.stdout
    assert "traffic: soft limit 16, hard limit 64 in flight; in-process" in out.stdout
    assert "interactive 32/64, standard 16/64, batch 8/48" in out.stdout


@pytest.mark.parametrize(
    ("yaml_text", "named"),
    [
        ("engines:\n  - {name: a, kind: tgi, model: m, serves: [x]}\n", "engines.0.kind"),
        ("engines:\n  - {name: a, kind: vllm, model: m, serves: [x]}\n", "needs base_url"),
        ("engines:\n  - {name: a, kind: local, model: m, serves: [x], colour: red}\n", "engines.0.colour"),
        ("server: {port: 99999}\n", "server.port"),
        (
            "policies:\n  pre: [{name: request-limits, config: {max_messages: -1}}]\n",
            "policies.pre[0].config.max_messages",
        ),
        ("policies:\n  pre: [{name: not-a-policy}]\n", "policies.pre[0].name"),
        ("traffic: {soft_limit: 80}\n", "soft_limit (80) exceeds hard_limit"),
        ("traffic: {hard_limit: 0}\n", "traffic.hard_limit"),
        (
            "engines:\n  - {name: a, kind: local, model: m, serves: [x], max_in_flight: 2, max_in_flight_overloaded: 3}\n",
            "max_in_flight_overloaded (3) exceeds max_in_flight (2)",
        ),
        ("engines: [\n", "invalid configuration"),
    ],
)
def test_check_config_names_the_bad_field(tmp_path, yaml_text, named):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text)
    out = _cli("check-config", str(cfg))
    assert out.returncode != 0
    assert named in out.stderr


def test_missing_file_is_an_error(tmp_path):
    out = _cli("check-config", str(tmp_path / "absent.yaml"))
    assert out.returncode == 2 and "not found" in out.stderr


def test_environment_overrides_the_file(monkeypatch):
    monkeypatch.setenv("OMNIGATE_SERVER__PORT", "9123")
    monkeypatch.setenv("OMNIGATE_LOGGING__LEVEL", "debug")
    settings = load_settings(EXAMPLE)
    assert settings.server.port == 9123
    assert settings.logging.level == "debug"
    assert settings.engines[0].name == "omni-int4"


def test_defaults_run_the_embedded_engine(monkeypatch):
    settings = load_settings(None)
    assert [(e.kind, e.serves) for e in settings.engines] == [("local", [DEFAULT_PUBLIC_MODEL])]
    assert settings.server.host == "127.0.0.1" and settings.server.port == 8080


def test_secrets_never_print(tmp_path):
    settings = load_settings(EXAMPLE)
    assert "sk-replace-me" not in repr(settings)


def test_duplicate_engine_names_are_refused(tmp_path):
    cfg = tmp_path / "dup.yaml"
    cfg.write_text(
        "engines:\n"
        "  - {name: a, kind: local, model: m, serves: [x]}\n"
        "  - {name: a, kind: local, model: m, serves: [y]}\n"
    )
    with pytest.raises(ValidationError, match="used twice"):
        load_settings(cfg)


INT4_ENGINE = (
    '  - {name: q, kind: vllm, base_url: "http://127.0.0.1:9/v1", model: m, variant: int4, serves: [x]}\n'
)
BF16_ENGINE = (
    '  - {name: b, kind: vllm, base_url: "http://127.0.0.1:9/v1", model: m, variant: bf16, serves: [y]}\n'
)


@pytest.mark.parametrize(
    ("rule", "named"),
    [
        (
            "{name: wer-drift, signal: wer, above: 0.05, select: {variants: [int4]},"
            " action: {kind: shift, to_variants: [int8]}}",
            "routing.controller.rules[0] wer-drift: shifts to int8",
        ),
        (
            "{name: int4-latency, signal: upstream_ttft_p99, above: 0.6, select: {variants: [int4]},"
            " action: {kind: shift, to_variants: [fp16, bf16]}}",
            "x is served by q (int4)",  # the BF16 engine serves y, not x
        ),
        (
            "{name: canary-errors, signal: error_rate, above: 0.05, select: {roles: [canary]},"
            " action: {kind: set_weight, weight: 0}}",
            "routing.controller.rules[0] canary-errors: watches no engine",
        ),
    ],
)
def test_check_config_refuses_a_listed_rule_that_can_never_act(tmp_path, rule, named):
    cfg = tmp_path / "rules.yaml"
    cfg.write_text(
        f"engines:\n{INT4_ENGINE}{BF16_ENGINE}routing:\n  controller:\n    rules:\n      - {rule}\n"
    )
    out = _cli("check-config", str(cfg))
    assert out.returncode == 1, out.stdout
    assert named in out.stderr and "could never act" in out.stderr


def test_check_config_passes_one_int4_engine_and_says_which_default_rules_it_leaves_out(tmp_path):
    cfg = tmp_path / "one.yaml"
    cfg.write_text(f"engines:\n{INT4_ENGINE}")
    out = _cli("check-config", str(cfg))
    assert out.returncode == 0, out.stderr
    said = out.stdout + out.stderr
    assert "rollback_rules_inactive" in said
    for name in ("int4-latency", "wer-drift", "canary-errors", "energy-efficiency"):
        assert name in said
    assert "configuration OK" in out.stdout


NO_TARGET_RULE = (
    "routing:\n  controller:\n    rules:\n      - {name: wer-drift, signal: wer, above: 0.05, "
    "select: {variants: [int4]}, action: {kind: shift, to_variants: [int8]}}\n"
)


def test_serve_refuses_to_start_with_a_listed_rule_that_can_never_act(tmp_path):
    cfg = tmp_path / "rules.yaml"
    cfg.write_text(f"engines:\n{INT4_ENGINE}{NO_TARGET_RULE}")
    out = _cli("serve", "--config", str(cfg), "--port", "0")
    assert out.returncode == 1
    assert "routing.controller.rules[0] wer-drift: shifts to int8" in out.stderr


@pytest.mark.timeout(120)
def test_a_hot_reload_to_a_rule_that_can_never_act_is_refused_and_the_gateway_serves_on(tmp_path):
    base = f"engines:\n{INT4_ENGINE}audit: {{sqlite_path: {tmp_path / 'audit.db'}}}\n"
    cfg = tmp_path / "omnigate.yaml"
    cfg.write_text(base)
    gateway = ServeProcess(cfg, tmp_path / "gateway.log")

    def logged(event: str) -> list[str]:
        if gateway.proc.poll() is not None:
            raise RuntimeError(gateway.log_path.read_text()[-2000:])
        return [line for line in gateway.log_path.read_text().splitlines() if event in line]

    try:
        # Its engine is down: the start ends with a warning, and the process serves its own routes.
        assert wait_until(lambda: bool(logged("gateway_ready")), timeout=90, interval=0.2)
        assert logged("rollback_rules_inactive")  # the default rules it left out
        cfg.write_text(base + NO_TARGET_RULE)
        gateway.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: bool(logged("config_reload_failed")), timeout=60, interval=0.1)
        [failed] = logged("config_reload_failed")
        assert "wer-drift" in failed and "shifts to int8" in failed
        assert not logged("config_reloaded")
        assert httpx.get(gateway.url + "/healthz", timeout=10).status_code == 200  # the running config stays
    finally:
        gateway.stop()
