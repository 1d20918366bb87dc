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
    """Image limits and normalisation."""

    max_input_pixels: Annotated[int, Field(ge=1_000_000)] = Field(
        default=50_000_000, description="images over this many pixels are refused from their header"
    )
    max_pixels: Annotated[int, Field(ge=10_000)] = Field(
        default=2_000_000, description="larger images are downsampled to this area, aspect kept"
    )
    vision_max_res: Annotated[int, Field(ge=28)] | None = Field(
        default=1024,
        description="longest side in pixels: a larger image is downsampled to it, aspect kept, beside the "
        "max_pixels area cap (null: the area cap alone)",
    )
    formats: list[Literal["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"]] = Field(
        default=["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"],
        description="image formats accepted (what the bytes are, whatever the part's name or type says)",
    )
    output: Literal["auto", "jpeg", "png", "webp"] = Field(
        default="auto", description="auto: PNG stays PNG (lossless), anything else becomes JPEG"
    )
    jpeg_quality: Annotated[int, Field(ge=50, le=100)] = Field(
        default=90, description="JPEG quality of re-encoded images"
    )


class AudioConfig(PolicyConfig):
    """Audio limits, resampling and segmentation."""

    max_duration_s: Annotated[float, Field(gt=0)] = Field(
        default=3 * 3600.0, description="longer audio is refused"
    )
    max_sample_rate: Annotated[int, Field(ge=8000, le=768000)] = Field(
        default=96000, description="sources declaring a higher rate are refused before decoding"
    )
    max_output_rate: Annotated[int, Field(ge=8000, le=192000)] = Field(
        default=48000, description="audio is resampled to at most this rate while decoding"
    )
    segment_s: Annotated[float, Field(ge=10)] = Field(
        default=2400.0, description="longer audio is cut into segments of this length, one engine call each"
    )
    encoding: Literal["wav", "flac"] = Field(
        default="wav",
        description=(
            "what resampled or transcoded audio is sent as: wav (16-bit PCM), which every OpenAI-shaped engine "
            "takes (OpenAI's input_audio.format, and so vLLM's and vLLM-Omni's, is wav or mp3 only: a flac part "
            "is a 400 there); flac, about half the bytes, only for engines that accept it"
        ),
    )
    segment_separator: str = Field(default="\n\n", description="between the answers of consecutive segments")


class VideoConfig(PolicyConfig):
    """Video limits and frame sampling."""

    max_duration_s: Annotated[float, Field(gt=0)] = Field(
        default=120.0, description="longer video is trimmed or refused (over_limit)"
    )
    over_limit: Literal["trim", "refuse"] = Field(
        default="trim", description="trim or refuse video over max_duration_s"
    )
    fps: Annotated[float, Field(gt=0, le=30)] = Field(default=2.0, description="frames sampled per second")
    max_frames: Annotated[int, Field(ge=1, le=2048)] = Field(
        default=240, description="frames the engine gets, at most"
    )
    max_decoded_frames: Annotated[int, Field(ge=1)] = Field(
        default=7200, description="frames decoded at most per part, whatever the container's timestamps say"
    )
    min_frame_pixels: Annotated[int, Field(ge=_TOKEN_TILE)] = Field(
        default=128 * _TOKEN_TILE, description="a sampled frame keeps at least this area (128 tiles of 28x28)"
    )
    max_frame_pixels: Annotated[int, Field(ge=_TOKEN_TILE)] = Field(
        default=768 * _TOKEN_TILE, description="and at most this (768 tiles)"
    )
    max_input_pixels: Annotated[int, Field(ge=_TOKEN_TILE)] = Field(
        default=4096 * 2304, description="video frames over this size are refused from the header"
    )
    frame_quality: Annotated[int, Field(ge=50, le=100)] = Field(
        default=85, description="JPEG quality of frames sent as image parts"
    )
    crf: Annotated[int, Field(ge=0, le=51)] = Field(default=23, description="H.264 CRF of re-encoded video")
