"""``POST /v1/completions``: OpenAI's legacy text completion, as vLLM serves it.

A raw prompt (text, token ids, or a list of up to 64 of either) goes into a context with no
chat template (``engine.Completion.from_prompt``: text tokenized as the tokenizer does by
default, its BOS included). ``echo`` returns the prompt before the completion and, with
``logprobs``, the prompt tokens' log-probabilities (the first has none): with
``max_tokens: 0`` that scores a text, as evaluation harnesses use the endpoint.
``text_offset`` counts the token strings' lengths, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from api.http.deps import Service, get_service
from api.http.disconnect import cancel_on_disconnect
from api.http.generation import TokenTiming, completion_params, scope_caches
from api.http.registry import ServedModel
from api.http.schemas.chat import PromptTokensDetails, Usage
from api.http.schemas.completions import (
    DEFAULT_MAX_TOKENS,
    MAX_PROMPTS,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    TextCompletion,
)
from api.http.sse import EventStream, Last, error_event
from engine import ChoiceEvent, Completion, CompletionParams, InvalidRequestError

router = APIRouter(tags=["completions"])


@router.post(
    "/v1/completions",
    response_model=TextCompletion,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE chunks when stream=true"},
        **Service.error_responses(400, 401, 404, 413, 415, 422, 429, 503),
    },
)
async def completions(body: CompletionRequest, request: Request, service: Service = Depends(get_service)):
    scope_caches(service, body.cache_salt)
    served = service.models.get(body.model, kind="chat")
    prompts = _prompts(body.prompt)
    params = _params(body, service, served)
    admission = served.admit()
    runs = [Completion.from_prompt(served.model, p, params) for p in prompts]
    try:
        started = time.perf_counter()
        if body.stream:
            await _start_all(runs)  # prompt errors become a status, not a broken stream
            return EventStream(
                _sse(runs, prompts, body, served.name, service, started, admission),
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            answer = await cancel_on_disconnect(
                request, _whole(runs, prompts, body, served.name, service, started)
            )
            return Response(answer.model_dump_json(), media_type="application/json")
        finally:
            await _close_all(runs)
            admission.release()
    except BaseException:
        await _close_all(runs)
        admission.release()
        raise


async def complete_text(body: CompletionRequest, service: Service) -> TextCompletion:
    """A whole (non-streamed) legacy completion without an HTTP request around it: the
    Batch API runs its ``/v1/completions`` lines through this, the same path as the route.
    No admission slot is taken: a batch bounds its own concurrency."""
    scope_caches(service, body.cache_salt)
    served = service.models.get(body.model, kind="chat")
    prompts = _prompts(body.prompt)
    params = _params(body, service, served)
    runs = [Completion.from_prompt(served.model, p, params) for p in prompts]
    try:
        return await _whole(runs, prompts, body, served.name, service, time.perf_counter())
    finally:
        await _close_all(runs)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The request's prompts, each text or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt is an empty list: give text or token ids", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequestError(
            f"{len(prompt)} prompts in one request; this server takes up to {MAX_PROMPTS}",
            param="prompt",
            limit=MAX_PROMPTS,
            actual=len(prompt),
        )
    return list(prompt)


def _params(body: CompletionRequest, service: Service, served: ServedModel) -> CompletionParams:
    if body.suffix:
        raise InvalidRequestError("suffix is not supported by this server", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("best_of is served only equal to n (or left out)", param="best_of")
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequestError("max_tokens 0 needs echo: true (it scores the prompt)", param="max_tokens")
    scored = body.echo and body.logprobs is not None
    return completion_params(
        body,
        service,
        served,
        max_tokens=body.max_tokens,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if scored else None,
    )


async def _start_all(runs: list[Completion]) -> None:
    """Start every prompt's completion at once; the first failure (in prompt order) is
    raised once all have settled."""
    for outcome in await asyncio.gather(*(c.start() for c in runs), return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


async def _close_all(runs: list[Completion]) -> None:
    for c in runs:
        await c.aclose()


@dataclass
class _Choice:
    """One choice as it grows: its text, and its logprobs in the legacy shape."""

    text: str = ""
    finish_reason: str | None = None
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    end: int = 0
    """Where the next token's string starts (the token strings' lengths so far)."""

    def add_token(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.end)
        self.end += len(token)

    def logprobs(self, since: int = 0) -> CompletionLogprobs:
        return CompletionLogprobs(
            tokens=self.tokens[since:],
            token_logprobs=self.token_logprobs[since:],
            top_logprobs=self.top_logprobs[since:],
            text_offset=self.text_offset[since:],
        )


class _Formatter:
    """Turns a prompt's completion into legacy choices (echo, logprobs)."""

    def __init__(self, body: CompletionRequest, completion: Completion, prompt: str | list[int]):
        self.body, self.completion, self.prompt = body, completion, prompt
        self.detokenize = completion.model.detokenize

    def start(self) -> list[_Choice]:
        """The choices before any token: with echo, the prompt (and its logprobs)."""
        choices = [_Choice() for _ in range(self.completion.params.n)]
        if not self.body.echo:
            return choices
        text = self.prompt if isinstance(self.prompt, str) else self.detokenize(self.prompt)
        for ch in choices:
            ch.text = text
            if self.body.logprobs is not None:
                for p in self.completion.prompt_logprobs:
                    top = None if p.logprob is None else self._top(p.top_logprobs, p.token, p.logprob)
                    ch.add_token(self.detokenize([p.token]), p.logprob, top)
        return choices

    def add(self, ch: _Choice, ev: ChoiceEvent) -> None:
        ch.text += ev.text
        ch.finish_reason = ev.finish_reason or ch.finish_reason
        if self.body.logprobs is not None:
            top = self._top(ev.top_logprobs, ev.token, ev.logprob)
            ch.add_token(self.detokenize([ev.token]), ev.logprob, top)

    def _top(
        self, pairs: tuple[tuple[int, float], ...], chosen: int, logprob: float | None
    ) -> dict[str, float]:
        """The legacy ``top_logprobs`` entry of one position: the ``logprobs`` most probable
        tokens and, as OpenAI and vLLM always add it, the chosen token (so up to
        ``logprobs + 1`` entries), most probable first."""
        ranked = list(pairs)
        if logprob is not None and all(t != chosen for t, _ in ranked):
            ranked.append((chosen, logprob))
            ranked.sort(key=lambda pair: -pair[1])
        top: dict[str, float] = {}
        for t, lp in ranked:  # two ids may print alike: the more probable one names the entry
            top.setdefault(self.detokenize([t]), lp)
        return top


