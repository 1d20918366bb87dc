"""Small real policy plugins used to exercise the pipeline's stages, order, shadow mode and retries."""

from __future__ import annotations

from typing import ClassVar

import httpx

from core.context import SegmentPlan
from core.errors import ContentPolicyViolation, GuardUnavailable
from core.events import Delta
from core.schemas import TextPart
from policies.base import Accept, Deps, PolicyBase, PolicyConfig, Retry, Segmented

#: What the lifecycle-recording plugins did, in order: ``(event, tag)`` with event ``start``, ``feed``,
#: ``finish`` or ``aclose``; a test clears it before it starts its gateway.
LIFECYCLE: list[tuple[str, str]] = []


class TagConfig(PolicyConfig):
    tag: str


class AppendTag(PolicyBase):
    """Pre: appends ``[tag]`` to the last message's text, so the order of the chain is visible upstream."""

    name: ClassVar[str] = "append-tag"
    stage: ClassVar[str] = "pre"
    Config = TagConfig

    def __init__(self, config: TagConfig) -> None:
        self.tag = config.tag

    async def pre(self, request, ctx):
        messages = list(request.messages)
        last = messages[-1]
        messages[-1] = last.model_copy(update={"content": last.text() + f"[{self.tag}]"})
        return request.model_copy(update={"messages": messages})


class Empty(PolicyConfig):
    pass


class AlwaysReject(PolicyBase):
    name: ClassVar[str] = "always-reject"
    stage: ClassVar[str] = "pre"
    Config = Empty

    def __init__(self, config: Empty) -> None:
        pass

    async def pre(self, request, ctx):
        raise ContentPolicyViolation("refused by always-reject", param="messages")


class RetryUnlessCold(PolicyBase):
    """Post: asks for one retry at temperature 0 (stateless: it reads the request)."""

    name: ClassVar[str] = "retry-unless-cold"
    stage: ClassVar[str] = "post"
    Config = Empty

    def __init__(self, config: Empty) -> None:
        pass

    async def post(self, request, completion, ctx):
        if request.temperature == 0.0:
            return Accept()
        return Retry(reason="too-warm", update={"temperature": 0.0})


class HoldConfig(PolicyConfig):
    pass


class _HoldFilter:
    def __init__(self) -> None:
        self.held: list[Delta] = []

    def feed(self, delta: Delta) -> list[Delta]:
        self.held.append(delta)
        return []

    def finish(self) -> list[Delta]:
        out, self.held = self.held, []
        return out


class HoldAll(PolicyBase):
    name: ClassVar[str] = "hold-all"
    stage: ClassVar[str] = "stream"
    Config = HoldConfig
    mode = "hold"

    def __init__(self, config: HoldConfig) -> None:
        pass

    def open_stream(self, request, ctx):
        return _HoldFilter()


class _Upper:
    def feed(self, delta: Delta) -> list[Delta]:
        if delta.text:
            delta = Delta(text=delta.text.upper(), finish_reason=delta.finish_reason, usage=delta.usage)
        return [delta]

    def finish(self) -> list[Delta]:
        return []


class Uppercase(PolicyBase):
    name: ClassVar[str] = "uppercase"
    stage: ClassVar[str] = "stream"
    Config = Empty
    mode = "passthrough"

    def __init__(self, config: Empty) -> None:
        pass

    def open_stream(self, request, ctx):
        return _Upper()


class NoHook(PolicyBase):
    name: ClassVar[str] = "no-hook"
    stage: ClassVar[str] = "pre"
    Config = Empty

    def __init__(self, config: Empty) -> None:
        pass


class _Recording:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def feed(self, delta: Delta) -> list[Delta]:
        LIFECYCLE.append(("feed", self.tag))
        return [delta]

    def finish(self) -> list[Delta]:
        LIFECYCLE.append(("finish", self.tag))
        return [Delta(text=f"[{self.tag}]")]


class Recorder(PolicyBase):
    """Stream: records its start, each delta it passes, its stream's end and its close; ends each stream
    with ``[tag]``, so a client sees which chain served it."""

    name: ClassVar[str] = "recorder"
    stage: ClassVar[str] = "stream"
    Config = TagConfig
    mode = "passthrough"

    def __init__(self, config: TagConfig) -> None:
        self.tag = config.tag

    async def start(self, deps: Deps) -> None:
        LIFECYCLE.append(("start", self.tag))

    async def aclose(self) -> None:
        LIFECYCLE.append(("aclose", self.tag))

    def open_stream(self, request, ctx):
        return _Recording(self.tag)


