"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): what a prompt costs in tokens
before sending it, media included. A chat's ``messages`` (with ``tools``) are rendered by
the template and their media prepared exactly as ``/v1/chat/completions`` would (each
image, audio clip or video counted as its placeholder rows), with nothing computed; a raw
``prompt`` is tokenized as ``/v1/completions`` tokenizes it."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from api.http.deps import Service, get_service
from api.http.routes.chat import _turns
from api.http.schemas.chat import MAX_MESSAGES, ChatMessage, ToolDef
from engine import Completion, CompletionParams, InvalidRequestError

router = APIRouter(tags=["tokenize"])
MAX_DETOKENIZE = 1 << 20


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    """A raw prompt only: with the tokenizer's special tokens (its BOS), as /v1/completions."""
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post(
    "/tokenize", response_model=TokenizeResponse, responses=Service.error_responses(400, 401, 404, 415)
)
async def tokenize(body: TokenizeRequest, service: Service = Depends(get_service)) -> TokenizeResponse:
    served = service.models.get(body.model, kind="chat")
    model = served.model
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give either prompt or messages", param="prompt")
    if body.prompt is not None:
        if body.add_special_tokens:
            ids = await Completion.from_prompt(model, body.prompt, CompletionParams()).prompt_token_ids()
        else:
            ids = await asyncio.to_thread(model.tokenize, body.prompt)
    else:
        assert body.messages is not None
        turns = await _turns(body.messages, service, set(model.media_kinds))
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        completion = Completion(model, turns, CompletionParams(), tools=tools)
        ids = await completion.prompt_token_ids(cue=body.add_generation_prompt)
    strs = model.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids, token_strs=strs)


@router.post(
    "/detokenize", response_model=DetokenizeResponse, responses=Service.error_responses(400, 401, 404)
)
async def detokenize(body: DetokenizeRequest, service: Service = Depends(get_service)) -> DetokenizeResponse:
    model = service.models.get(body.model, kind="chat").model
    vocab = model.arch.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    return DetokenizeResponse(prompt=model.detokenize(body.tokens))
