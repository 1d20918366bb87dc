"""The OpenAPI operations of ``POST /v1/audio/transcriptions`` and ``POST /v1/audio/speech``, built once
when the app is made (the routes read their bodies by hand, so their schemas are declared here).

Nothing here runs while a request is served; the app's OpenAPI document reads these names (``app.openapi``).
"""

from __future__ import annotations

from typing import Any

from core.schemas import SpeechRequest, TranscriptionRequest

_REF = "#/components/schemas/{model}"
_SPEECH = SpeechRequest.model_json_schema(ref_template=_REF)
_FORM = TranscriptionRequest.model_json_schema(ref_template=_REF)
_FORM["properties"] = {"file": {"type": "string", "format": "binary"}, **_FORM["properties"]}
_FORM["required"] = ["file", *_FORM.get("required", [])]
_FORM["title"] = "TranscriptionForm"
OPENAPI_COMPONENTS: dict[str, Any] = {
    **_SPEECH.pop("$defs", {}),
    **_FORM.pop("$defs", {}),
    "SpeechRequest": _SPEECH,
    "TranscriptionForm": _FORM,
}
_ERROR = {
    "description": 'An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`',
    "content": {"application/json": {"schema": {}}},
}


def _operation(summary: str, op_id: str, body: dict[str, Any], ok: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "operationId": op_id,
            "requestBody": {"required": True, "content": body},
            "responses": {"200": ok, "4XX": _ERROR, "5XX": _ERROR},
        }
    }


OPENAPI_PATHS: dict[str, Any] = {
    "/v1/audio/transcriptions": _operation(
        "Transcriptions",
        "audio_transcriptions_v1_audio_transcriptions_post",
        {"multipart/form-data": {"schema": {"$ref": "#/components/schemas/TranscriptionForm"}}},
        {
            "description": (
                "The transcript: JSON (`json`, `verbose_json` with segments and words where a speech-to-text "
                "engine gave them) or plain text (`text`, and subtitles `srt` and `vtt`, which only a "
                "speech-to-text engine's segments make: another model's transcript in them is a 400)"
            ),
            "content": {"application/json": {"schema": {}}, "text/plain": {"schema": {"type": "string"}}},
        },
    ),
    "/v1/audio/speech": _operation(
        "Speech",
        "audio_speech_v1_audio_speech_post",
        {"application/json": {"schema": {"$ref": "#/components/schemas/SpeechRequest"}}},
        {
            "description": "The audio file in the format asked for",
            "content": {
                media: {"schema": {"type": "string", "format": "binary"}}
                for media in ("audio/mpeg", "audio/ogg", "audio/aac", "audio/flac", "audio/wav", "audio/pcm")
            },
        },
    ),
}
