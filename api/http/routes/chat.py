"""``POST /v1/chat/completions``: OpenAI's chat API with image, audio and video parts.

This router converts (OpenAI messages -> engine turns with decoded media; OpenAI
sampling fields -> an engine ``Sampler``), admits, and formats; the engine's
``Completion`` prefills once, forks the ``n`` choices and generates.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from api.http.deps import Service, get_service
from api.http.disconnect import cancel_on_disconnect
from api.http.errors import ServiceError
from api.http.generation import TokenTiming, completion_params, usage_of
from api.http.registry import ServedModel
from api.http.schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from api.http.sse import EventStream, Last, error_event
from engine import (
    ChoiceEvent,
    Completion,
    CompletionParams,
    InvalidRequestError,
    Turn,
)

router = APIRouter(tags=["chat"])

_ROLE = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE chunks when stream=true"},
        **Service.error_responses(400, 401, 404, 413, 415, 422, 429, 503),
    },
)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, service: Service = Depends(get_service)
):
    served = service.models.get(body.model, kind="chat")
    model = served.model
    params = _params(body, service, served)
    admission = served.admit()
    try:
        turns = await _turns(body.messages, service, set(model.media_kinds))
        completion = Completion(model, turns, params)
        started = time.perf_counter()
        if body.stream:
            await completion.start()  # prompt errors become a status, not a broken stream
            return EventStream(
                _sse(completion, body, served.name, service, started, admission),
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            answer = await cancel_on_disconnect(
                request, _whole(completion, body, served.name, service, started)
            )
            # Serialized once, in pydantic's core: handing FastAPI the model would validate it
            # again against the response model and encode it twice more (the OpenAPI schema
            # still comes from ``response_model``).
            return Response(answer.model_dump_json(), media_type="application/json")
        finally:
            await completion.aclose()
            admission.release()
    except BaseException:
        admission.release()
        raise


async def complete_chat(body: ChatCompletionRequest, service: Service) -> ChatCompletion:
    """A whole (non-streamed) chat completion without an HTTP request around it: the Batch
    API runs its lines through this, the same path as ``POST /v1/chat/completions``. No
    admission slot is taken: a batch bounds its own concurrency."""
    served = service.models.get(body.model, kind="chat")
    params = _params(body, service, served)
    turns = await _turns(body.messages, service, set(served.model.media_kinds))
    completion = Completion(served.model, turns, params)
    try:
        return await _whole(completion, body, served.name, service, time.perf_counter())
    finally:
        await completion.aclose()


def _params(body: ChatCompletionRequest, service: Service, served: ServedModel) -> CompletionParams:
    if body.tools:
        raise InvalidRequestError("tools are not supported by this server", param="tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    return completion_params(
        body,
        service,
        served,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )


async def _turns(messages: list[ChatMessage], service: Service, accepts: set[str]) -> list[Turn]:
    limits = service.settings.limit_mm_per_prompt
    counts = {"image": 0, "audio": 0, "video": 0}
    turns: list[tuple[str, list[Any]]] = []
    fetches: list[Any] = []
    try:
        for i, msg in enumerate(messages):
            role = _ROLE[msg.role]
            content = msg.content
            if content is None or isinstance(content, str):
                turns.append((role, [content or ""]))
                continue
            parts: list[Any] = []
            for j, part in enumerate(content):
                param = f"messages[{i}].content[{j}]"
                if part.type == "text":
                    parts.append(part.text)
                    continue
                kind = {"image_url": "image", "input_audio": "audio", "video_url": "video"}[part.type]
                if kind not in accepts:
                    raise InvalidRequestError(
                        f"this model takes {', '.join(sorted(accepts)) or 'no media'}, not {kind}",
                        param=param,
                        kind=kind,
                    )
                counts[kind] += 1
                if counts[kind] > limits.get(kind, 0):
                    raise ServiceError(
                        "too_many_media_items",
                        f"more than {limits.get(kind, 0)} {kind} item(s) in one request (--limit-mm-per-prompt)",
                        param=param,
                        limit=limits.get(kind, 0),
                        kind=kind,
                    )
                resolver = service.media
                if part.type == "image_url":
                    fetches.append(resolver.from_url(part.image_url.url, "image"))
                elif part.type == "video_url":
                    fetches.append(resolver.from_url(part.video_url.url, "video"))
                else:
                    fetches.append(resolver.from_base64(part.input_audio.data, "audio"))
                parts.append(_Pending(len(fetches) - 1))
            turns.append((role, parts))
    except BaseException:
        for pending in fetches:  # none was awaited yet: close them quietly
            pending.close()
        raise
    # Every item is checked above before any is fetched or decoded; then all are fetched
    # and decoded at once, and the first failure in request order is the answer.
    media = await asyncio.gather(*fetches, return_exceptions=True)
    for item in media:
        if isinstance(item, BaseException):
            raise item
    return [
        Turn(role, tuple(media[p.index] if isinstance(p, _Pending) else p for p in parts))
        for role, parts in turns
    ]


@dataclass(frozen=True)
class _Pending:
    """A media part's place in the request while it is being fetched and decoded."""

    index: int


