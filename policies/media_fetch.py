"""Built-in pre-policy ``media-fetch``: every media URL becomes data, fetched the safe way.

After it, no ``http(s)`` URL is left in the request: the engine never fetches a
client's URL itself, and the media policies after it work on bytes. Data URIs
and ``input_audio`` base64 are checked here too, so a malformed one is a 400
naming its part before anything else runs.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from core.context import MediaRecord, RequestContext
from core.errors import OmnigateError
from core.schemas import ChatCompletionRequest
from policies.base import Deps, PolicyBase, PolicyConfig
from policies.media.fetch import FetchConfig, SafeFetcher
from policies.media.parts import (
    _MEDIATYPE,
    MediaRef,
    data_uri,
    make_part,
    media_parts,
    payload_size,
    replace_parts,
)
from policies.media.sandbox import MediaRuntime, runtime_of
from policies.media.targets import check_modalities, targets_from
from policies.settings import MediaSettings


class MediaFetch(PolicyBase):
    name: ClassVar[str] = "media-fetch"
    stage: ClassVar[str] = "pre"
    #: skipped (not run, not recorded) for requests without media parts
    media_only: ClassVar[bool] = True
    Config: ClassVar[type[PolicyConfig]] = FetchConfig

    def __init__(self, config: FetchConfig) -> None:
        self.config = config
        self.fetcher = SafeFetcher(config)
        self._runtime: MediaRuntime | None = None
        self._targets: dict[str, Any] = {}

    async def start(self, deps: Deps) -> None:
        self.fetcher = SafeFetcher(self.config, deps.metrics)
        await self.fetcher.start()  # its session is this instance's: closed in aclose, with the chain
        self._runtime = runtime_of(deps)
        self._targets = targets_from(deps.engines)

    async def aclose(self) -> None:
        await self.fetcher.aclose()

    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        refs = list(media_parts(request))
        if not refs:
            return request
        # Nothing is fetched for a request no engine of the model could take.
        check_modalities(request, self._targets.get(request.model))
        if ctx.media_budget is None:
            runtime = self._runtime or MediaRuntime(MediaSettings())
            ctx.media_budget = runtime.request_budget()
        budget = ctx.media_budget
        new: dict[tuple[int, int], list[Any]] = {}
        remote = [r for r in refs if r.is_remote]
        for ref in refs:
            if not ref.is_remote:
                # Checked and counted where it lies; media-limits decodes it, once.
                size = payload_size(ref)
                await budget.take(size, ref.param)
                ctx.outputs.media.append(MediaRecord(part=ref.path, kind=ref.kind, source="data", bytes=size))
        if remote:
            try:
                async with asyncio.TaskGroup() as tg:
                    tasks = [
                        (
                            ref,
                            tg.create_task(self.fetcher.fetch(ref.url, ref.kind, ref.param, budget)),
                        )
                        for ref in remote
                    ]
            except* OmnigateError as group:
                raise group.exceptions[0] from None
            for ref, task in tasks:
                got = task.result()
                mediatype = (got.content_type or "").split(";")[0].strip().lower()
                if not _MEDIATYPE.match(mediatype):
                    mediatype = "application/octet-stream"
                new[(ref.message, ref.index)] = [make_part(ref.type, data_uri(mediatype, got.data))]
                ctx.outputs.media.append(
                    MediaRecord(
                        part=ref.path, kind=ref.kind, source="url", host=got.host, bytes=len(got.data)
                    )
                )
        ctx.outputs.media.sort(key=lambda r: _order(r.part))
        return replace_parts(request, new)


def _order(path: str) -> tuple[int, int]:
    _, m, _, p = path.split(".")
    return int(m), int(p)


__all__ = ["MediaFetch", "MediaRef"]
