"""Environment overrides reach entries of lists the YAML file holds (``OMNIGATE_ENGINES__0__API_KEY``).

The README and the Helm chart tell operators to pass an engine's API key this way, so the key never sits
in the config file; the override must change that one field of that one engine and leave the rest of the
file's entry alone, and an index the file does not have must fail the boot naming the variable.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import load_settings

YAML = """
engines:
  - name: a
    kind: vllm
    serves: [m]
    base_url: http://127.0.0.1:9/v1
    model: m
  - name: b
    kind: vllm
    serves: [m]
    base_url: http://127.0.0.1:10/v1
    model: m
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    p = tmp_path / "omnigate.yaml"
    p.write_text(YAML)
    return p


def test_an_override_changes_one_field_of_one_listed_engine(config: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OMNIGATE_ENGINES__1__API_KEY", "sk-from-the-environment")
    s = load_settings(config)
    assert [e.name for e in s.engines] == ["a", "b"]
    assert str(s.engines[1].base_url).startswith("http://127.0.0.1:10")
    assert s.engines[1].api_key is not None and "sk-from-the-environment" in str(
        getattr(s.engines[1].api_key, "get_secret_value", lambda: s.engines[1].api_key)()
    )
    assert s.engines[0].api_key is None


def test_overrides_of_plain_blocks_still_merge(config: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OMNIGATE_SERVER__PORT", "9123")
    monkeypatch.setenv("OMNIGATE_ENGINES__0__MODEL", "other")
    s = load_settings(config)
    assert s.server.port == 9123
    assert s.engines[0].model == "other" and s.engines[1].model == "m"


def test_an_index_the_file_does_not_have_fails_naming_the_variable(
    config: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("OMNIGATE_ENGINES__5__API_KEY", "sk-x")
    with pytest.raises(ValueError, match="OMNIGATE_ENGINES__5__API_KEY"):
        load_settings(config)


def test_without_a_file_indexed_variables_build_the_list(monkeypatch: pytest.MonkeyPatch):
    for i, port in ((0, 9), (1, 10)):
        monkeypatch.setenv(f"OMNIGATE_ENGINES__{i}__NAME", f"e{i}")
        monkeypatch.setenv(f"OMNIGATE_ENGINES__{i}__KIND", "vllm")
        monkeypatch.setenv(f"OMNIGATE_ENGINES__{i}__SERVES__0", "m")
        monkeypatch.setenv(f"OMNIGATE_ENGINES__{i}__BASE_URL", f"http://127.0.0.1:{port}/v1")
        monkeypatch.setenv(f"OMNIGATE_ENGINES__{i}__MODEL", "m")
    s = load_settings(None)
    assert [e.name for e in s.engines] == ["e0", "e1"]
