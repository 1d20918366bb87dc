"""The rollback rules: their signals, selectors and actions, the defaults, and the check that one can act.

The default rules are the operating rules the deployment started from: P99 time to first
token above 600 ms (the engine's, from the engine request to its first token, per 1,000 prompt
tokens for longer prompts, no tenant over a quarter of the samples) rolls the INT4 engine back to
FP16/BF16, and so does a whole (non-streamed) answer's time per output token above 100 ms,
VRAM above 90 % for 30 s lowers the engine's concurrency and puts an idle variant on
the same GPU to sleep, the engine's P50
time to first token above 400 ms raises the engine's batch limit (within a ceiling and the engine's
own max_num_seqs),
WER above 5 % on sampled speech degrades INT4 to INT8, a canary takes 10 % of traffic
unless its errors or latency say otherwise, a non-INT4 engine under 100 tokens per joule
shifts to INT4, and an engine under 90 % on the operator's held-out set is no destination
of any shift.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

Variant = Literal["int4", "int8", "fp8", "fp16", "bf16", "fp32"]
Role = Literal["primary", "fallback", "canary"]
RuleName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]

#: what a rule can watch; all but the scraped gauges come from the gateway's own measurements
Signal = Literal[
    "ttft_p50",
    "ttft_p95",
    "ttft_p99",
    "first_audio_p50",
    "first_audio_p95",
    "first_audio_p99",
    "e2e_p50",
    "e2e_p95",
    "e2e_p99",
    "upstream_ttft_p50",
    "upstream_ttft_p95",
    "upstream_ttft_p99",
    "upstream_e2e_p50",
    "upstream_e2e_p95",
    "upstream_e2e_p99",
    # the engine's time to first token per 1,000 prompt tokens, and its time per output token
    "upstream_ttft_per_1k_prompt_tokens_p50",
    "upstream_ttft_per_1k_prompt_tokens_p95",
    "upstream_ttft_per_1k_prompt_tokens_p99",
    "upstream_tpot_p50",
    "upstream_tpot_p95",
    "upstream_tpot_p99",
    # a whole (non-streamed) answer's time per output token: the engine's duration over its output tokens
    "upstream_whole_tpot_p50",
    "upstream_whole_tpot_p95",
    "upstream_whole_tpot_p99",
    "error_rate",
    "kv_cache_usage",
    "vram_usage",
    "requests_waiting",
    "requests_running",
    "engine_ttft_p99",
    "wer",
    # energy per token (engines/rollout/energy.py) and the held-out set's accuracy (engines/rollout/accuracy.py)
    "tokens_per_joule",
    "accuracy",
]
#: signals whose windows are built from per-request samples (a rule needs ``min_samples`` of them)
SAMPLED_SIGNALS = frozenset(
    {
        "ttft_p50",
        "ttft_p95",
        "ttft_p99",
        "first_audio_p50",
        "first_audio_p95",
        "first_audio_p99",
        "e2e_p50",
        "e2e_p95",
        "e2e_p99",
        "upstream_ttft_p50",
        "upstream_ttft_p95",
        "upstream_ttft_p99",
        "upstream_e2e_p50",
        "upstream_e2e_p95",
        "upstream_e2e_p99",
        "upstream_ttft_per_1k_prompt_tokens_p50",
        "upstream_ttft_per_1k_prompt_tokens_p95",
        "upstream_ttft_per_1k_prompt_tokens_p99",
        "upstream_tpot_p50",
        "upstream_tpot_p95",
        "upstream_tpot_p99",
        "upstream_whole_tpot_p50",
        "upstream_whole_tpot_p95",
        "upstream_whole_tpot_p99",
        "error_rate",
        "wer",
        "accuracy",
    }
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RuleSelector(_Strict):
    """Which engines a rule watches; empty lists match every engine."""

    variants: list[Variant] = Field(default_factory=list, description="engines of these variants; empty: any")
    roles: list[Role] = Field(default_factory=list, description="engines of these roles; empty: any")
    engines: list[str] = Field(default_factory=list, description="engines of these names; empty: any")

    def matches(self, name: str, variant: str, role: str) -> bool:
        return (
            (not self.variants or variant in self.variants)
            and (not self.roles or role in self.roles)
            and (not self.engines or name in self.engines)
        )


class RuleAction(_Strict):
    """What a rule does while its condition holds, undone on the way back.

    ``shift``: move the engine's traffic to the first variant of ``to_variants`` that
    serves the same model, keeping ``trickle_weight`` on it so it can still be measured.
    ``set_weight``: set the engine's traffic share to ``weight``. ``limit_concurrency``:
    cap the engine's requests in flight at ``concurrency_factor`` times those running
    when the rule fired (at least ``min_concurrency``); with ``sleep_idle``, also put
    every idle engine that shares a GPU with it (no traffic share, nothing in flight,
    a variant of ``sleep_variants`` when that list is set) to sleep through vLLM-Omni's
    ``/v1/omni/sleep`` at ``sleep_level``, and wake them on the way back.
    ``raise_concurrency``: raise the engine's cap on requests in flight (per replica) to
    ``raise_factor`` times its configured cap, never above ``max_concurrency`` nor above
    the engine's own ``max_num_seqs`` (an engine that declares none is never raised: past
    what it runs at once, requests only queue inside it, where shedding cannot see them);
    a lower cap in force (VRAM pressure, overload) still wins. ``exclude_target``: while the
    condition holds, the engine is no destination of any rule's shift (it moves no traffic
    itself, so has no way back).
    """

    kind: Literal["shift", "set_weight", "limit_concurrency", "raise_concurrency", "exclude_target"] = Field(
        description="shift, set_weight, limit_concurrency, raise_concurrency or exclude_target"
    )
    to_variants: list[Variant] = Field(
        default_factory=list, description="shift: the variants to move to, first healthy one wins"
    )
    trickle_weight: Annotated[float, Field(ge=0, le=0.5)] = Field(
        default=0.05, description="shift: the share the engine keeps so its way back can be measured"
    )
    weight: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.0, description="set_weight: the engine's new traffic share"
    )
    concurrency_factor: Annotated[float, Field(gt=0, lt=1)] = Field(
        default=0.5, description="limit_concurrency: the cap as a share of the requests running when it fired"
    )
    min_concurrency: Annotated[int, Field(ge=1)] = Field(
        default=1, description="limit_concurrency: the cap is at least this"
    )
    raise_factor: Annotated[float, Field(gt=1, le=16)] = Field(
        default=2.0,
        description="raise_concurrency: the raised cap as a multiple of the engine's configured cap",
    )
    max_concurrency: Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        default=None,
        description="raise_concurrency: the ceiling of the raised cap (required); the engine's max_num_seqs "
        "bounds it too",
    )
    sleep_idle: bool = Field(
        default=False, description="limit_concurrency: also sleep idle engines that share a GPU with this one"
    )
    sleep_variants: list[Variant] = Field(
        default_factory=list, description="sleep_idle: only these variants; empty: any"
    )
    # Level 1 offloads the weights to CPU memory (a wake takes seconds); level 2 discards them.
    sleep_level: Annotated[int, Field(ge=1, le=2)] = Field(
        default=1, description="vLLM-Omni sleep level: 1 keeps the weights in CPU memory, 2 discards them"
    )

    @model_validator(mode="after")
    def _complete(self) -> RuleAction:
        if self.kind == "shift" and not self.to_variants:
            raise ValueError("a shift needs to_variants")
        if self.kind == "raise_concurrency" and self.max_concurrency is None:
            raise ValueError("a raise_concurrency needs max_concurrency (its ceiling)")
        if self.sleep_idle and self.kind != "limit_concurrency":
            raise ValueError("sleep_idle goes with limit_concurrency")
        return self


class Rule(_Strict):
    """A rollback rule: a condition on a signal, an action, and the way back."""

    name: RuleName = Field(description="the rule's name (incidents are rule@engine)")
    select: RuleSelector = Field(default=RuleSelector(), description="which engines the rule watches")
    signal: Signal = Field(description="the signal the condition reads")
    above: float | None = Field(default=None, description="the condition: the signal above this value ...")
    below: float | None = Field(
        default=None, description="... or, instead of above, below this value (tokens_per_joule, accuracy)"
    )
    for_s: Annotated[float, Field(ge=0)] = Field(default=30.0, description="... continuously for this long")
    min_samples: Annotated[int, Field(ge=0)] = Field(
        default=20, description="per-request samples the window needs before the condition counts"
    )
    action: RuleAction = Field(description="what the rule does while its condition holds")
    recover_below: float | None = Field(
        default=None, description="the way back: the signal below this (default 80 % of above) ..."
    )
    recover_above: float | None = Field(
        default=None,
        description="the way back of a below rule: the signal above this (default 125 % of below)",
    )
    recover_for_s: Annotated[float, Field(ge=0)] = Field(default=120.0, description="... for this long")
    auto_recover: bool = Field(
        default=True, description="false: the incident ends only by hand (/admin/routing/clear)"
    )

    @model_validator(mode="after")
    def _hysteresis(self) -> Rule:
        if (self.above is None) == (self.below is None):
            raise ValueError(f"rule {self.name}: set exactly one of above and below")
        if self.below is not None:
            if self.recover_below is not None:
                raise ValueError(f"rule {self.name}: a below rule recovers above recover_above")
            if self.recover_above is None:
                self.recover_above = self.below * 1.25
            if self.recover_above < self.below:
                raise ValueError(f"rule {self.name}: recover_above must not be under below")
            return self
        assert self.above is not None
        if self.recover_above is not None:
            raise ValueError(f"rule {self.name}: an above rule recovers below recover_below")
        if self.recover_below is None:
            self.recover_below = self.above * 0.8
        if self.recover_below > self.above:
            raise ValueError(f"rule {self.name}: recover_below must not exceed above")
        return self

    def breached(self, value: float) -> bool:
        """The condition holds: above ``above`` (or, for a below rule, under ``below``)."""
        if self.below is not None:
            return value < self.below
        assert self.above is not None
        return value > self.above

    def recovered(self, value: float) -> bool:
        """The way back's condition holds: under ``recover_below`` (or, for a below rule, above ``recover_above``)."""
        if self.below is not None:
            assert self.recover_above is not None
            return value > self.recover_above
        assert self.recover_below is not None
        return value < self.recover_below


