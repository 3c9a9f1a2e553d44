"""The HTTP service as N engine replicas on Ray Serve (``pie-media serve --ray``).

Two deployments, as vLLM on Ray Serve lays them out (an OpenAI ingress in front of the
model servers):

- :class:`Engine` (``num_replicas=N``): each replica builds the service's own FastAPI app
  (``api.http.app.create_app``), runs its lifespan once (the models load once per
  replica) and serves whole HTTP requests handed to it as (ASGI scope, body), streaming
  the ASGI messages back. Its answers carry ``x-pie-media-replica``.
- :class:`Gateway` (the HTTP ingress, cheap): reads a request's body, takes its routing
  text (:func:`routing_text`: the model and the messages in order, media parts as
  digests) and passes it on. Routing is :class:`PrefixAffinityRouter`, cache-aware as
  SGLang's router is (:mod:`api.prefix_router`): a request goes to the replica that was
  already sent the longest prefix of its text, if that covers at least half of it and 64
  characters (about a KV page), and the replica has at most ``imbalance`` more requests
  in flight than the least loaded one; otherwise to the least loaded replica. So chats that share only a long system prompt
  meet on one replica, whose prefix cache computes it once. Requests without routing
  text get Ray Serve's default power-of-two-choices routing.

State is shared through the store (``--state-db postgresql://...`` and a state folder all
replicas see; without ``--state-db`` the SQLite files in the state folder are shared by
replicas on one machine), so ``pie-media://ID`` uploaded through one replica is read by
another, and batches and caption jobs are split between replicas by claims
(``api.http.stores.jobs``). A replica that dies: a request it had not started answering is
sent to another replica (twice at most); a stream it was answering ends with an SSE
``error`` event; Ray starts a new replica.

Compose your own app with :func:`build_app` (``serve.run(build_app(settings, replicas=4))``),
or call an :class:`Engine` from your own deployment: ``handle.options(stream=True)
.handle.remote(scope, body)`` yields ASGI messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from api.http.settings import ServeSettings
from api.prefix_router import PrefixRouter
from media.errors import PieMediaError

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from ray import serve  # noqa: E402
from ray.serve._private.request_router.pow_2_router import (  # noqa: E402  (Ray's default router)
    PowerOfTwoChoicesRequestRouter,
)
from ray.serve.config import RequestRouterConfig  # noqa: E402
from ray.serve.request_router import PendingRequest, RunningReplica  # noqa: E402

log = logging.getLogger("pie_media.serve_ray")

REPLICA_HEADER = "x-pie-media-replica"
PREFIX_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ROUTING_CHARS = 16_384
"""At most this many leading characters of a request's routing text reach the router."""
RETRIES = 2
"""A request whose replica died before answering is sent again this many times."""


class ReplicaFailedError(PieMediaError):
    """The replica serving a request stopped before it finished the answer."""

    code = "replica_failed"


_MEDIA_KEYS = ("image_url", "input_audio", "video_url", "audio_url")


def _render_parts(message: dict[str, Any]) -> str:
    """A message's content as routing text: its text parts as they are, each media part as
    ``\x01kind:sha256\x01`` (of its URL, ``pie-media://`` id or data: URL), so one image
    matches itself without its base64 filling the router's trees."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    out = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict):
            continue
        if isinstance(part.get("text"), str):
            out.append(part["text"])
            continue
        for kind in _MEDIA_KEYS:
            value = part.get(kind)
            if isinstance(value, dict):
                value = value.get("url") or value.get("data")
            if isinstance(value, str):
                out.append(f"\x01{kind}:{hashlib.sha256(value.encode()).hexdigest()}\x01")
                break
    return "".join(out)


def _render_messages(messages: list[Any]) -> str:
    return "".join(
        f"\0{m.get('role')}:{_render_parts(m)}" for m in messages if isinstance(m, dict) and "content" in m
    )


def _key_mark(scope: dict) -> str:
    """A short digest of the request's bearer key (never the key): the prefix trees keep each
    key's prefixes apart, as the engines' caches keep each tenant's pages apart."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            return hashlib.sha256(value).hexdigest()[:12] + "\0"
    return ""


