"""The one error tree of omnigate.

Every error a client can see is an :class:`OmnigateError`; each class carries its
HTTP status, OpenAI error ``type`` and ``code``. Foreign exceptions are translated
once, at the boundary that meets them (engine adapters, the media fetcher), with
``raise ... from exc`` so the cause stays in the log.

    OmnigateError                       500 internal_error         internal_error
    ├── InvalidRequest                  400 invalid_request_error  -
    │   ├── PayloadTooLarge             413 invalid_request_error  payload_too_large
    │   │   └── MediaTooLarge           413 invalid_request_error  media_too_large
    │   ├── RequestTimeout              408 invalid_request_error  request_timeout
    │   ├── ContentPolicyViolation      400 invalid_request_error  content_policy_violation
    │   ├── ModelNotFound               404 invalid_request_error  model_not_found
    │   ├── NotFound                    404 invalid_request_error  not_found
    │   ├── Conflict                    409 invalid_request_error  conflict
    │   ├── ConfigInvalid               422 invalid_request_error  invalid_config
    │   ├── InvalidMedia                400 invalid_request_error  invalid_media
    │   │   └── DecoderFailed           400 invalid_request_error  invalid_media  [policies.media.decode_pool]
    │   ├── MediaURLForbidden           400 invalid_request_error  media_url_forbidden
    │   ├── MediaFetchFailed            400 invalid_request_error  media_fetch_failed
    │   ├── ModalBudgetExceeded         400 invalid_request_error  modal_budget_exceeded
    │   ├── UnknownField                400 invalid_request_error  unknown_field
    │   ├── ContextLengthExceeded       400 invalid_request_error  context_length_exceeded
    │   └── ThinkingBudgetUnsupported   400 invalid_request_error  thinking_budget_unsupported  [engines.selection.thinking]
    ├── AuthenticationFailed            401 authentication_error   invalid_api_key
    │   └── KeyRefused                  401 authentication_error   invalid_api_key  [gateway.tenants]
    ├── PermissionDenied                403 permission_error       permission_denied
    ├── RateLimited                     429 rate_limit_error       rate_limit_exceeded
    │   └── TooManyAuthFailures         429 rate_limit_error       too_many_authentication_failures  [gateway.auth_failures]
    ├── ClientClosedRequest             499 invalid_request_error  client_closed_request
    │   ├── ClientStalled               499 invalid_request_error  client_stalled
    │   └── ClientGone                  499 invalid_request_error  client_closed_request  [gateway.realtime.events]
    ├── Overloaded                      503 overloaded_error       overloaded
    │   ├── EngineBusy                  503 overloaded_error       engine_busy
    │   └── AuditUnavailable            503 overloaded_error       audit_unavailable
    ├── GuardUnavailable                503 api_error              guard_unavailable
    ├── DirectoryUnavailable            503 api_error              directory_unavailable
    ├── AnswerWithheld                  422 invalid_response_error answer_withheld
    │   └── GroundingFailed             422 invalid_response_error grounding_failed
    ├── EngineError                     502 api_error              engine_error
    │   ├── EngineFailed                502 api_error              engine_error
    │   ├── EngineUnavailable           503 api_error              engine_unavailable
    │   ├── EngineTimeout               504 api_error              engine_timeout
    │   ├── EngineRejected              502 api_error              engine_error
    │   └── EngineProtocolError         502 api_error              engine_protocol_error
    └── AdminDisabled                   404 invalid_request_error  not_found  [gateway.api.admin]

Each line: the HTTP status, the OpenAI error ``type`` and ``code`` (``-``: none; the renderer
leaves it null), and, in brackets, the module of a class defined outside this one. The tree is
checked against the classes by ``tests/unit/test_error_tree.py``. What the columns cannot say:

- ``PayloadTooLarge``, ``RequestTimeout``: the body was too large, or did not arrive in time.
- ``NotFound``, ``Conflict``: admin resources; ``ConfigInvalid``: a reload that was refused.
- ``InvalidMedia``: undecodable, a malformed data URI, over a limit; ``MediaURLForbidden``: a
  scheme or address the fetcher refuses; ``MediaFetchFailed``: unreachable, timeout, HTTP error.
- ``UnknownField``: a request field the gateway does not forward.
- ``RateLimited``, ``Overloaded``, ``EngineBusy`` (every engine for the model is full),
  ``AuditUnavailable`` (the record cannot be made durable) and ``DirectoryUnavailable`` (a
  directory key, the directory unread too long) send ``Retry-After``.
- ``ClientClosedRequest``: the client left before its request was read (499, nginx's convention);
  ``ClientStalled``: it stopped reading the answer for ``server.stream_write_timeout_s``. Nobody
  reads either; they are what the audit record and the access log say of the request.
- ``GuardUnavailable``: a policy's model failed; the gateway fails closed.
- ``AnswerWithheld``: a post-policy kept every attempt back.
- ``EngineFailed`` (the engine's 5xx), ``EngineUnavailable``, ``EngineTimeout`` and
  ``EngineProtocolError`` (an answer the gateway cannot read: a choice or tool-call index out of
  range, an empty stream) are retryable before the first byte. ``EngineRejected`` takes the
  engine's 4xx (but 429) as its status, with type ``invalid_request_error`` and code
  ``engine_rejected_request``; anything else is 502.

``retryable`` says whether another engine may be tried; that is only allowed while
nothing has been sent to the client, which the pipeline enforces.
"""

from __future__ import annotations

from typing import Any


class OmnigateError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = "internal_error"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.retry_after = retry_after

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    #: the Retry-After of an error that says nothing of its own (None: no header)
    default_retry_after: float | None = None

    def headers(self) -> dict[str, str]:
        after = self.retry_after if self.retry_after is not None else self.default_retry_after
        if after is None:
            return {}
        return {"Retry-After": str(max(1, round(after)))}


