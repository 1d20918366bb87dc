"""The served-model check: /v1/models' id and the revision its root names, against the engine's config."""

from __future__ import annotations

import pytest

from engines.selection.identity import identity_problem, revision_of

REV = "0123456789abcdef0123456789abcdef01234567"
ROOT = f"/models/hub/models--Qwen--Qwen3-Omni/snapshots/{REV}"


def _card(id_: str, root: str) -> dict:
    return {"id": id_, "object": "model", "root": root}


def test_revision_is_the_last_segment_of_root():
    assert revision_of(ROOT) == REV
    assert revision_of(ROOT + "/") == REV
    assert revision_of("Qwen/Qwen3-Omni") == "Qwen3-Omni"


def test_nothing_expected_nothing_checked():
    assert identity_problem(None, None, []) is None


def test_the_right_model_and_revision_pass():
    served = [_card("other", "/x"), _card("qwen3-omni", ROOT)]
    assert identity_problem("qwen3-omni", REV, served) is None
    assert identity_problem("qwen3-omni", None, served) is None
    assert identity_problem(None, REV, served) is None


@pytest.mark.parametrize(
    ("model", "revision", "served", "words"),
    [
        ("qwen3-omni", None, [_card("qwen3-omni-int4", ROOT)], "not the configured model 'qwen3-omni'"),
        (
            "qwen3-omni",
            REV,
            [_card("qwen3-omni", ROOT.replace(REV, "f" * 40))],
            "not the configured revision",
        ),
        # The revision must be the listed model's, not another card's.
        ("qwen3-omni", REV, [_card("qwen3-omni", "/m/snapshots/abc"), _card("other", ROOT)], "revision abc"),
        (None, REV, [], "serves revision none"),
        ("qwen3-omni", None, [], "serves none"),
        ("qwen3-omni", REV, [{"id": "qwen3-omni"}], "revision none"),
    ],
)
def test_a_mismatch_is_named(model, revision, served, words):
    problem = identity_problem(model, revision, served)
    assert problem is not None and words in problem


def test_a_prefix_of_the_revision_is_not_the_revision():
    assert identity_problem(None, REV[:12], [_card("m", ROOT)]) is not None
