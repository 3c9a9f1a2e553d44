"""``POST /v1/captions``: multipart images + prompt -> a caption or a typed error per file,
all files generating together through the model's one scheduler."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request

from api.http.deps import Service, get_service, multipart_body, receive_upload
from api.http.disconnect import cancel_on_disconnect
from api.http.schemas.chat import CaptionResponse, CaptionResult, Usage
from engine import Completion, CompletionParams, InvalidRequestError, Turn
from engine.caption import DEFAULT_PROMPT
from media import PieMediaError, open_media

router = APIRouter(tags=["captions"])


def _int_field(fields: dict[str, str], name: str, default: int, limit: int) -> int:
    raw = fields.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequestError(f"{name} must be an integer, got {raw[:32]!r}", param=name) from None
    if not 1 <= value <= limit:
        raise InvalidRequestError(f"{name} must be in 1..{limit}, got {value}", param=name, limit=limit)
    return value


@router.post(
    "/v1/captions",
    response_model=CaptionResponse,
    responses=Service.error_responses(400, 401, 404, 413, 429),
    openapi_extra=multipart_body(model="string", prompt="string", max_tokens="integer"),
)
async def captions(request: Request, service: Service = Depends(get_service)) -> CaptionResponse:
    form = await receive_upload(request, service)
    try:
        chat = service.models.of_kind("chat")
        name = form.fields.get("model") or (chat[0].name if chat else "")
        served = service.models.get(name, kind="chat", adapters=False)
        prompt = form.fields.get("prompt") or DEFAULT_PROMPT
        max_tokens = _int_field(form.fields, "max_tokens", 64, service.settings.max_tokens_limit)
        with served.admit():
            return await cancel_on_disconnect(
                request, _caption_all(service, served, form.files, prompt, max_tokens)
            )
    finally:
        form.cleanup()


async def _caption_one(service: Service, model: Any, f: Any, prompt: str, max_tokens: int) -> CaptionResult:
    try:
        data = await asyncio.to_thread(f.path.read_bytes)
        image = await asyncio.to_thread(open_media, data, service.media.limits, "image")
        async with Completion(
            model, [Turn("user", (image, prompt))], CompletionParams(max_tokens=max_tokens)
        ) as c:
            text = "".join([ev.text async for ev in c])
            done = sum(c.completion_tokens)
            usage = Usage(
                prompt_tokens=c.prompt_tokens, completion_tokens=done, total_tokens=c.prompt_tokens + done
            )
        return CaptionResult(filename=f.filename, caption=text, usage=usage)
    except PieMediaError as e:
        service.metrics.media_errors.labels(e.code).inc()
        return CaptionResult(filename=f.filename, error=e.to_dict())


async def _caption_all(
    service: Service, served: Any, files: list[Any], prompt: str, max_tokens: int
) -> CaptionResponse:
    results = await asyncio.gather(
        *(_caption_one(service, served.model, f, prompt, max_tokens) for f in files)
    )
    return CaptionResponse(model=served.name, data=list(results))
