"""Settings of the limits and defaults: what a config may say, and the field a bad one is refused by."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings


def _engine(**kw) -> dict:
    return {
        "name": "e",
        "kind": "vllm",
        "base_url": "http://127.0.0.1:9/v1",
        "model": "m",
        "serves": ["pub"],
        **kw,
    }


def test_sampling_defaults_are_per_served_model_and_bounded():
    s = Settings(
        engines=[_engine()], models={"pub": {"sampling_defaults": {"temperature": 0.7, "top_p": 0.9}}}
    )
    assert s.models["pub"].sampling_defaults.values() == {"temperature": 0.7, "top_p": 0.9}
    with pytest.raises(ValidationError, match="no engine serves a model named 'other'"):
        Settings(engines=[_engine()], models={"other": {"sampling_defaults": {"temperature": 0.7}}})
    with pytest.raises(ValidationError, match="temperature"):
        Settings(engines=[_engine()], models={"pub": {"sampling_defaults": {"temperature": 3}}})
    with pytest.raises(ValidationError, match="seed"):
        Settings(engines=[_engine()], models={"pub": {"sampling_defaults": {"seed": 1}}})


@pytest.mark.parametrize(
    "field,value", [("thinking_budget", True), ("expected_model", "m"), ("expected_revision", "0" * 40)]
)
def test_engine_checks_are_for_vllm_kinds_only(field, value):
    assert getattr(EngineConfig(**_engine(**{field: value})), field) == value
    with pytest.raises(ValidationError, match=f"{field} is for vllm and vllm-omni engines"):
        EngineConfig(name="l", kind="litellm", model="openai/x", serves=["pub"], **{field: value})


def test_thinking_cap_defaults_to_32k():
    assert EngineConfig(**_engine()).max_thinking_tokens == 32768
    assert EngineConfig(**_engine()).thinking_budget is False


@pytest.mark.parametrize("revision", ["", "a/b", "x" * 129, "rev with space"])
def test_a_revision_is_one_path_segment(revision):
    with pytest.raises(ValidationError, match="expected_revision"):
        EngineConfig(**_engine(expected_revision=revision))
