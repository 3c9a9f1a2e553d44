"""``POST /v1/chat/completions``: OpenAI's chat API with image, audio and video parts.

This router converts (OpenAI messages -> engine turns with decoded media; OpenAI
sampling fields -> an engine ``Sampler``), admits, and formats; the engine's
``Completion`` prefills once, forks the ``n`` choices and generates.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from api.http.generation import TokenTiming, completion_params, reasoning_of, scope_caches, usage_of
from api.http.registry import ServedModel
from api.http.schemas.chat import (
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
from api.http.tool_use import ToolUse, tool_use_of
from engine import (
    ChoiceEvent,
    Completion,
    CompletionParams,
    InvalidRequestError,
    ReasoningMarkers,
    Turn,
)

router = APIRouter(tags=["chat"])

_ROLE = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


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
    scope_caches(service, body.cache_salt)
    served = service.models.get(body.model, kind="chat")
    model = served.model
    tool_use = tool_use_of(body, model)
    params = _params(body, service, served, tool_use)
    reasoning = reasoning_of(service.settings, model, body.chat_template_kwargs)
    admission = served.admit()
    try:
        turns = await _turns(body.messages, service, set(model.media_kinds))
        completion = Completion(
            model,
            turns,
            params,
            tools=tool_use.tools if tool_use else None,
            template_options=body.chat_template_kwargs,
        )
        started = time.perf_counter()
        if body.stream:
            await completion.start()  # prompt errors become a status, not a broken stream
            return EventStream(
                _sse(completion, body, served.name, service, started, admission, tool_use, reasoning),
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            answer = await cancel_on_disconnect(
                request, _whole(completion, body, served.name, service, started, tool_use, reasoning)
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


@dataclass(frozen=True)
class PreparedChat:
    """A chat request turned into the engine's ``Completion`` (not started) and its tool use."""

    served: ServedModel
    completion: Completion
    tool_use: ToolUse | None
    reasoning: ReasoningMarkers | None
    """The thought markers the answer is split by (None: all of it is the answer)."""


async def prepare_chat(body: ChatCompletionRequest, service: Service) -> PreparedChat:
    """The chat endpoint's checks and conversion, for callers that run the completion
    themselves (the Batch API, the Responses API): the same path as a chat request."""
    scope_caches(service, body.cache_salt)
    served = service.models.get(body.model, kind="chat")
    tool_use = tool_use_of(body, served.model)
    params = _params(body, service, served, tool_use)
    turns = await _turns(body.messages, service, set(served.model.media_kinds))
    completion = Completion(
        served.model,
        turns,
        params,
        tools=tool_use.tools if tool_use else None,
        template_options=body.chat_template_kwargs,
    )
    return PreparedChat(
        served, completion, tool_use, reasoning_of(service.settings, served.model, body.chat_template_kwargs)
    )


async def complete_chat(body: ChatCompletionRequest, service: Service) -> ChatCompletion:
    """A whole (non-streamed) chat completion without an HTTP request around it: the Batch
    API runs its lines through this, the same path as ``POST /v1/chat/completions``. No
    admission slot is taken: a batch bounds its own concurrency."""
    chat = await prepare_chat(body, service)
    try:
        return await _whole(
            chat.completion,
            body,
            chat.served.name,
            service,
            time.perf_counter(),
            chat.tool_use,
            chat.reasoning,
        )
    finally:
        await chat.completion.aclose()


def _params(
    body: ChatCompletionRequest, service: Service, served: ServedModel, tool_use: ToolUse | None
) -> CompletionParams:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    params = completion_params(
        body,
        service,
        served,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
    )
    if tool_use is not None and tool_use.grammar is not None:
        params = dataclasses.replace(params, grammar=tool_use.grammar)
    return params


async def _turns(messages: list[ChatMessage], service: Service, accepts: set[str]) -> list[Turn]:
    limits = service.settings.limit_mm_per_prompt
    counts = {"image": 0, "audio": 0, "video": 0}
    turns: list[tuple[str, list[Any], dict[str, Any] | None]] = []
    fetches: list[Any] = []
    try:
        for i, msg in enumerate(messages):
            role = _ROLE[msg.role]
            content = msg.content
            extra = _message_extra(msg)
            if content is None or isinstance(content, str):
                turns.append((role, [content or ""], extra))
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
            turns.append((role, parts, extra))
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
        Turn(role, tuple(media[p.index] if isinstance(p, _Pending) else p for p in parts), extra)
        for role, parts, extra in turns
    ]