class FailStart(PolicyBase):
    """Post: a policy whose start fails (a model file that cannot be read), so the chain cannot open."""

    name: ClassVar[str] = "fail-start"
    stage: ClassVar[str] = "post"
    Config = Empty

    def __init__(self, config: Empty) -> None:
        pass

    async def start(self, deps: Deps) -> None:
        raise RuntimeError("the model file cannot be read")

    async def post(self, request, completion, ctx):
        return Accept()


class SplitText(PolicyBase):
    """Pre: cuts a last message of text parts at ``|`` into consecutive engine calls (a segment plan
    returned with the request, as media-limits does for long audio), to exercise plans of any plugin."""

    name: ClassVar[str] = "split-text"
    stage: ClassVar[str] = "pre"
    Config = Empty

    def __init__(self, config: Empty) -> None:
        pass

    async def pre(self, request, ctx):
        last = request.messages[-1]
        pieces = last.text().split("|")
        if len(pieces) < 2 or not isinstance(last.content, list):
            return request
        parts = [TextPart(type="text", text=p) for p in pieces]
        rewritten = request.model_copy(
            update={"messages": [*request.messages[:-1], last.model_copy(update={"content": [parts[0]]})]}
        )
        boundaries = [(float(i), float(i + 1)) for i in range(len(parts))]
        return Segmented(
            rewritten,
            SegmentPlan(f"messages.{len(request.messages) - 1}.content.0", boundaries, parts[0], parts, " "),
        )


class ServedGuardConfig(PolicyConfig):
    url: str  # the guard model's endpoint (a classifier served over HTTP)
    threshold: float = 0.5


class ServedGuard(PolicyBase):
    """Pre: the prompt's text judged by a classifier served over HTTP (``POST url`` with ``{"input": text}``,
    answering ``{"score": p}``), as a production guard model is deployed. Its receipt names the text it
    screened; an endpoint that does not answer is a guard that cannot judge (``GuardUnavailable``)."""

    name: ClassVar[str] = "served-guard"
    stage: ClassVar[str] = "pre"
    Config = ServedGuardConfig

    def __init__(self, config: ServedGuardConfig) -> None:
        self.config = config

    async def pre(self, request, ctx):
        scan = ctx.outputs.scan(self.name)
        scan.model, scan.threshold = self.config.url, self.config.threshold
        texts = [(i, m.text()) for i, m in enumerate(request.messages) if m.text()]
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                r = await client.post(self.config.url, json={"input": "\n".join(t for _, t in texts)})
                r.raise_for_status()
                score = float(r.json()["score"])
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise GuardUnavailable(f"the {self.name} model is unavailable") from exc
        scan.messages = [i for i, _ in texts]
        scan.chars = sum(len(t) for _, t in texts)
        if score >= self.config.threshold:
            raise ContentPolicyViolation("the prompt was refused by the served guard")
        return request


async def _served_score(url: str, text: str) -> float:
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            r = await client.post(url, json={"input": text})
            r.raise_for_status()
            return float(r.json()["score"])
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise GuardUnavailable("the served check's model is unavailable") from exc


class _ServedHold:
    """Holds the whole answer, then asks the served model about it (``finish``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.held: list[Delta] = []

    async def feed(self, delta):
        self.held.append(delta)
        return []

    async def finish(self):
        score = await _served_score(self.url, "".join(d.text for d in self.held))
        return Accept(score=score)

    def release(self):
        out, self.held = self.held, []
        return out


class ServedCheck(PolicyBase):
    """Post: the answer judged by a classifier served over HTTP (streamed: held back whole, then judged);
    its model unreachable is a guard that cannot judge."""

    name: ClassVar[str] = "served-check"
    stage: ClassVar[str] = "post"
    Config = ServedGuardConfig

    def __init__(self, config: ServedGuardConfig) -> None:
        self.config = config

    def stream_mode(self, request, ctx):
        return "hold"

    def open_check(self, request, ctx):
        return _ServedHold(self.config.url)

    async def post(self, request, completion, ctx):
        return Accept(score=await _served_score(self.config.url, completion.text))


PLUGINS = {
    cls.name: cls
    for cls in (
        AppendTag,
        AlwaysReject,
        RetryUnlessCold,
        HoldAll,
        Uppercase,
        NoHook,
        Recorder,
        FailStart,
        SplitText,
        ServedGuard,
        ServedCheck,
    )
}