def routing_text(path: str, body: bytes, limit: int = ROUTING_CHARS) -> str | None:
    """What a request's KV pages start with, as text the prefix router matches: the model,
    then the messages in order (role and content, media parts as digests), at most
    ``limit`` characters. For ``/v1/completions`` the prompt; for ``/v1/responses`` the
    instructions, then the input unless the request continues a stored conversation
    (whose start the router cannot see). None for other routes and bodies that are not
    such a request: those go to Ray Serve's power-of-two-choices."""
    if path not in PREFIX_PATHS:
        return None
    try:
        req = json.loads(body)
    except ValueError:
        return None
    if not isinstance(req, dict):
        return None
    text = ""
    if isinstance(req.get("messages"), list):
        text = _render_messages(req["messages"])
    elif isinstance(req.get("prompt"), str):
        text = "\0prompt:" + req["prompt"][:limit]
    elif path == "/v1/responses":
        if isinstance(req.get("instructions"), str):
            text = f"\0system:{req['instructions'][:limit]}"
        if req.get("previous_response_id") is None:
            if isinstance(req.get("input"), str):
                text += f"\0user:{req['input'][:limit]}"
            elif isinstance(req.get("input"), list):
                text += _render_messages(req["input"])
    if not text:
        return None
    return f"{req.get('model')}{text}"[:limit]


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Requests with a ``prefix`` (their :func:`routing_text`) go where
    :class:`api.prefix_router.PrefixRouter` says: the replica holding the longest prefix of
    it, unless that covers under ``threshold`` of it or the replica is ``imbalance``
    requests busier than the least loaded one (then the least loaded); the rest get
    power of two choices. Loads are Ray's per-replica queue-length cache (requests this
    router sent and has not seen finish, refreshed by the replicas' own counts)."""

    def initialize_state(
        self,
        threshold: float = 0.5,
        min_match: int = 64,
        imbalance: int = 4,
        max_chars: int = 1 << 20,
        **_: Any,
    ) -> None:
        self.prefixes = PrefixRouter(
            threshold=threshold, min_match=min_match, imbalance=imbalance, max_chars=max_chars
        )

    def _router(self) -> PrefixRouter:
        if not hasattr(self, "prefixes"):
            self.initialize_state()
        return self.prefixes

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        text = pending_request.kwargs.get("prefix") if pending_request is not None else None
        if text and candidate_replicas:
            by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
            cache = self.replica_queue_len_cache
            loads = {name: cache.get(r.replica_id) or 0 for name, r in by_name.items()}
            preferred = by_name[self._router().route(text, loads).replica]
            others = [r for r in candidate_replicas if r is not preferred]
            return [[preferred], others] if others else [[preferred]]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        # The preferred replica may have been full and the request gone to another.
        super().on_request_routed(pending_request, replica_id, result)
        text = pending_request.kwargs.get("prefix") if pending_request is not None else None
        if text:
            self._router().record(text, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._router().retain(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._router().retain(r.unique_id for r in self._replica_id_set)


async def _lifespan(app: Any, event: str, queue: asyncio.Queue, task_box: list) -> None:
    """Drive an ASGI app's lifespan: ``startup`` (the models load) or ``shutdown``."""
    done: asyncio.Queue = asyncio.Queue()
    if event == "startup":

        async def send(message: dict[str, Any]) -> None:
            await done.put(message)

        task_box.append(
            asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, queue.get, send))
        )
        task_box.append(done)
    await queue.put({"type": f"lifespan.{event}"})
    reply = await task_box[1].get()
    if reply["type"].endswith(".failed"):
        raise RuntimeError(f"the service's {event} failed: {reply.get('message', '')}")


