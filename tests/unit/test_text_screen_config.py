"""The text screen's config is checked at start-up: a classifier's endpoint, its labels, the categories'."""

from __future__ import annotations

import pytest

from policies.registry import PolicyConfigError, build_chain
from policies.settings import PolicyChainConfig, PolicySpec

SERVED = {
    "url": "http://guard:8000",
    "model": "prompt-guard",
    "endpoint": "classify",
    "labels": ["ok", "bad"],
}


def chain(config: dict, name: str = "text-screen") -> None:
    stage = "pre" if name == "text-screen" else "post"
    build_chain(PolicyChainConfig(**{stage: [PolicySpec(name=name, config=config)]}))


def test_a_valid_screen_loads_in_both_stages() -> None:
    config = {"served": SERVED, "categories": {"injection": {"labels": ["bad"], "threshold": 0.5}}}
    chain(config)
    chain(config, "text-screen-answers")


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"served": {**SERVED, "endpoint": "score"}}, "classify, tei-predict or chat-guard"),
        ({"served": {**SERVED, "labels": None}}, "served.labels"),
        ({"categories": {"x": {"labels": ["nope"], "threshold": 0.5}}}, "categories.x.labels"),
        ({"categories": {}}, "categories"),
        ({"served": {**SERVED, "url": "file:///etc/passwd"}}, "served.url"),
    ],
)
def test_a_bad_screen_config_fails_naming_the_field(config: dict, field: str) -> None:
    base = {"served": SERVED, "categories": {"injection": {"labels": ["bad"], "threshold": 0.5}}}
    with pytest.raises(PolicyConfigError, match=field.replace(".", r"\.")):
        chain({**base, **config})
