"""OpenAI's Responses API: ``POST /v1/responses``, ``GET|DELETE /v1/responses/{id}``.

A request becomes a chat request (``instructions`` the system turn, ``input`` items the
messages, ``function_call`` / ``function_call_output`` items an assistant's calls and the
tool results, ``text.format`` the response format, function tools the chat's tools) and
runs through the chat endpoint's own path (``prepare_chat``), so its prompt, sampling and
tool calls are the chat's. The answer's output is a message item and the function calls
the model made. ``store`` (default true) keeps the response and its conversation, which a
later request continues with ``previous_response_id``; ``stream`` sends OpenAI's typed
events (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError

from api.http.deps import Service, get_service
from api.http.disconnect import cancel_on_disconnect
from api.http.errors import ServiceError
from api.http.routes.chat import PreparedChat, prepare_chat
from api.http.schemas.chat import ChatCompletionRequest
from api.http.schemas.responses import (
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from api.http.security.audit import audit
from api.http.security.tenancy import current_caller
from api.http.sse import EventStream, Last
from engine import ChoiceEvent, InvalidRequestError, ToolCall

router = APIRouter(tags=["responses"])
ERRORS = Service.error_responses(400, 401, 404, 413, 415, 429)


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE events"}, **ERRORS},
)
async def create_response(body: ResponsesRequest, request: Request, service: Service = Depends(get_service)):
    chat_body, conversation = chat_request(body, await _previous(body, service))
    served = service.models.get(body.model, kind="chat")
    admission = served.admit()
    try:
        chat = await prepare_chat(chat_body, service)
        run = _Run(body, chat, conversation, service)
        if body.stream:
            await chat.completion.start()  # prompt errors become a status, not a broken stream
            return EventStream(_sse(run, admission), headers={"Cache-Control": "no-cache"})
        try:
            answer = await cancel_on_disconnect(request, run.whole())
        finally:
            await chat.completion.aclose()
            admission.release()
        return Response(answer.model_dump_json(), media_type="application/json")
    except BaseException:
        admission.release()
        raise


async def complete_response(body: ResponsesRequest, service: Service) -> ResponseObject:
    """A whole (non-streamed) response without an HTTP request around it: the Batch API
    runs its ``/v1/responses`` lines through this, the same path as the route. No
    admission slot is taken: a batch bounds its own concurrency."""
    chat_body, conversation = chat_request(body, await _previous(body, service))
    chat = await prepare_chat(chat_body, service)
    try:
        return await _Run(body, chat, conversation, service).whole()
    finally:
        await chat.completion.aclose()


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=ERRORS)
async def get_response(response_id: str, service: Service = Depends(get_service)) -> Response:
    stored = await asyncio.to_thread(
        functools.partial(service.responses.get, response_id, scope=current_caller().scope)
    )
    if stored is None:
        raise ServiceError("not_found", f"no stored response {response_id!r}", param="response_id")
    return Response(json.dumps(stored[0]), media_type="application/json")


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=ERRORS)
async def delete_response(response_id: str, service: Service = Depends(get_service)) -> ResponseDeleted:
    if not await asyncio.to_thread(
        functools.partial(service.responses.delete, response_id, scope=current_caller().scope)
    ):
        raise ServiceError("not_found", f"no stored response {response_id!r}", param="response_id")
    audit("delete", "response", response_id)
    return ResponseDeleted(id=response_id)


async def _previous(body: ResponsesRequest, service: Service) -> list[dict[str, Any]]:
    """The stored conversation ``previous_response_id`` names (none without one)."""
    if body.previous_response_id is None:
        return []
    stored = await asyncio.to_thread(
        functools.partial(service.responses.get, body.previous_response_id, scope=current_caller().scope)
    )
    if stored is None:
        raise ServiceError(
            "not_found", f"no stored response {body.previous_response_id!r}", param="previous_response_id"
        )
    return stored[1]


def chat_request(
    body: ResponsesRequest, previous: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request a Responses request is, and its conversation (the previous
    response's, then this input; without the instructions, which OpenAI does not carry
    from one response to the next)."""
    conversation = list(previous)
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    calls: dict[str, Any] | None = None  # the assistant message that consecutive calls join
    for item in items:
        if item.type == "function_call":
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if calls is None:
                calls = {"role": "assistant", "content": None, "tool_calls": []}
                conversation.append(calls)
            calls["tool_calls"].append(call)
            continue
        calls = None
        if item.type == "function_call_output":
            conversation.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            conversation.append({"role": item.role, "content": _content(item.content)})
    messages = (
        [{"role": "system", "content": body.instructions}] if body.instructions else []
    ) + conversation
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "cache_salt": body.cache_salt,
        "parallel_tool_calls": body.parallel_tool_calls,
        "chat_template_kwargs": _template_kwargs(body),
    }
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = body.text.format if body.text is not None else None
    if fmt is not None:
        if fmt.type == "json_schema":
            spec = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
            chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        else:
            chat["response_format"] = fmt.model_dump()
    if not conversation:
        raise InvalidRequestError("input has no items", param="input")
    try:
        return ChatCompletionRequest.model_validate(chat), conversation
    except ValidationError as e:  # what only the chat form checks (a part's shape, ...)
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise InvalidRequestError(f"{where}: {first['msg']}", param="input") from None