def _usage(runs: list[Completion]) -> Usage:
    prompt = sum(c.prompt_tokens for c in runs)
    done = sum(sum(c.completion_tokens) for c in runs)
    cached = PromptTokensDetails(cached_tokens=sum(c.cached_tokens for c in runs))
    return Usage(
        prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done, prompt_tokens_details=cached
    )


async def _whole(
    runs: list[Completion],
    prompts: list[str | list[int]],
    body: CompletionRequest,
    name: str,
    service: Service,
    started: float,
) -> TextCompletion:
    timing = TokenTiming(service, name, started)

    async def one(c: Completion, prompt: str | list[int]) -> list[_Choice]:
        await c.start()
        fmt = _Formatter(body, c, prompt)
        choices = fmt.start()
        async for ev in c:
            timing.token(ev.index)
            fmt.add(choices[ev.index], ev)
        timing.done(c)
        return choices

    per_prompt = await asyncio.gather(*(one(c, p) for c, p in zip(runs, prompts, strict=True)))
    n = body.n
    return TextCompletion(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=name,
        choices=[
            CompletionChoice(
                index=p * n + i,
                text=ch.text,
                finish_reason=ch.finish_reason or "length",
                logprobs=ch.logprobs() if body.logprobs is not None else None,
            )
            for p, choices in enumerate(per_prompt)
            for i, ch in enumerate(choices)
        ],
        usage=_usage(runs),
    )


async def _merged(runs: list[Completion]) -> AsyncIterator[tuple[int, list[ChoiceEvent]]]:
    """Every prompt's event groups as they come: (prompt index, group). Closing this
    cancels the prompts' readers."""
    if len(runs) == 1:  # the common case, without a reader task
        async for group in runs[0].batches():
            yield 0, group
        return
    queue: asyncio.Queue[tuple[int, list[ChoiceEvent]] | BaseException | None] = asyncio.Queue()

    async def read(p: int, c: Completion) -> None:
        try:
            async for group in c.batches():
                queue.put_nowait((p, group))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            queue.put_nowait(e)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            queue.put_nowait(None)

    readers = [asyncio.create_task(read(p, c)) for p, c in enumerate(runs)]
    try:
        left = len(readers)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in readers:
            t.cancel()
        for t in readers:
            with contextlib.suppress(BaseException):
                await t


async def _sse(
    runs: list[Completion],
    prompts: list[str | list[int]],
    body: CompletionRequest,
    name: str,
    service: Service,
    started: float,
    admission: Any,
) -> AsyncIterator[str]:
    """The stream: with echo, each choice's prompt first; then each group of tokens produced
    together in one write; the last write carries the usage chunk and ``[DONE]``."""
    cid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    n = body.n
    logprobs = body.logprobs is not None

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        c = TextCompletion(id=cid, created=created, model=name, choices=choices, usage=usage)
        return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

    timing = TokenTiming(service, name, started)
    formatters = [_Formatter(body, c, p) for c, p in zip(runs, prompts, strict=True)]
    states = [f.start() for f in formatters]
    pending = ""
    if body.echo:
        pending = "".join(
            chunk(
                [
                    CompletionChoice(
                        index=p * n + i, text=ch.text, logprobs=ch.logprobs() if logprobs else None
                    )
                ]
            )
            for p, choices in enumerate(states)
            for i, ch in enumerate(choices)
        )
    try:
        async for p, group in _merged(runs):
            parts = [pending]
            for ev in group:
                timing.token(p * n + ev.index)
                ch = states[p][ev.index]
                seen = len(ch.tokens)
                formatters[p].add(ch, ev)
                if ev.text or ev.finish_reason or logprobs:
                    parts.append(
                        chunk(
                            [
                                CompletionChoice(
                                    index=p * n + ev.index,
                                    text=ev.text,
                                    finish_reason=ev.finish_reason,
                                    logprobs=ch.logprobs(seen) if logprobs else None,
                                )
                            ]
                        )
                    )
            pending = "".join(parts)
            if pending and not all(c.finished for c in runs):  # the last group waits for [DONE]
                yield pending
                pending = ""
        for p, choices in enumerate(states):  # a choice that ran no token (max_tokens 0) ends here
            for i, ch in enumerate(choices):
                if ch.finish_reason is None:
                    pending += chunk([CompletionChoice(index=p * n + i, text="", finish_reason="length")])
        for c in runs:
            timing.done(c)
        if body.stream_options and body.stream_options.include_usage:
            pending += chunk([], _usage(runs))
        yield Last(pending + "data: [DONE]\n\n")
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the status line is gone; tell the client in the stream
        yield Last(pending + error_event(e))
    finally:
        await _close_all(runs)
        admission.release()
