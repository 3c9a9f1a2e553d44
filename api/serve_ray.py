"""The HTTP service as N engine replicas on Ray Serve (``pie-media serve --ray``).

Two deployments, as vLLM on Ray Serve lays them out (an OpenAI ingress in front of the
model servers):

- :class:`Engine` (``num_replicas=N``): each replica builds the service's own FastAPI app
  (``api.http.app.create_app``), runs its lifespan once (the models load once per
  replica) and serves whole HTTP requests handed to it as (ASGI scope, body), streaming
  the ASGI messages back. Its answers carry ``x-pie-media-replica``.
- :class:`Gateway` (the HTTP ingress, cheap): reads a request's body, computes its
  affinity key (:func:`affinity_key`: a hash of the model and the first content parts,
  e.g. the system prompt and the first image) and passes it on. Routing is
  :class:`PrefixAffinityRouter`: requests with a key go to the replica the key hashes to
  (rendezvous hashing, so a replica joining or dying moves only its own share) unless
  that replica has ``imbalance`` more requests in flight than the least loaded one;
  requests without a key, and overloaded ones, get Ray Serve's default power-of-two-
  choices routing (the less loaded of two random replicas).

State is shared through the store (``--state-db postgresql://...`` and a state folder all
replicas see; without ``--state-db`` the SQLite files in the state folder are shared by
replicas on one machine), so ``pie-media://ID`` uploaded through one replica is read by
another, and batches and caption jobs are split between replicas by claims
(``api.http.jobs_store``). A replica that dies: a request it had not started answering is
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
AFFINITY_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
AFFINITY_PARTS = 2
"""How many leading content parts name a request's prefix (system prompt + first media)."""
RETRIES = 2
"""A request whose replica died before answering is sent again this many times."""


class ReplicaFailedError(PieMediaError):
    """The replica serving a request stopped before it finished the answer."""

    code = "replica_failed"


def _parts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    out = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict):
            continue
        for key in ("text", "image_url", "input_audio", "video_url", "audio_url"):
            value = part.get(key)
            if isinstance(value, dict):
                value = value.get("url") or value.get("data")
            if isinstance(value, str):
                out.append(value)
                break
    return out


def affinity_key(path: str, body: bytes, parts: int = AFFINITY_PARTS) -> str | None:
    """The prefix a request's KV pages start with, hashed: the model and the first ``parts``
    content parts of its messages (a system prompt, an image URL or ``pie-media://`` id, a
    data: URL's bytes); None for other routes and bodies that are not a chat request."""
    if path not in AFFINITY_PATHS:
        return None
    try:
        req = json.loads(body)
    except ValueError:
        return None
    if not isinstance(req, dict):
        return None
    head: list[str] = []
    if isinstance(req.get("messages"), list):
        for message in req["messages"]:
            if isinstance(message, dict):
                head += [f"{message.get('role')}:{p}" for p in _parts(message)]
            if len(head) >= parts:
                break
    elif isinstance(req.get("prompt"), str):
        head = [req["prompt"][:4096]]
    elif path == "/v1/responses":
        # The instructions start every turn of a conversation; without them, the input
        # starts it unless it continues a stored one (whose start the router cannot see).
        if isinstance(req.get("instructions"), str):
            head = [f"system:{req['instructions']}"]
        elif req.get("previous_response_id") is None:
            if isinstance(req.get("input"), str):
                head = [f"user:{req['input']}"]
            elif isinstance(req.get("input"), list):
                for item in req["input"]:
                    if isinstance(item, dict) and "content" in item:
                        head += [f"{item.get('role')}:{p}" for p in _parts(item)]
                    if len(head) >= parts:
                        break
    if not head:
        return None
    h = hashlib.sha256(str(req.get("model")).encode())
    for p in head[:parts]:
        h.update(b"\0" + p.encode())
    return h.hexdigest()[:32]


def rendezvous(key: str, names: list[str]) -> str:
    """The name ``key`` goes to: highest hash of (key, name). Removing a name moves only
    the keys that went to it; adding one takes about 1/N of the keys."""
    return max(names, key=lambda n: hashlib.sha256(f"{key}\0{n}".encode()).digest())


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Requests with an ``affinity`` key go to the replica the key hashes to, unless it is
    ``imbalance`` requests busier than the least loaded one; else power of two choices."""

    imbalance = 4

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        if key and candidate_replicas:
            by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
            preferred = by_name[rendezvous(key, sorted(by_name))]
            cache = self.replica_queue_len_cache
            loads = {name: cache.get(r.replica_id) or 0 for name, r in by_name.items()}
            if loads[preferred.replica_id.unique_id] <= min(loads.values()) + self.imbalance:
                others = [r for r in candidate_replicas if r is not preferred]
                return [[preferred], others] if others else [[preferred]]
        return await super().choose_replicas(candidate_replicas, pending_request)


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
        self, scope: dict[str, Any], body: bytes, affinity: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Serve one HTTP request: the ASGI messages of its answer, as they come."""
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
    """The HTTP entry: reads each body, keys it for affinity, passes it to an engine."""

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
        key = affinity_key(scope["path"], body)
        for attempt in range(RETRIES + 1):
            started, sse = False, False
            try:
                stream = self.engine.options(stream=True).handle.remote(plain, body, affinity=key)
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