def default_rules() -> list[Rule]:
    return [
        # The engine's own time to first token (from sending it the request), not the client's: a slow
        # pre-policy, a held-back window or non-streamed requests are nothing BF16 could fix. Per 1,000
        # prompt tokens (a short prompt's is its TTFT), and no tenant more than a capped share of the
        # samples: one tenant's long prompts are a long prefill, not a slow engine.
        Rule(
            name="int4-latency",
            select=RuleSelector(variants=["int4"]),
            signal="upstream_ttft_per_1k_prompt_tokens_p99",
            above=0.6,
            for_s=30,
            min_samples=20,
            recover_below=0.45,
            recover_for_s=300,
            action=RuleAction(kind="shift", to_variants=["fp16", "bf16"], trickle_weight=0.05),
        ),
        # Whole (non-streamed) answers have no first token to time: the engine's duration over the output
        # tokens it reported stands in for them (answers of 16 tokens or more, so a prompt's prefill is a
        # small share). A decode under ten tokens a second is slower than a healthy INT4 engine serves.
        Rule(
            name="int4-latency-whole",
            select=RuleSelector(variants=["int4"]),
            signal="upstream_whole_tpot_p99",
            above=0.1,
            for_s=30,
            min_samples=20,
            recover_below=0.075,
            recover_for_s=300,
            action=RuleAction(kind="shift", to_variants=["fp16", "bf16"], trickle_weight=0.05),
        ),
        Rule(
            name="vram-pressure",
            signal="vram_usage",
            above=0.9,
            for_s=30,
            min_samples=0,
            recover_below=0.8,
            recover_for_s=60,
            action=RuleAction(kind="limit_concurrency", concurrency_factor=0.5, sleep_idle=True),
        ),
        # The engine's time to first token (streamed answers; per 1,000 prompt tokens, a short prompt's is its
        # TTFT): a P50 above 400 ms means the engine's batch runs behind. Not the client's: a whole answer's
        # duration or a wait in the gateway is no first token. The raise never passes the engine's own
        # max_num_seqs (an engine that declares none is not raised), and the VRAM rule's lower cap wins over
        # it (rollback.route).
        Rule(
            name="latency-batch",
            signal="upstream_ttft_per_1k_prompt_tokens_p50",
            above=0.4,
            for_s=30,
            min_samples=20,
            recover_below=0.3,
            recover_for_s=120,
            action=RuleAction(kind="raise_concurrency", raise_factor=2.0, max_concurrency=16),
        ),
        Rule(
            name="wer-drift",
            select=RuleSelector(variants=["int4"]),
            signal="wer",
            above=0.05,
            for_s=0,
            min_samples=10,
            recover_below=0.03,
            recover_for_s=600,
            action=RuleAction(kind="shift", to_variants=["int8", "fp16", "bf16"], trickle_weight=0.1),
        ),
        Rule(
            name="canary-errors",
            select=RuleSelector(roles=["canary"]),
            signal="error_rate",
            above=0.05,
            for_s=10,
            min_samples=20,
            auto_recover=False,
            action=RuleAction(kind="set_weight", weight=0.0),
        ),
        Rule(
            name="canary-latency",
            select=RuleSelector(roles=["canary"]),
            signal="upstream_ttft_per_1k_prompt_tokens_p99",
            above=0.6,
            for_s=30,
            min_samples=20,
            auto_recover=False,
            action=RuleAction(kind="set_weight", weight=0.0),
        ),
        *energy_and_accuracy_rules(),
    ]


