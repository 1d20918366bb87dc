"""The media-limits policy's config: its decoding runs in the process-wide sandbox, so it has no worker count."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from policies.media_limits import MediaLimitsConfig

pytestmark = pytest.mark.timeout(30)


def test_a_worker_count_is_refused_naming_the_key():
    with pytest.raises(ValidationError) as err:
        MediaLimitsConfig.model_validate({"workers": 2})
    assert [(e["loc"], e["type"]) for e in err.value.errors()] == [(("workers",), "extra_forbidden")]
    assert MediaLimitsConfig.model_validate({}).one_modality_per_message == "split"
