"""The media policies' settings, apart from the decoders that use them.

Kept free of the codec libraries (PyAV, Pillow, numpy, libsndfile) so that loading a chain, which
always holds the media steps, does not load them: a text-only request never needs them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from policies.base import PolicyConfig

_TOKEN_TILE = 28 * 28


class ImageConfig(PolicyConfig):
    max_input_pixels: Annotated[int, Field(ge=1_000_000)] = 50_000_000
    max_pixels: Annotated[int, Field(ge=10_000)] = 2_000_000
    vision_max_res: Annotated[int, Field(ge=28)] | None = Field(
        default=1024,
        description="longest side in pixels: a larger image is downsampled to it, aspect kept, beside the "
        "max_pixels area cap (null: the area cap alone)",
    )
    # A pydantic field: every model gets its own copy of the default.
    formats: list[Literal["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"]] = [  # noqa: RUF012
        "JPEG",
        "PNG",
        "WEBP",
        "GIF",
        "BMP",
        "TIFF",
    ]
    output: Literal["auto", "jpeg", "png", "webp"] = Field(
        default="auto", description="auto: PNG stays PNG (lossless), anything else becomes JPEG"
    )
    jpeg_quality: Annotated[int, Field(ge=50, le=100)] = 90


class AudioConfig(PolicyConfig):
    max_duration_s: Annotated[float, Field(gt=0)] = 3 * 3600.0
    max_sample_rate: Annotated[int, Field(ge=8000, le=768000)] = Field(
        default=96000, description="sources declaring a higher rate are refused before decoding"
    )
    max_output_rate: Annotated[int, Field(ge=8000, le=192000)] = Field(
        default=48000, description="audio is resampled to at most this rate while decoding"
    )
    segment_s: Annotated[float, Field(ge=10)] = 2400.0
    encoding: Literal["flac", "wav"] = "flac"
    segment_separator: str = "\n\n"


class VideoConfig(PolicyConfig):
    max_duration_s: Annotated[float, Field(gt=0)] = 120.0
    over_limit: Literal["trim", "refuse"] = "trim"
    fps: Annotated[float, Field(gt=0, le=30)] = 2.0
    max_frames: Annotated[int, Field(ge=1, le=2048)] = 240
    max_decoded_frames: Annotated[int, Field(ge=1)] = Field(
        default=7200, description="frames decoded at most per part, whatever the container's timestamps say"
    )
    min_frame_pixels: Annotated[int, Field(ge=_TOKEN_TILE)] = 128 * _TOKEN_TILE
    max_frame_pixels: Annotated[int, Field(ge=_TOKEN_TILE)] = 768 * _TOKEN_TILE
    max_input_pixels: Annotated[int, Field(ge=_TOKEN_TILE)] = 4096 * 2304
    frame_quality: Annotated[int, Field(ge=50, le=100)] = 85
    crf: Annotated[int, Field(ge=0, le=51)] = 23
