"""``POST /v1/embeddings``: OpenAI's embeddings API, plus media. ``input`` is a string, a
list of strings, token ids or lists of token ids (as OpenAI takes), or, as an extension,
lists of chat content parts (text, image_url, input_audio, video_url) for multimodal
embeddings. ``pooling`` (extension): last (default), mean, max, cls."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from typing import Literal

import numpy as np
from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from api.http.deps import Service, get_service
from api.http.routes.chat import _turns
from api.http.schemas.chat import ChatMessage, ContentPart
from engine import POOLINGS, InvalidRequestError, embed_counted_async

router = APIRouter(tags=["embeddings"])
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    input: str | list[str | int | list[int] | list[ContentPart]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    pooling: str = "last"
    normalize: bool = True
    user: str | None = None


class EmbeddingItem(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage


def _items(value: object) -> list[object]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [value]  # one list of token ids
    if isinstance(value, list) and any(isinstance(v, int) for v in value):
        raise InvalidRequestError("input mixes token ids with other items; nest each id list", param="input")
    return list(value)  # type: ignore[arg-type]


@router.post(
    "/v1/embeddings",
    response_model=EmbeddingResponse,
    responses=Service.error_responses(400, 401, 404, 413, 415),
)
async def embeddings(body: EmbeddingRequest, service: Service = Depends(get_service)) -> EmbeddingResponse:
    return await embed_request(body, service)


async def embed_request(body: EmbeddingRequest, service: Service, *, admit: bool = True) -> EmbeddingResponse:
    """The embeddings of one request. The route takes an admission slot for the work; the
    Batch API's ``/v1/embeddings`` lines pass ``admit=False`` (a batch bounds its own
    concurrency)."""
    served = service.models.get(body.model, kind="chat")
    model = served.model
    if served.adapter is not None:
        raise InvalidRequestError(
            f"{served.name!r} is a LoRA adapter; embeddings come from base models (use {served.parent!r})",
            param="model",
        )
    if body.pooling not in POOLINGS:
        raise InvalidRequestError(f"pooling must be one of {', '.join(POOLINGS)}", param="pooling")
    items = _items(body.input)
    if not items or len(items) > MAX_INPUTS:
        raise InvalidRequestError(f"input takes 1..{MAX_INPUTS} items, got {len(items)}", param="input")
    if body.dimensions is not None and body.dimensions != model.arch.hidden_size:
        raise InvalidRequestError(
            f"dimensions must be the model's {model.arch.hidden_size} (no truncation here)",
            param="dimensions",
        )
    contents: list[object] = []
    for item in items:
        if isinstance(item, list) and item and not isinstance(item[0], int):
            turns = await _turns([ChatMessage(role="user", content=item)], service, set(model.media_kinds))
            contents.append(list(turns[0].parts))
        else:
            contents.append(item)
    with served.admit() if admit else contextlib.nullcontext():
        results = await asyncio.gather(
            *(embed_counted_async(model, c, pooling=body.pooling, normalize=body.normalize) for c in contents)
        )
    data = []
    for i, (vector, _rows) in enumerate(results):
        values = vector.numpy().astype(np.float32)
        embedding: list[float] | str = (
            base64.b64encode(values.tobytes()).decode()
            if body.encoding_format == "base64"
            else values.tolist()
        )
        data.append(EmbeddingItem(index=i, embedding=embedding))
    tokens = sum(rows for _, rows in results)
    return EmbeddingResponse(
        data=data, model=served.name, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    )