def _logprobs(service: Service, model: Any, ev: ChoiceEvent) -> TokenLogprob:
    def entry(token: int, lp: float) -> dict[str, Any]:
        text = model.detokenize([token])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    top = [TopLogprob(**entry(t, lp)) for t, lp in ev.top_logprobs]
    return TokenLogprob(**entry(ev.token, ev.logprob if ev.logprob is not None else 0.0), top_logprobs=top)


async def _whole(
    completion: Completion, body: ChatCompletionRequest, name: str, service: Service, started: float
) -> ChatCompletion:
    n = completion.params.n
    texts = [""] * n
    reasons: list[Any] = [None] * n
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    timing = TokenTiming(service, name, started)
    async for ev in completion:
        timing.token(ev.index)
        texts[ev.index] += ev.text
        reasons[ev.index] = ev.finish_reason or reasons[ev.index]
        if body.logprobs:
            lps[ev.index].append(_logprobs(service, completion.model, ev))
    timing.done(completion)
    choices = [
        Choice(
            index=i,
            message=AssistantMessage(content=texts[i]),
            finish_reason=reasons[i],
            logprobs=ChoiceLogprobs(content=lps[i]) if body.logprobs else None,
        )
        for i in range(n)
    ]
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=name,
        choices=choices,
        usage=usage_of(completion),
    )


def chunk_head(cid: str, created: int, model: str) -> str:
    """The fixed start of a stream's chunks, up to the choice index."""
    ident, name = json.dumps(cid), json.dumps(model)
    return f'data: {{"id":{ident},"object":"chat.completion.chunk","created":{created},"model":{name},"choices":[{{"index":'


def token_chunk(head: str, index: int, text: str) -> str:
    """A plain token's SSE event, formatted directly: the hot path of streaming, the same
    bytes as ``ChatCompletionChunk(...).model_dump_json(exclude_none=True)`` (tested) for
    a fraction of building the models per token."""
    return f'{head}{index},"delta":{{"content":{json.dumps(text, ensure_ascii=False)}}}}}]}}\n\n'


async def _sse(
    completion: Completion,
    body: ChatCompletionRequest,
    name: str,
    service: Service,
    started: float,
    admission: Any,
) -> AsyncIterator[str]:
    """The stream's SSE events, one item per write: the role chunks go out with the first
    tokens (the headers are already out by then), each group of tokens produced together
    (``n`` choices, a drafted step) shares a write, and the last group carries the usage
    chunk, ``[DONE]`` and the end of the body."""
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
        c = ChatCompletionChunk(id=cid, created=created, model=name, choices=choices, usage=usage)
        return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

    def event(ev: ChoiceEvent) -> str:
        if ev.text and not ev.finish_reason and not body.logprobs:
            return token_chunk(head, ev.index, ev.text)
        lp = ChoiceLogprobs(content=[_logprobs(service, completion.model, ev)]) if body.logprobs else None
        if not (ev.text or ev.finish_reason or lp is not None):
            return ""  # a token that completed no character yet
        delta = Delta(content=ev.text or None)
        return chunk([ChunkChoice(index=ev.index, delta=delta, finish_reason=ev.finish_reason, logprobs=lp)])

    head = chunk_head(cid, created, name)
    timing = TokenTiming(service, name, started)
    pending = "".join(
        chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
        for i in range(completion.params.n)
    )
    try:
        async for group in completion.batches():
            parts = [pending]
            for ev in group:
                timing.token(ev.index)
                parts.append(event(ev))
            pending = "".join(parts)
            if pending and not completion.finished:  # the last group waits for [DONE]
                yield pending
                pending = ""
        timing.done(completion)
        if include_usage:
            pending += chunk([], usage_of(completion))
        yield Last(pending + "data: [DONE]\n\n")
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the status line is gone; tell the client in the stream
        yield Last(pending + error_event(e))
    finally:
        await completion.aclose()
        admission.release()