class InvalidRequest(OmnigateError):
    status = 400
    type = "invalid_request_error"
    code: str | None = None


class PayloadTooLarge(InvalidRequest):
    status = 413
    code = "payload_too_large"


class RequestTimeout(InvalidRequest):
    status = 408
    code = "request_timeout"


class ContentPolicyViolation(InvalidRequest):
    code = "content_policy_violation"


class ModelNotFound(InvalidRequest):
    status = 404
    code = "model_not_found"


class NotFound(InvalidRequest):
    status = 404
    code = "not_found"


class Conflict(InvalidRequest):
    status = 409
    code = "conflict"


class ConfigInvalid(InvalidRequest):
    status = 422
    code = "invalid_config"


class MediaTooLarge(PayloadTooLarge):
    code = "media_too_large"


class InvalidMedia(InvalidRequest):
    """A media part that cannot be decoded, is malformed, or breaks a configured limit."""

    code = "invalid_media"


class MediaURLForbidden(InvalidRequest):
    """A media URL whose scheme or address the fetcher never contacts (SSRF guard)."""

    code = "media_url_forbidden"


class MediaFetchFailed(InvalidRequest):
    """A media URL that could not be fetched: the client's URL is at fault, not the gateway."""

    code = "media_fetch_failed"


class ModalBudgetExceeded(InvalidRequest):
    code = "modal_budget_exceeded"


class UnknownField(InvalidRequest):
    """A request field the gateway does not know (``param`` names where it was); see gateway/fields.py."""

    code = "unknown_field"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationFailed(OmnigateError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(OmnigateError):
    status = 403
    type = "permission_error"
    code = "permission_denied"


class RateLimited(OmnigateError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class ClientClosedRequest(OmnigateError):
    """The client closed its connection before its request was read: nobody is left to answer."""

    status = 499
    type = "invalid_request_error"
    code = "client_closed_request"


class ClientStalled(ClientClosedRequest):
    """The client stopped reading its answer: no write made progress within the write deadline, so the
    response was cut and the engine request aborted."""

    code = "client_stalled"


class Overloaded(OmnigateError):
    status = 503
    type = "overloaded_error"
    code = "overloaded"


class EngineBusy(Overloaded):
    """Every engine that could serve the request is at its concurrency limit and its wait queue is full
    or the wait ran out. Nothing was sent to an engine."""

    code = "engine_busy"


class AuditUnavailable(Overloaded):
    """The audit store did not take the request's record in time and ``audit.on_unavailable`` is ``refuse``
    (or the local spool failed too): the response is not acknowledged without a durable record."""

    code = "audit_unavailable"


class GuardUnavailable(OmnigateError):
    """A policy could not judge the answer (its model failed): the answer is not served unjudged."""

    status = 503
    type = "api_error"
    code = "guard_unavailable"


class DirectoryUnavailable(OmnigateError):
    """The key is the directory's, and the directory has not been read for too long: fail closed."""

    status = 503
    type = "api_error"
    code = "directory_unavailable"


class AnswerWithheld(OmnigateError):
    """No attempt's answer could be served: a post-policy held each one back and no retry is left."""

    status = 422
    type = "invalid_response_error"
    code = "answer_withheld"


class GroundingFailed(AnswerWithheld):
    """The answer is not supported by the request's premise (policy ``grounding``)."""

    code = "grounding_failed"


class EngineError(OmnigateError):
    """An engine failed. ``kind`` is a bounded label for metrics.

    The first argument is the ``detail`` (the engine's name, its status and its own
    words): it goes to the log and never to a client. Clients see ``public``, the
    class's own message or one the adapter mapped the engine's answer to, so no
    upstream text or engine name can reach them whatever an adapter passes.
    """

    status = 502
    type = "api_error"
    code = "engine_error"
    kind = "error"
    public = "the model failed to answer; retry the request"

    def __init__(
        self, detail: str, *, engine: str | None = None, public: str | None = None, **kw: Any
    ) -> None:
        super().__init__(public or self.public, **kw)
        self.detail = detail
        self.engine = engine


class EngineFailed(EngineError):
    """The engine answered with a server error (500, 502, 504 ...)."""

    kind = "upstream_5xx"
    retryable = True
    public = "the model failed to answer; retry the request"


class EngineUnavailable(EngineError):
    status = 503
    code = "engine_unavailable"
    kind = "unavailable"
    retryable = True
    # an engine down now is probed again within seconds; the SDKs honour the header when they retry
    default_retry_after = 1.0
    public = "the model is unavailable at the moment; retry the request"


class EngineTimeout(EngineError):
    status = 504
    code = "engine_timeout"
    kind = "timeout"
    retryable = True
    public = "the model did not answer in time; retry the request"


class EngineRejected(EngineError):
    """The engine refused the request itself (its 4xx); another engine would too."""

    kind = "rejected"
    public = "the model refused the request as invalid"

    def __init__(self, detail: str, *, upstream_status: int, code: str | None = None, **kw: Any) -> None:
        super().__init__(detail, **kw)
        self.status = upstream_status if 400 <= upstream_status < 500 and upstream_status != 429 else 502
        if self.status < 500:
            self.type = "invalid_request_error"
            self.code = code or "engine_rejected_request"


class EngineProtocolError(EngineError):
    """The engine's answer cannot be read; another engine's may be, so it fails over like a 5xx."""

    code = "engine_protocol_error"
    kind = "protocol"
    retryable = True
    public = "the model sent an answer the gateway could not read"