def _template_kwargs(body: ResponsesRequest) -> dict[str, Any] | None:
    """The request's template keywords, with ``reasoning.effort`` as ``enable_thinking``."""
    kwargs = dict(body.chat_template_kwargs or {})
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = effort not in ("none", "minimal")
    return kwargs or None


def _content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type in ("input_text", "output_text"):
            parts.append({"type": "text", "text": part.text})
        elif part.type == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.image_url, "detail": part.detail}})
        else:
            parts.append({"type": "input_audio", "input_audio": part.input_audio.model_dump()})
    return parts


@dataclass
class _Run:
    """One response being generated: its text, then its output items and usage."""

    body: ResponsesRequest
    chat: PreparedChat
    conversation: list[dict[str, Any]]
    service: Service
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    thoughts: str = ""
    finish_reason: str | None = None
    reasoning_id: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")

    def __post_init__(self) -> None:
        markers = self.chat.reasoning
        self.thinking = markers.split() if markers is not None else None

    def take(self, ev: ChoiceEvent) -> str:
        """One generated token: its thoughts join ``thoughts``; returns its answer text."""
        piece = ev.text
        if self.thinking is not None and not self.thinking.passthrough(ev.token):
            thought, piece = self.thinking.feed(ev.token, ev.text)
            self.thoughts += thought
        self.text += piece
        self.finish_reason = ev.finish_reason or self.finish_reason
        return piece

    def reasoning_item(self) -> ReasoningItem:
        return ReasoningItem(id=self.reasoning_id, content=[ReasoningText(text=self.thoughts)])

    @property
    def parses(self) -> bool:
        return self.chat.tool_use is not None and self.chat.tool_use.parses

    def split(self) -> tuple[str | None, tuple[ToolCall, ...]]:
        """(the message text, the calls) of what was generated."""
        if not self.parses:
            return self.text, ()
        assert self.chat.tool_use is not None
        parsed = self.chat.tool_use.format.parse(self.text)
        return parsed.content, parsed.calls

    def response(
        self, status: str, content: str | None = None, calls: tuple[ToolCall, ...] = ()
    ) -> ResponseObject:
        b = self.body
        output: list[Any] = []
        done = status != "in_progress"
        if done and self.thoughts:
            output.append(self.reasoning_item())
        if done and (content or not calls):
            item_status = "incomplete" if status == "incomplete" else "completed"
            output.append(
                OutputMessage(
                    id=self.message_id, status=item_status, content=[OutputText(text=content or "")]
                )
            )
        output += [_call_item(c) for c in calls]
        c = self.chat.completion
        usage = None
        if done:
            out = sum(c.completion_tokens)
            usage = ResponseUsage(
                input_tokens=c.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=c.cached_tokens),
                output_tokens=out,
                total_tokens=c.prompt_tokens + out,
            )
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,
            model=self.chat.served.name,
            output=output,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            instructions=b.instructions,
            max_output_tokens=b.max_output_tokens,
            temperature=b.temperature,
            top_p=b.top_p,
            tools=b.tools or [],
            tool_choice=(
                b.tool_choice.model_dump()
                if b.tool_choice is not None and not isinstance(b.tool_choice, str)
                else b.tool_choice or "auto"
            ),
            parallel_tool_calls=b.parallel_tool_calls,
            text=b.text.model_dump(by_alias=True, exclude_none=True)
            if b.text and b.text.format
            else {"format": {"type": "text"}},
            previous_response_id=b.previous_response_id,
            store=b.store,
            metadata=b.metadata or {},
            usage=usage,
        )

    def finished(self) -> ResponseObject:
        content, calls = self.split()
        return self.response("incomplete" if self.finish_reason == "length" else "completed", content, calls)

    async def store(self, answer: ResponseObject, content: str | None, calls: tuple[ToolCall, ...]) -> None:
        if not self.body.store:
            return
        turn: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
        await asyncio.to_thread(
            functools.partial(
                self.service.responses.put,
                answer.id,
                answer.model_dump(mode="json"),
                [*self.conversation, turn],
                tenant=current_caller().tenant,
            )
        )
        audit("create", "response", answer.id)

    async def whole(self) -> ResponseObject:
        async for ev in self.chat.completion:
            self.take(ev)
        answer = self.finished()
        await self.store(answer, *self.split())
        return answer


