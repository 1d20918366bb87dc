"""The embedded default engine: a small GGUF chat model run by transformers on the CPU.

It needs no server and no network, so a bare install can answer requests. The
first start converts the GGUF once and caches the result as safetensors.

Its length: model conversion, the cached load and the generation thread belong to one engine and are
kept together until the engine facts move onto the adapter's capabilities.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import hashlib
import importlib.util
import inspect
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from core.errors import EngineError, EngineUnavailable, InvalidRequest, OmnigateError
from core.events import Completion, Delta, Usage
from engines.adapters.base import declared

if TYPE_CHECKING:
    from core.schemas import ChatCompletionRequest
    from engines.adapters.settings import EngineConfig

log = structlog.get_logger(__name__)

_ROLE_MAP = {"developer": "system"}
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Enough of the file to cover the GGUF header and tokenizer metadata, cheap to read on every start.
_KEY_HEAD_BYTES = 4 * 1024 * 1024
_CACHE_FORMAT = "1"


def _import_hf() -> tuple[Any, Any]:
    # torch and transformers are the optional "local" extra; importing them lazily keeps
    # a gateway without it bootable, and turns their absence into EngineUnavailable.
    import torch
    import transformers

    return torch, transformers


@dataclass(slots=True, eq=False)
class _Job:
    """What one generation needs and what it reports back, shared by the loop and the worker."""

    request: ChatCompletionRequest
    loop: asyncio.AbstractEventLoop
    streamer: Any  # the _streamer_class() built for this request, in the event loop
    #: resolved (to None) once the worker has finished, whatever its outcome
    done: asyncio.Future[None]
    cancel: threading.Event = field(default_factory=threading.Event)
    #: set by the worker before ``done``: the final accounting, or what it raised
    outcome: _Finish | BaseException | None = None


class _Finish:
    """The final accounting of one generation."""

    __slots__ = ("completion_tokens", "finish_reason", "prompt_tokens")

    def __init__(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.finish_reason = finish_reason
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens


class _StopStrings:
    """Stop strings, matched on text because they may span tokens.

    Text that might be the start of a stop string is held back until it is known not to be.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._held = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """The part of ``text`` (after what was held) that can be released now."""
        if not self._stops or not text:
            return text
        held = self._held + text
        cut = min((i for s in self._stops if (i := held.find(s)) != -1), default=-1)
        if cut != -1:
            self.hit = True
            self._held = ""
            return held[:cut]
        keep = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(held)), keep, -1):
                if held.endswith(s[:k]):
                    keep = k
                    break
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


@functools.cache
def _streamer_class() -> type[Any]:
    """transformers' ``AsyncTextIteratorStreamer`` with the token count and the stop strings of one request.

    The library decodes the tokens (holding back an unfinished word or character) and hands the text to
    the event loop's queue. Stop strings are matched here, in the generation thread, so the stopping
    criterion ends generation at the step that completed one. Built on first use: transformers is the
    optional "local" extra, imported lazily.
    """
    from transformers import AsyncTextIteratorStreamer

    class TokenStreamer(AsyncTextIteratorStreamer):
        def __init__(self, tokenizer: Any, stops: list[str]) -> None:
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.stops = _StopStrings(stops)
            self.completion_tokens = 0
            self.last_token: int | None = None
            self.first_token_at: float | None = None
            self.ended = False
            self._discard = False

        def put(self, value: Any) -> None:
            if self.next_tokens_are_prompt:  # generate() hands over the prompt first
                super().put(value)  # type: ignore[no-untyped-call]  # transformers leaves put() unannotated
                return
            if self.stops.hit:  # the step already under way when a stop string completed
                return
            ids = value.reshape(-1).tolist()
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.completion_tokens += len(ids)
            if ids:
                self.last_token = ids[-1]
            super().put(value)  # type: ignore[no-untyped-call]  # transformers leaves put() unannotated

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if self._discard or self.stops.hit:
                text = ""
            else:
                text = self.stops.feed(text)
                if stream_end and not self.stops.hit:
                    text += self.stops.flush()
            if stream_end:
                self.ended = True
            if text or stream_end:
                super().on_finalized_text(text, stream_end)

        def abandon(self) -> None:
            """End the stream without what it still holds (generation failed)."""
            if not self.ended:
                self._discard = True
                self.end()  # type: ignore[no-untyped-call]  # transformers leaves end() unannotated

    return TokenStreamer