class Engine:
    """One replica: the service's FastAPI app with its models loaded once."""

    async def __init__(self, settings: dict[str, Any]):
        from api.http.app import create_app
        from api.malloc_arenas import limit_malloc_arenas

        limit_malloc_arenas()  # as `pie-media serve` does, before the models load
        self.app = create_app(ServeSettings(**settings))
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self._lifespan_queue: asyncio.Queue = asyncio.Queue()
        self._lifespan: list[Any] = []
        await _lifespan(self.app, "startup", self._lifespan_queue, self._lifespan)
        log.info("replica %s ready (pid %d)", self.name, os.getpid())

    async def handle(
        self, scope: dict[str, Any], body: bytes, prefix: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Serve one HTTP request: the ASGI messages of its answer, as they come (``prefix``
        is for the router: :func:`routing_text`)."""
        out: asyncio.Queue = asyncio.Queue()
        sent_body = False
        end = object()

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # no disconnect until this call is cancelled
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.name.encode())]
                message = {**message, "headers": headers}
            await out.put(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await out.put(end)

        task = asyncio.create_task(run())
        try:
            while (message := await out.get()) is not end:
                yield message
            await task  # its exception, if any
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def replica_info(self) -> dict[str, Any]:
        """Which replica answered and its process id (for operators and tests)."""
        return {"replica": self.name, "pid": os.getpid()}

    async def check_health(self) -> None:
        if self._lifespan and self._lifespan[0].done():
            raise RuntimeError("the service's lifespan ended")

    async def __del__(self) -> None:
        if self._lifespan:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    _lifespan(self.app, "shutdown", self._lifespan_queue, self._lifespan), 30
                )


_SCOPE_KEYS = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "query_string",
    "root_path",
    "headers",
    "client",
    "server",
)


class Gateway:
    """The HTTP entry: reads each body, takes its routing text, passes both to an engine."""

    def __init__(self, engine: Any, max_body_bytes: int):
        self.engine = engine
        self.max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self) -> Any:
        return _Asgi(self)

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await _error(send, 413, "request_too_large", f"the body is over {self.max_body_bytes} bytes")
                return
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        plain = {k: _plain(scope[k]) for k in _SCOPE_KEYS if k in scope}
        prefix = routing_text(scope["path"], body)
        if prefix is not None:  # prefix pages are shared only within a key's tenant: one tree each
            prefix = _key_mark(scope) + prefix
        for attempt in range(RETRIES + 1):
            started, sse = False, False
            try:
                stream = self.engine.options(stream=True).handle.remote(plain, body, prefix=prefix)
                async for message in stream:
                    if message["type"] == "http.response.start":
                        started = True
                        sse = any(
                            k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                            for k, v in message.get("headers", [])
                        )
                    await send(message)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the replica died (or its call failed) mid-request
                if not started and attempt < RETRIES:
                    log.warning("request to a replica failed before answering (%s); trying another", e)
                    await asyncio.sleep(0.2 * (attempt + 1))
                    continue
                if not started:
                    await _error(send, 503, "replica_failed", f"no replica could answer: {type(e).__name__}")
                    return
                if not sse:
                    raise  # a half-sent plain body: the connection is cut, the client sees it
                err = ReplicaFailedError("the replica serving this stream stopped; send the request again")
                event = {"error": {"message": err.message, "type": "server_error", "code": err.code}}
                await send(
                    {
                        "type": "http.response.body",
                        "body": f"event: error\ndata: {json.dumps(event)}\n\n".encode(),
                        "more_body": False,
                    }
                )
                return


class _Asgi:
    """The gateway as an ASGI 3 app (what Ray Serve's ingress runs)."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.gateway.asgi(scope, receive, send)


def _plain(value: Any) -> Any:
    """Scope values a replica can unpickle without the proxy's objects."""
    if isinstance(value, tuple):
        return list(value)
    return value


async def _error(send: Any, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "server_error", "code": code}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def build_app(
    settings: ServeSettings,
    *,
    replicas: int = 2,
    cpus_per_replica: float = 0.0,
    gpus_per_replica: float = 0.0,
    max_ongoing_requests: int | None = None,
) -> Any:
    """The Ray Serve application: a :class:`Gateway` in front of ``replicas`` :class:`Engine`
    replicas (give each ``gpus_per_replica=1`` on a GPU cluster). Run it with
    ``serve.run(build_app(settings), route_prefix="/")``."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    # Replicas may start in another folder or on another machine: absolute paths, and
    # without --state-db the SQLite files are shared by the replicas of this machine.
    resolved = {k: v.resolve() for k, v in settings if isinstance(v, Path)}
    data = {**settings.model_dump(mode="json"), **{k: str(v) for k, v in resolved.items()}}
    data["models"] = [str(Path(m).resolve()) if Path(m).is_dir() else m for m in settings.models]
    data["shared_state"] = True
    engine = serve.deployment(
        Engine,
        name="PieMediaEngine",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests or settings.max_concurrency * max(1, len(settings.models)),
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_routing_stats_period_s=1.0
        ),
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
    )
    gateway = serve.deployment(
        serve.ingress()(Gateway),
        name="PieMediaGateway",
        num_replicas=1,
        max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0},
    )
    max_body = max(
        settings.max_job_upload_bytes,
        settings.max_batch_file_bytes,
        settings.max_upload_bytes * settings.max_upload_files,
    )
    return gateway.bind(engine.bind(data), max_body)


def run(settings: ServeSettings, *, address: str | None, replicas: int, log_level: str = "info") -> None:
    """Start (or join) Ray, serve :func:`build_app` on ``settings.host:port`` and block."""
    import ray

    ray.init(address=address or None, include_dashboard=False, logging_level=log_level.upper())
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build_app(settings, replicas=replicas), name="pie-media", route_prefix="/", blocking=True)
