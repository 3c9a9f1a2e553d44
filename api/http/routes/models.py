"""``GET /v1/models``: the served models (OpenAI's list shape, plus kind and media)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api.http.deps import Service, get_service
from api.http.registry import ServedModel
from api.http.schemas.chat import ModelCard, ModelList

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList, responses=Service.error_responses(401))
async def list_models(service: Service = Depends(get_service)) -> ModelList:
    return ModelList(data=[_card(m) for m in service.models])


@router.get("/v1/models/{name}", response_model=ModelCard, responses=Service.error_responses(401, 404))
async def get_model(name: str, service: Service = Depends(get_service)) -> ModelCard:
    return _card(service.models.get(name))


def _card(m: ServedModel) -> ModelCard:
    return ModelCard(
        id=m.name,
        created=m.created,
        kind=m.kind,
        architecture=m.architecture,
        media_kinds=m.media_kinds,
        parent=m.parent,
        max_model_len=getattr(m.model, "max_model_len", None) if m.kind == "chat" else None,
    )
