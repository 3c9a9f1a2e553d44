"""Bodies of the inferlet endpoints (``/v1/inferlets``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class InferletObject(BaseModel):
    id: str
    object: Literal["inferlet"] = "inferlet"
    bytes: int
    created_at: int
    sha256: str


class InferletList(BaseModel):
    object: Literal["list"] = "list"
    data: list[InferletObject]


class InferletDeleted(BaseModel):
    id: str
    object: Literal["inferlet"] = "inferlet"
    deleted: bool


class RunLimitsRequest(BaseModel):
    """Tighter budgets for one run; each is capped by the server's own."""

    model_config = ConfigDict(extra="forbid")
    wall_s: float | None = Field(default=None, gt=0)
    fuel: int | None = Field(default=None, ge=1)
    memory_bytes: int | None = Field(default=None, ge=1 << 20)
    max_handles: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    args: list[str] = Field(default_factory=list, max_length=256)
    input: dict[str, Any] | None = None
    """For a component of Pie 0.4.0's world: its input object (what Pie's client sends; the
    component gets it as its one JSON argument). Not with ``args``."""
    stream: bool = False
    """SSE: a ``send`` event per message the inferlet sends, then ``result`` or ``error``."""
    background: bool = False
    """Answer at once (202) with the run; poll ``GET .../runs/{run_id}`` for its end."""
    messages: list[str] = Field(default_factory=list, max_length=1024)
    """Queued for the inferlet's ``receive()`` before it starts."""
    close_input: bool = True
    """No messages after ``messages`` (``receive()`` then returns none); false keeps the
    input open for ``POST .../runs/{run_id}/messages``."""
    limits: RunLimitsRequest | None = None


class MessageRequest(BaseModel):
    text: str | None = None
    """A message for the run's ``receive()``; null closes its input."""


class RunError(BaseModel):
    code: str
    message: str
    model_config = ConfigDict(extra="allow")


class RunObject(BaseModel):
    id: str
    object: Literal["inferlet.run"] = "inferlet.run"
    inferlet_id: str
    args: list[str]
    status: Literal["running", "succeeded", "failed", "cancelled"]
    created_at: int
    finished_at: int | None = None
    result: str | None = None
    error: RunError | None = None
    sends: list[str] = Field(default_factory=list)
    origin: Literal["http", "pie"] = "http"
    """Who launched it: ``/v1/inferlets`` or Pie's protocol (the WebSocket at ``/``)."""

    @classmethod
    def of(cls, rec: Any) -> RunObject:
        return cls(
            id=rec.id,
            inferlet_id=rec.inferlet_id,
            args=rec.args,
            status=rec.status,
            created_at=rec.created_at,
            finished_at=rec.finished_at,
            result=rec.result,
            error=rec.error,
            sends=list(rec.sends),
            origin=getattr(rec, "origin", "http"),
        )


class RunList(BaseModel):
    object: Literal["list"] = "list"
    data: list[RunObject]