def _call_item(call: ToolCall) -> FunctionCallOutput:
    return FunctionCallOutput(
        id=f"fc_{call.id.removeprefix('call_')}", call_id=call.id, name=call.name, arguments=call.arguments
    )


class _Events:
    """OpenAI's typed stream events, numbered."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _sse(run: _Run, admission: Any) -> AsyncIterator[str]:
    """The typed events: the thoughts (if any) as a reasoning item once they end, the
    message's text as it comes, then each function call whole, then the response."""
    event = _Events()
    splitter = run.chat.tool_use.format.stream() if run.parses and run.chat.tool_use else None
    started = run.response("in_progress").model_dump(mode="json")
    yield event("response.created", response=started) + event("response.in_progress", response=started)
    state = {"reasoning": False, "message": False, "index": 0}
    released = ""

    def where() -> dict[str, Any]:
        return {"item_id": run.message_id, "output_index": state["index"], "content_index": 0}

    def close_reasoning() -> str:
        """The reasoning item, once, before anything after the thoughts."""
        if state["reasoning"] or not run.thoughts:
            return ""
        state["reasoning"] = True
        item = run.reasoning_item().model_dump(mode="json")
        state["index"] = 1
        return event("response.output_item.added", output_index=0, item={**item, "content": []}) + event(
            "response.output_item.done", output_index=0, item=item
        )

    def open_message() -> str:
        out = close_reasoning()
        state["message"] = True
        item = {
            "type": "message",
            "id": run.message_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": []}
        return (
            out
            + event("response.output_item.added", output_index=state["index"], item=item)
            + event("response.content_part.added", **where(), part=part)
        )

    try:
        async for group in run.chat.completion.batches():
            out = []
            for ev in group:
                piece = run.take(ev)
                if splitter is not None:
                    piece = splitter.feed(piece)
                if piece:
                    if not state["message"]:
                        out.append(open_message())
                    released += piece
                    out.append(event("response.output_text.delta", **where(), delta=piece, logprobs=[]))
            if out:
                yield "".join(out)
        content, calls = run.split()
        answer = run.finished()
        tail = [close_reasoning()]
        if content or not calls:
            if not state["message"]:
                tail.append(open_message())
            rest = (content or "")[len(released) :]
            if rest:
                tail.append(event("response.output_text.delta", **where(), delta=rest, logprobs=[]))
            text = content or ""
            part = {"type": "output_text", "text": text, "annotations": []}
            message = next(o for o in answer.output if o.type == "message").model_dump(mode="json")
            tail.append(event("response.output_text.done", **where(), text=text, logprobs=[]))
            tail.append(event("response.content_part.done", **where(), part=part))
            tail.append(event("response.output_item.done", output_index=state["index"], item=message))
            state["index"] += 1
        for k, call in enumerate(calls):
            item = _call_item(call).model_dump(mode="json")
            at = {"item_id": item["id"], "output_index": state["index"] + k}
            opened = {**item, "arguments": "", "status": "in_progress"}
            tail.append(event("response.output_item.added", output_index=at["output_index"], item=opened))
            tail.append(event("response.function_call_arguments.delta", **at, delta=call.arguments))
            tail.append(event("response.function_call_arguments.done", **at, arguments=call.arguments))
            tail.append(event("response.output_item.done", output_index=at["output_index"], item=item))
        await run.store(answer, content, calls)
        kind = "response.incomplete" if answer.status == "incomplete" else "response.completed"
        tail.append(event(kind, response=answer.model_dump(mode="json")))
        yield Last("".join(tail))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the status line is gone; tell the client in the stream
        code = getattr(e, "code", "server_error")
        message = getattr(e, "message", "internal server error")
        yield Last(event("error", code=code, message=message, param=None))
    finally:
        await run.chat.completion.aclose()
        admission.release()