class _StopOnRequest:
    """A stopping criterion: the consumer went away, or a stop string completed."""

    def __init__(self, job: _Job, torch: Any) -> None:
        self._job = job
        self._torch = torch

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        stop = self._job.cancel.is_set() or self._job.streamer.stops.hit
        return self._torch.full((input_ids.shape[0],), stop, dtype=self._torch.bool, device=input_ids.device)


class _SeededSampler:
    """Samples the next token with a private generator, so a seed is reproducible even when
    generations run concurrently, and the process-wide RNG is left alone.

    Greedy decoding then picks the one token this leaves finite.
    """

    def __init__(self, torch: Any, seed: int | None) -> None:
        self._torch = torch
        self._gen = torch.Generator(device="cpu")
        if seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(seed)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        torch = self._torch
        probs = torch.softmax(scores.float(), dim=-1)
        chosen = torch.multinomial(probs, num_samples=1, generator=self._gen)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, chosen, 0.0)


class LocalEngine:
    """Runs a GGUF chat model in-process (kind ``local``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.name = config.name
        self.config = config
        self.capabilities = declared(config)
        self._opts = config.local
        self._model: Any = None
        self._tokenizer: Any = None
        self._torch: Any = None
        self._template_params: frozenset[str] = frozenset()
        self._eos_ids: set[int] = set()
        self._context_len = 0
        self._slots = asyncio.Semaphore(self._opts.max_concurrency)
        self._active: set[_Job] = set()
        self._closed = False

    # -- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        if self._model is not None:
            return
        self._closed = False
        started = time.perf_counter()
        try:
            model, tokenizer, source = await asyncio.to_thread(self._load)
        except EngineUnavailable as exc:
            log.error("local_engine_load_failed", engine=self.name, error=exc.detail)
            raise
        except Exception as exc:
            log.error("local_engine_load_failed", engine=self.name, error=str(exc))
            raise EngineUnavailable(
                f"local engine {self.name!r} could not load its model: {type(exc).__name__}: {exc}",
                engine=self.name,
            ) from exc
        if self._closed:  # aclose() ran while the model was loading
            return
        self._model, self._tokenizer = model, tokenizer
        log.info(
            "local_engine_ready",
            engine=self.name,
            source=source,
            seconds=round(time.perf_counter() - started, 3),
            threads=self._opts.threads,
            dtype=str(model.dtype),
        )

    async def health(self) -> bool:
        return self._model is not None and not self._closed

    async def aclose(self) -> None:
        self._closed = True
        for job in list(self._active):
            job.cancel.set()
        pending = [job.done for job in self._active if not job.done.done()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        self._model = self._tokenizer = None

    # -- loading (worker thread) -----------------------------------------
    def _gguf_path(self) -> Path:
        if self._opts.gguf_file:
            path = Path(self._opts.gguf_file).expanduser()
            if not path.is_file():
                raise EngineUnavailable(f"GGUF file not found: {path}", engine=self.name)
            return path.resolve()
        spec = importlib.util.find_spec(self._opts.gguf_package)
        if spec is None or not spec.submodule_search_locations:
            raise EngineUnavailable(
                f"package {self._opts.gguf_package!r} that ships the GGUF is not installed; "
                "install it or set local.gguf_file",
                engine=self.name,
            )
        found = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("*.gguf"))
        named = [p for p in found if p.name.startswith(self.config.model)]
        picks = named or found
        if len(picks) != 1:
            what = "no GGUF file" if not picks else f"several GGUF files ({', '.join(p.name for p in picks)})"
            raise EngineUnavailable(
                f"package {self._opts.gguf_package!r} has {what}; set local.gguf_file", engine=self.name
            )
        return picks[0].resolve()

    def _cache_path(self, gguf: Path, transformers_version: str) -> Path:
        st = gguf.stat()
        h = hashlib.sha256(
            f"{_CACHE_FORMAT}|{gguf.name}|{st.st_size}|{st.st_mtime_ns}|{transformers_version}|".encode()
        )
        with gguf.open("rb") as f:
            h.update(f.read(_KEY_HEAD_BYTES))
        # Path.resolve() makes a relative cache_dir relative to the working directory
        return self._opts.cache_dir.expanduser().resolve() / f"{gguf.stem}-{h.hexdigest()[:16]}"

    def _load(self) -> tuple[Any, Any, str]:
        try:
            torch, transformers = _import_hf()
        except ImportError as exc:
            raise EngineUnavailable(
                f"the local engine needs torch and transformers (pip install 'omnigate[local]'): {exc}",
                engine=self.name,
            ) from exc
        torch.set_num_threads(self._opts.threads)  # process-wide: torch has one intra-op pool
        self._torch = torch
        variant = self.config.variant
        if variant not in _DTYPES:
            log.warning("local_variant_unsupported", engine=self.name, variant=variant, using="fp32")
        dtype = getattr(torch, _DTYPES.get(variant, "float32"))

        gguf = self._gguf_path()
        cache = self._cache_path(gguf, transformers.__version__)
        Auto, Tok = transformers.AutoModelForCausalLM, transformers.AutoTokenizer
        model = tokenizer = None
        source = "cache"
        if (cache / "config.json").is_file():
            try:
                model = Auto.from_pretrained(cache, dtype=dtype, local_files_only=True)
                tokenizer = Tok.from_pretrained(cache, local_files_only=True)
            except Exception as exc:  # a damaged cache is rebuilt, not fatal
                log.warning("local_model_cache_unreadable", engine=self.name, path=str(cache), error=str(exc))
                shutil.rmtree(cache, ignore_errors=True)
                model = tokenizer = None
        if model is None:
            source = "gguf"
            log.info("local_model_converting", engine=self.name, gguf=str(gguf))
            # dequantize=True gives a plain dense model, which (unlike a GGUF-quantized one)
            # save_pretrained accepts; without matmul kernels the weights are dequantized anyway.
            model = Auto.from_pretrained(
                gguf.parent,
                gguf_file=gguf.name,
                quantization_config=transformers.GgufConfig(dequantize=True),
                dtype=torch.float32,
                local_files_only=True,
            )
            tokenizer = Tok.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            self._save_cache(model, tokenizer, cache)
            if dtype != torch.float32:
                model = model.to(dtype)
        assert model is not None and tokenizer is not None  # from the cache or the conversion, both
        if self._opts.tokenizer:
            tokenizer = Tok.from_pretrained(self._opts.tokenizer, local_files_only=True)
        if not getattr(tokenizer, "chat_template", None):
            raise EngineUnavailable(f"the tokenizer of {gguf.name} has no chat template", engine=self.name)
        model.eval()

        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        self._eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self._context_len = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        self._template_params = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters)
        return model, tokenizer, source

    def _save_cache(self, model: Any, tokenizer: Any, cache: Path) -> None:
        started = time.perf_counter()
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
            try:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                # rename is atomic, so a reader sees a whole cache or none; a concurrent
                # writer that got there first wins and this copy is dropped
                os.rename(tmp, cache)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:  # e.g. a read-only disk: serve from memory, convert again next start
            if not (cache / "config.json").is_file():
                log.warning("local_model_cache_not_saved", engine=self.name, path=str(cache), error=str(exc))
            return
        log.info(
            "local_model_cached",
            engine=self.name,
            path=str(cache),
            seconds=round(time.perf_counter() - started, 3),
        )

    # -- generation ------------------------------------------------------
    async def stream(self, request: ChatCompletionRequest) -> AsyncGenerator[Delta, None]:
        """One piece per decoded token, then a text-less delta with finish_reason and usage."""
        if self._model is None or self._closed:
            raise EngineUnavailable(f"local engine {self.name!r} is not loaded", engine=self.name)
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        stop = request.stop
        stops = [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]
        # built here: the streamer hands its text to this loop's queue, which is unbounded, but the worker
        # puts at most one piece per token plus the end, so max_tokens bounds it; not blocking the worker
        # lets it finish and free its slot
        job = _Job(
            request=request,
            loop=loop,
            streamer=_streamer_class()(self._tokenizer, stops),
            done=loop.create_future(),
        )
        job.done.add_done_callback(lambda _: self._slots.release())
        self._active.add(job)
        worker = threading.Thread(
            target=self._generate, args=(job,), name=f"omnigate-{self.name}", daemon=True
        )
        try:
            worker.start()
        except BaseException:
            job.done.set_result(None)
            self._active.discard(job)
            raise
        try:
            async for text in job.streamer:
                if text:
                    yield Delta(text=text)
            await asyncio.shield(job.done)
            outcome = job.outcome
            if isinstance(outcome, _Finish):
                yield Delta(
                    finish_reason=outcome.finish_reason,
                    usage=Usage(outcome.prompt_tokens, outcome.completion_tokens),
                )
                return
            if isinstance(outcome, OmnigateError):
                raise outcome
            raise EngineError(
                f"local engine {self.name!r} failed to generate: {outcome}", engine=self.name
            ) from outcome
        finally:
            job.cancel.set()
            try:
                # the worker notices within one decoding step; shielded so that a second
                # cancellation cannot leave it unobserved (the slot is freed when it ends)
                await asyncio.shield(job.done)
            finally:
                self._active.discard(job)

    async def complete(self, request: ChatCompletionRequest) -> Completion:
        out = Completion()
        gen = self.stream(request)
        try:
            async for delta in gen:
                out.add(delta)
        finally:
            await gen.aclose()
        return out

    def _prompt_ids(self, request: ChatCompletionRequest) -> Any:
        messages = [{"role": _ROLE_MAP.get(m.role, m.role), "content": m.text()} for m in request.messages]
        # template variables only: never let a client swap the template or the call's own options
        extra = {
            k: v for k, v in (request.chat_template_kwargs or {}).items() if k not in self._template_params
        }
        try:
            enc = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True, **extra
            )
        except Exception as exc:  # jinja raises for conversations its template does not accept
            raise InvalidRequest(
                f"the conversation does not fit the model's chat template: {exc}", param="messages"
            ) from exc
        return enc

    def _generate(self, job: _Job) -> None:
        """Runs in a dedicated thread: one generation, start to end."""
        torch, model = self._torch, self._model
        request = job.request
        started = time.perf_counter()
        streamer = job.streamer
        prompt_tokens = 0
        try:
            enc = self._prompt_ids(request)
            prompt_tokens = int(enc["input_ids"].shape[-1])
            room = self._context_len - prompt_tokens
            if room <= 0:
                raise InvalidRequest(
                    f"the prompt is {prompt_tokens} tokens; the model's context is {self._context_len}",
                    param="messages",
                    code="context_length_exceeded",
                )
            max_new = min(request.output_token_limit or self._opts.default_max_tokens, room)

            gen_config = copy.deepcopy(model.generation_config)
            gen_config.update(
                max_new_tokens=max_new,
                # sampling, when asked for, is done by the processors below, so generate() stays greedy
                do_sample=False,
                num_beams=1,
                temperature=None,
                top_p=None,
                top_k=None,
                repetition_penalty=request.repetition_penalty or 1.0,
                pad_token_id=gen_config.pad_token_id
                if gen_config.pad_token_id is not None
                else min(self._eos_ids),
            )
            processors: list[Any] = []
            if request.temperature:  # None or 0 means greedy
                from transformers.generation.logits_process import (
                    TemperatureLogitsWarper,
                    TopKLogitsWarper,
                    TopPLogitsWarper,
                )

                processors.append(TemperatureLogitsWarper(request.temperature))
                if request.top_k and request.top_k > 0:
                    processors.append(TopKLogitsWarper(request.top_k))
                if request.top_p is not None and request.top_p < 1.0:
                    processors.append(TopPLogitsWarper(request.top_p))
                processors.append(_SeededSampler(torch, request.seed))

            from transformers import LogitsProcessorList, StoppingCriteriaList

            if not job.cancel.is_set():
                with torch.inference_mode():
                    model.generate(
                        **enc,
                        generation_config=gen_config,
                        logits_processor=LogitsProcessorList(processors),
                        stopping_criteria=StoppingCriteriaList([_StopOnRequest(job, torch)]),
                        streamer=streamer,
                    )
            n = streamer.completion_tokens
            if streamer.stops.hit or streamer.last_token in self._eos_ids:
                reason = "stop"
            elif n >= max_new:
                reason = "length"
            else:
                reason = "stop"
            cancelled = job.cancel.is_set()  # read first: the consumer sets it once it has the end
            job.outcome = _Finish(reason, prompt_tokens, n)
            streamer.abandon()  # generate() ended the stream; this ends it when generate() never ran
            elapsed = time.perf_counter() - started
            first = streamer.first_token_at
            decode_s = time.perf_counter() - first if first else 0.0
            log.info(
                "local_generation_finished",
                engine=self.name,
                finish_reason="cancelled" if cancelled else reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=n,
                seconds=round(elapsed, 3),
                first_token_s=round(first - started, 3) if first else None,
                tokens_per_s=round((n - 1) / decode_s, 2) if n > 1 and decode_s > 0 else None,
            )
        except BaseException as exc:
            if not job.cancel.is_set() and not isinstance(exc, OmnigateError):
                log.warning("local_generation_failed", engine=self.name, error=str(exc))
            job.outcome = exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
                streamer.abandon()
        finally:
            with contextlib.suppress(RuntimeError):
                job.loop.call_soon_threadsafe(job.done.set_result, None)
