"""Modal token estimates, after the Qwen-VL / Qwen-Omni processors.

Images are cut into 14 px patches merged 2×2, so one token covers 28×28 pixels;
video frames are merged in pairs in time (temporal patch 2); audio costs 12.5
tokens per second (Qwen3-Omni's audio encoder rate). Text is estimated at four
characters a token. These are estimates for refusing hopeless requests early,
not the engine's exact count.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field

from policies.base import PolicyConfig


class BudgetConfig(PolicyConfig):
    """The modal-token estimate and its budget."""

    max_modal_tokens: Annotated[int, Field(ge=256)] = Field(
        default=16384,
        description="image and video tokens a request may hold (400 modal_budget_exceeded above)",
    )
    counted: list[str] = Field(
        default_factory=lambda: ["image", "video"],
        description="modalities counted against max_modal_tokens (all count against the engine context)",
    )
    token_px: Annotated[int, Field(ge=8, le=112)] = Field(
        default=28, description="an image token per token_px x token_px pixels"
    )
    temporal_patch: Annotated[int, Field(ge=1, le=8)] = Field(
        default=2, description="video frames merged per token frame"
    )
    audio_tokens_per_s: Annotated[float, Field(gt=0, le=100)] = Field(
        default=12.5, description="tokens per second of audio"
    )
    chars_per_text_token: Annotated[float, Field(gt=0, le=16)] = Field(
        default=4.0, description="characters per text token in the estimate"
    )


def image_tokens(width: int, height: int, cfg: BudgetConfig) -> int:
    px = cfg.token_px
    return max(1, round(width / px)) * max(1, round(height / px))


def video_tokens(frames: int, width: int, height: int, cfg: BudgetConfig) -> int:
    return math.ceil(frames / cfg.temporal_patch) * image_tokens(width, height, cfg)


def audio_tokens(seconds: float, cfg: BudgetConfig) -> int:
    return math.ceil(seconds * cfg.audio_tokens_per_s)


def text_tokens(chars: int, cfg: BudgetConfig) -> int:
    return math.ceil(chars / cfg.chars_per_text_token)


def frame_size_for(
    frames: int, width: int, height: int, token_budget: int, min_px: int, max_px: int, cfg: BudgetConfig
) -> tuple[int, int]:
    """The largest frame size (aspect kept, multiples of the token tile) that keeps ``frames`` within budget."""
    pairs = max(1, math.ceil(frames / cfg.temporal_patch))
    tile = cfg.token_px
    area = min(max_px, max(min_px, token_budget * tile * tile // pairs), width * height)
    scale = math.sqrt(area / (width * height))
    w = max(tile, int(width * scale) // tile * tile)
    h = max(tile, int(height * scale) // tile * tile)
    return w, h