def _message_extra(msg: ChatMessage) -> dict[str, Any] | None:
    """A message's keys beside role and content that chat templates read: an assistant's
    ``tool_calls`` (arguments as an object, as templates expect, where the JSON text is one)
    and a tool result's ``tool_call_id``."""
    if msg.tool_calls:
        calls = []
        for call in msg.tool_calls:
            try:
                args: Any = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                args = call.function.arguments
            fn = {
                "name": call.function.name,
                "arguments": args if isinstance(args, dict) else call.function.arguments,
            }
            calls.append({"id": call.id, "type": "function", "function": fn})
        return {"tool_calls": calls}
    if msg.role == "tool" and msg.tool_call_id is not None:
        return {"tool_call_id": msg.tool_call_id}
    return None


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
    completion: Completion,
    body: ChatCompletionRequest,
    name: str,
    service: Service,
    started: float,
    tool_use: ToolUse | None = None,
    markers: ReasoningMarkers | None = None,
) -> ChatCompletion:
    n = completion.params.n
    texts = [""] * n
    thoughts = [""] * n
    splits = [markers.split() for _ in range(n)] if markers is not None else []
    reasons: list[Any] = [None] * n
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    timing = TokenTiming(service, name, started)
    async for ev in completion:
        timing.token(ev.index)
        if splits and not splits[ev.index].passthrough(ev.token):
            thought, text = splits[ev.index].feed(ev.token, ev.text)
            thoughts[ev.index] += thought
            texts[ev.index] += text
        else:
            texts[ev.index] += ev.text
        reasons[ev.index] = ev.finish_reason or reasons[ev.index]
        if body.logprobs:
            lps[ev.index].append(_logprobs(service, completion.model, ev))
    timing.done(completion)
    choices = []
    for i in range(n):
        thought = thoughts[i] or None
        message, reason = AssistantMessage(content=texts[i], reasoning_content=thought), reasons[i]
        if tool_use is not None and tool_use.parses:
            parsed = tool_use.format.parse(texts[i])
            message = AssistantMessage(
                content=parsed.content, reasoning_content=thought, tool_calls=ToolUse.calls_out(parsed.calls)
            )
            reason = tool_use.finish_reason(reason, parsed.calls)
        choices.append(
            Choice(
                index=i,
                message=message,
                finish_reason=reason,
                logprobs=ChoiceLogprobs(content=lps[i]) if body.logprobs else None,
            )
        )
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
    tool_use: ToolUse | None = None,
    markers: ReasoningMarkers | None = None,
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

    parses = tool_use is not None and tool_use.parses
    splitters = [tool_use.format.stream() for _ in range(completion.params.n)] if parses else []

    thinking = [markers.split() for _ in range(completion.params.n)] if markers is not None else []

    def event(ev: ChoiceEvent) -> str:
        thought, text = "", ev.text
        if thinking and not thinking[ev.index].passthrough(ev.token):
            thought, text = thinking[ev.index].feed(ev.token, ev.text)
        calls: tuple = ()
        reason = ev.finish_reason
        if splitters:  # the answer may hold tool calls: release what cannot begin one
            assert tool_use is not None
            split = splitters[ev.index]
            text = split.feed(text)
            if ev.finish_reason:
                rest, calls = split.finish()
                text += rest
            reason = tool_use.finish_reason(ev.finish_reason, calls)
        elif text and not thought and not reason and not body.logprobs:
            return token_chunk(head, ev.index, text)
        lp = ChoiceLogprobs(content=[_logprobs(service, completion.model, ev)]) if body.logprobs else None
        if not (text or thought or reason or lp is not None):
            return ""  # a token that completed no character yet
        delta = Delta(
            content=text or None, reasoning_content=thought or None, tool_calls=ToolUse.deltas(calls) or None
        )
        return chunk([ChunkChoice(index=ev.index, delta=delta, finish_reason=reason, logprobs=lp)])

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