def energy_and_accuracy_rules() -> list[Rule]:
    """tokens/J under 100 prefers INT4; a variant under 90 % on the held-out set receives no shifted traffic."""
    return [
        # Listed after the latency and WER rules: an INT4 engine they rolled back is no destination of
        # this shift, and their roll-back of INT4 ends this rule's shift to it (see rollback.decide).
        Rule(
            name="energy-efficiency",
            select=RuleSelector(variants=["fp32", "fp16", "bf16", "fp8", "int8"]),
            signal="tokens_per_joule",
            below=100.0,
            for_s=300,
            min_samples=0,
            recover_above=125.0,
            recover_for_s=600,
            action=RuleAction(kind="shift", to_variants=["int4"], trickle_weight=0.05),
        ),
        Rule(
            name="accuracy-floor",
            signal="accuracy",
            below=0.9,
            for_s=0,
            min_samples=10,
            recover_above=0.9,
            recover_for_s=0,
            action=RuleAction(kind="exclude_target"),
        ),
    ]


class RuleScope(NamedTuple):
    """One configured engine as a rule's selector and shift see it (the check at load time)."""

    name: str
    variant: str
    role: str
    serves: tuple[str, ...]


def why_rule_cannot_act(rule: Rule, engines: Sequence[RuleScope]) -> str | None:
    """Why ``rule`` can never act on these engines, or None when it can.

    It cannot when its selector matches none of them, or when it is a shift and, for every engine it
    watches, no other engine of a ``to_variants`` variant serves one of that engine's models. A
    destination that exists but is down, asleep or excluded at run time is something else: the
    controller holds the shift (``no-target``) until one can take the traffic.
    """
    watched = [e for e in engines if rule.select.matches(e.name, e.variant, e.role)]
    if not watched:
        layout = ", ".join(f"{e.name} ({e.variant}, {e.role})" for e in engines)
        return f"watches no engine (the engines: {layout})"
    if rule.action.kind != "shift":
        return None
    wanted = rule.action.to_variants
    for src in watched:
        for dst in engines:
            if dst.name != src.name and dst.variant in wanted and set(dst.serves) & set(src.serves):
                return None
    models = sorted({m for e in watched for m in e.serves})
    served = "; ".join(
        f"{m} is served by " + ", ".join(f"{e.name} ({e.variant})" for e in engines if m in e.serves)
        for m in models
    )
    those = "that variant" if len(wanted) == 1 else "those variants"
    return (
        f"shifts to {', '.join(wanted)}, but no other engine of {those} serves its engines' models ({served})"
    )


def active_rules(rules: Sequence[Rule], engines: Sequence[RuleScope]) -> tuple[list[Rule], dict[str, str]]:
    """The rules that can act on these engines, and why each of the others cannot (by name)."""
    kept: list[Rule] = []
    left_out: dict[str, str] = {}
    for rule in rules:
        why = why_rule_cannot_act(rule, engines)
        if why is None:
            kept.append(rule)
        else:
            left_out[rule.name] = why
    return kept, left_out
