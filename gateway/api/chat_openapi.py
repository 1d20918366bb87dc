"""The OpenAPI operation of ``POST /v1/chat/completions``, built once when the app is made.

Split from :mod:`gateway.api.chat`, which re-exports these names: the app's OpenAPI document reads them
(``app.openapi``); nothing here runs while a request is served.
"""

from __future__ import annotations

from typing import Any

from core.schemas import ChatCompletionRequest

# The body is parsed by hand, so its schema is declared here; the nested models go to
# the document's components (see ``app.openapi``).
_BODY_SCHEMA = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
OPENAPI_COMPONENTS: dict[str, Any] = _BODY_SCHEMA.pop("$defs", {})
OPENAPI_COMPONENTS["ChatCompletionRequest"] = _BODY_SCHEMA
OPENAPI_PATHS: dict[str, Any] = {
    "/v1/chat/completions": {
        "post": {
            "summary": "Chat Completions",
            "operationId": "chat_completions_v1_chat_completions_post",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}
                },
            },
            "responses": {
                "200": {
                    "description": "A chat completion; with `stream: true`, its chunks as server-sent events",
                    "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": {}}},
                },
                "4XX": {
                    "description": 'An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`',
                    "content": {"application/json": {"schema": {}}},
                },
            },
        }
    }
}
