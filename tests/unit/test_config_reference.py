"""The configuration reference is generated from the settings models, so it must say something for each key.

Every field of every settings model and of every installed policy's ``Config`` model carries a description;
the rendered reference names every leaf key; and the environment variable it prints for a key is one the
settings really read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from docs.hooks.config_reference import (
    leaf_keys,
    missing_descriptions,
    policy_configs,
    policy_reference,
    settings_reference,
    walk,
)
from gateway.settings import Settings, load_settings

BUILT_IN = {
    "request-limits",
    "load-shedding",
    "grounding",
    "media-fetch",
    "media-limits",
    "nsfw-screen",
    "audio-screen",
}


def test_every_field_has_a_description() -> None:
    missing = missing_descriptions()
    assert not missing, "fields without a description (add Field(description=...)):\n" + "\n".join(missing)


def test_every_built_in_policy_is_documented() -> None:
    assert set(policy_configs()) >= BUILT_IN


def test_the_settings_reference_names_every_leaf_key() -> None:
    page = settings_reference()
    keys = leaf_keys()
    assert len(keys) > 200  # the walk reached the nested models, lists and maps
    absent = [k for k in keys if f"| `{k}` |" not in page]
    assert not absent, absent
    for nested in (
        "engines[].telemetry.dcgm_url",
        "routing.controller.rules[].action.kind",
        "models.<name>.sampling_defaults.temperature",
        "policy_sets.<name>.pre[].name",
        "auth.directory.postgres_dsn",
        "logging.json",
    ):
        assert nested in keys


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_each_policy_reference_names_every_leaf_key(name: str) -> None:
    page = policy_reference(name)
    config = policy_configs()[name]
    absent = [k for k in leaf_keys(config) if f"| `{k}` |" not in page]
    assert not absent, absent
    assert policy_reference(name) in policy_reference() or name == "load-shedding"


def _row(page: str, key: str) -> list[str]:
    line = next(ln for ln in page.splitlines() if ln.startswith(f"| `{key}` |"))
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


@pytest.mark.parametrize(
    ("key", "value", "read"),
    [
        ("server.port", "9123", lambda s: s.server.port == 9123),
        ("traffic.soft_limit", "7", lambda s: s.traffic.soft_limit == 7),
        ("routing.controller.interval_s", "2.5", lambda s: s.routing.controller.interval_s == 2.5),
        ("audit.signing.key_id", "k2", lambda s: s.audit.signing.key_id == "k2"),
        ("logging.json", "false", lambda s: s.logging.json_output is False),
        ("auth.failures.window_s", "90", lambda s: s.auth.failures.window_s == 90),
    ],
)
def test_the_printed_variable_is_the_one_the_settings_read(
    key: str, value: str, read, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _row(settings_reference(), key)[1].strip("`")
    assert env.startswith("OMNIGATE_")
    assert not read(load_settings())
    monkeypatch.setenv(env, value)
    assert read(load_settings())


def test_an_indexed_variable_sets_that_entry_of_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = _row(settings_reference(), "engines[].max_in_flight")[1].strip("`")
    assert env == "OMNIGATE_ENGINES__<i>__MAX_IN_FLIGHT"
    config = tmp_path / "omnigate.yaml"
    config.write_text(
        "engines:\n  - {name: a, kind: vllm, serves: [m], base_url: 'http://127.0.0.1:9/v1', model: m}\n"
    )
    monkeypatch.setenv(env.replace("<i>", "0"), "3")
    assert load_settings(config).engines[0].max_in_flight == 3


def test_defaults_and_types_are_the_models() -> None:
    page = settings_reference()
    assert _row(page, "server.port")[2:4] == ["integer (≥ 0, ≤ 65535)", "`8080`"]
    assert _row(page, "server.max_body_bytes")[3] == "`16777216` (16 MiB)"
    assert _row(page, "engines[].name")[3] == "required"
    assert _row(page, "admin.api_key")[2:4] == ["secret", "unset"]
    kinds = _row(page, "engines[].kind")[2]
    assert kinds == r"vllm-omni \| vllm \| litellm \| local \| stt"
    rows = {r.key: r for r in walk(Settings)}
    assert rows["engines"].default == "1 entry, see below"
