"""The request's allow-lists and bounds: which fields an engine must honour, which are refused, the
limits of ``metadata`` and the structured-output constraints, and ``structured_outputs`` itself.

Split from :mod:`core.schemas`, which re-exports every name here and reads these tables per request.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, model_validator

from core.request_parts import _Wire

#: chat_template_kwargs keys a client may set: switches the model's chat templates document for thinking
#: (Qwen3's ``enable_thinking``, DeepSeek-V3.1's and Granite's ``thinking``). Anything else (a whole
#: ``chat_template``, ``tools``, ``documents``, template internals) would let a client rewrite the prompt
#: the engine builds around its messages.
CHAT_TEMPLATE_KWARGS: frozenset[str] = frozenset({"enable_thinking", "thinking"})

#: the request fields that only an engine speaking OpenAI's full surface can honour (engines/adapters/base.py)
FEATURE_FIELDS: tuple[str, ...] = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "reasoning_effort",
)


#: vLLM's own sampling and decoding extras (sent through ``extra_body``): each reaches only an engine that
#: declares it in its capabilities' ``features`` (engines/adapters/base.py), and a request that sets one no engine of
#: the model takes is refused naming it, as for :data:`FEATURE_FIELDS`
VLLM_EXTRA_FIELDS: tuple[str, ...] = (
    "min_p",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "priority",
)

#: request fields of OpenAI's the gateway knows and cannot honour: refused saying why (code
#: ``unsupported_field``), never taken for a misspelt field nor silently dropped
UNSUPPORTED_FIELDS: dict[str, str] = {
    "web_search_options": "web search is not available through this gateway",
    "prediction": "predicted outputs are not available through this gateway",
    "functions": "the legacy functions are not served; send tools",
    "function_call": "the legacy function_call is not served; send tool_choice",
}

#: the most entries ``metadata`` may have, and its keys' and values' lengths (OpenAI's limits)
METADATA_MAX_PAIRS, METADATA_KEY_MAX, METADATA_VALUE_MAX = 16, 64, 512
#: the longest regex, grammar or JSON schema text a structured output may carry, and its most choices
_CONSTRAINT_MAX_CHARS = 100_000
#: the largest token id, token count or priority passed on (no model has a token id or length past it)
_INT32 = 2**31 - 1
_CHOICES_MAX = 1024

_Choices = Annotated[
    list[Annotated[str, Field(max_length=_CONSTRAINT_MAX_CHARS)]],
    Field(min_length=1, max_length=_CHOICES_MAX),
]
_Constraint = Annotated[str, Field(min_length=1, max_length=_CONSTRAINT_MAX_CHARS)]


class StructuredOutputs(_Wire):
    """vLLM's ``structured_outputs``: one constraint on the answer (what ``guided_*`` were before)."""

    json_: dict[str, Any] | _Constraint | None = Field(default=None, alias="json")
    regex: _Constraint | None = None
    choice: _Choices | None = None
    grammar: _Constraint | None = None
    json_object: bool | None = None
    structural_tag: _Constraint | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: Annotated[str, Field(max_length=1024)] | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [k for k in _CONSTRAINTS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "exactly one of json, regex, choice, grammar, json_object, structural_tag is needed"
            )
        return self


_CONSTRAINTS = ("json_", "regex", "choice", "grammar", "json_object", "structural_tag")
#: the older ``guided_*`` fields and the ``structured_outputs`` key each stands for
GUIDED_FIELDS: dict[str, str] = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}

#: ``logit_bias``: token id -> bias, at most 1024 entries
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100.0, le=100.0)]],
    Field(max_length=1024),
]
#: ``stop_token_ids``: at most 256 token ids
StopTokenIds = Annotated[list[Annotated[int, Field(ge=0, le=_INT32)]], Field(max_length=256)]
#: ``metadata``: string pairs within OpenAI's limits
Metadata = Annotated[
    dict[
        Annotated[str, Field(min_length=1, max_length=METADATA_KEY_MAX)],
        Annotated[str, Field(max_length=METADATA_VALUE_MAX)],
    ],
    Field(max_length=METADATA_MAX_PAIRS),
]
