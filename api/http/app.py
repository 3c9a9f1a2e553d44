"""``create_app(settings)``: the FastAPI app. Models load once in the lifespan; every
route reaches them through ``app.state.service``."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi_offline import FastAPIOffline
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.http import pie_protocol
from api.http.deps import Service
from api.http.errors import install_error_handlers
from api.http.media_refs import MediaResolver
from api.http.metrics import ServiceMetrics
from api.http.openapi import install_openapi
from api.http.registry import ModelRegistry, ServedModel, add_lora_modules
from api.http.routes import ROUTERS, batches, health, ui
from api.http.routes.media import token_counts
from api.http.runs.inferlets import RunTable
from api.http.runs.jobs import JobRunner
from api.http.security.audit import configure_audit_log
from api.http.security.key_limits import KeyLimitsMiddleware
from api.http.security.keys import ApiKeys, LocalMediaPolicy, MediaFetcher, admin_only, bearer_auth
from api.http.settings import ServeSettings
from api.http.stores.files import FileStore
from api.http.stores.index_open import open_index
from api.http.stores.inferlets import InferletStore
from api.http.stores.jobs import JobStore
from api.http.stores.responses import ResponseStore
from api.http.stores.uploads import MediaStore
from api.http.warmup import warm_uploads
from engine import freeze_startup_heap, unfreeze_startup_heap
from inferlets import InferletRuntime, RunLimits
from media import DEFAULT_LIMITS
from speech import SpeechModel

log = logging.getLogger("pie_media.http")

ModelLoader = Callable[[str], Any]


class _RequestMetrics:
    """Counts every response by route template, method and status (pure ASGI, so
    streaming responses are counted when they start, without buffering)."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], ServiceMetrics | None]):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                m = self.metrics()
                if m is not None:
                    route = scope.get("route")
                    path = getattr(route, "path", "unmatched")
                    m.requests.labels(path, scope["method"], str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_wrapper)


def _announce_tenancy(keys: ApiKeys, settings: ServeSettings, store: MediaStore) -> None:
    """Say once at start-up how keys isolate, and that state from before belongs to admins."""
    if not keys.enabled:
        return
    legacy = store.legacy_count()
    if legacy:
        log.warning(
            "%d uploads (and any files, jobs, batches, responses) stored before keys isolated belong "
            "to the admin role: only admin keys see them",
            legacy,
        )
    if not keys.has_admin:
        log.warning(
            "%r: no admin key, so /metrics takes any key; name an admin in a TOML/JSON key file to "
            "keep it to operators",
            keys,
        )
    else:
        log.info("%r; stored objects are isolated per tenant", keys)


def _install_key_reload(keys: ApiKeys) -> Callable[[], None]:
    """SIGHUP re-reads the key file (a removed key stops working at once); returns the undo.
    Only the main thread's loop can take a signal handler (uvicorn's); elsewhere, nothing."""
    import signal

    def reload() -> None:
        try:
            keys.reload()
            log.info("keys reloaded on SIGHUP: %r", keys)
        except (OSError, ValueError) as e:
            log.error("SIGHUP: the key file could not be read, the old keys stay: %s", e)

    try:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, reload)
    except (RuntimeError, NotImplementedError, ValueError):
        return lambda: None
    return lambda: loop.remove_signal_handler(signal.SIGHUP)


def _served_name(ref: str, model: Any) -> str:
    return str(getattr(model, "name", None) or ref)


def create_app(settings: ServeSettings, *, loader: ModelLoader | None = None) -> FastAPI:
    """The app for ``settings``. ``loader(ref)`` loads one model reference (default:
    ``api.model_ref.load_model``, which also resolves the tiny fixture names)."""
    if loader is None:
        from api.model_ref import load_model

        def loader(ref: str) -> Any:
            return load_model(ref, **settings.model_load_options())

    keys = ApiKeys.from_sources(settings.api_key_file)
    configure_audit_log(settings.audit_log)
    registry = ModelRegistry()

    def index(sqlite_path: Any) -> Any:  # SQLite beside the store, or the shared database
        return open_index(settings.state_db, sqlite_path, shared=settings.shared_state)

    store = MediaStore(settings.media_dir, index=index(settings.media_dir / "media.sqlite3"))
    limits = DEFAULT_LIMITS
    fetcher = MediaFetcher(
        allowed_domains=settings.allowed_media_domains or None,
        allow_http=settings.allow_http_media,
        allow_private_networks=settings.allow_private_media_networks,
        max_bytes=limits.max_bytes,
        connect_timeout=settings.media_fetch_connect_timeout_s,
        total_timeout=settings.media_fetch_timeout_s,
    )
    local = LocalMediaPolicy(settings.allowed_local_media_path, max_bytes=limits.max_bytes)
    jobs = JobStore(settings.state_dir / "jobs.sqlite3", index=index(settings.state_dir / "jobs.sqlite3"))
    resolver = MediaResolver(
        store, fetcher, local, limits, decoded_cache_bytes=settings.decoded_media_cache_mib << 20
    )
    runs = RunTable(max_running=settings.max_inferlet_runs)
    service = Service(
        settings=settings,
        models=registry,
        store=store,
        media=resolver,
        metrics=ServiceMetrics(
            registry, decoded_cache_bytes=lambda: resolver.decoded.nbytes, inferlet_runs=lambda: runs.running
        ),
        jobs=jobs,
        job_runner=JobRunner(
            jobs, store, registry, resolver, lease_s=settings.job_lease_s, poll_s=settings.job_poll_s
        ),
        files=FileStore(settings.state_dir, index=index(settings.state_dir / "files.sqlite3")),
        responses=ResponseStore(
            settings.state_dir / "responses.sqlite3", index=index(settings.state_dir / "responses.sqlite3")
        ),
        inferlet_store=InferletStore(settings.state_dir),
        inferlet_runs=runs,
    )
    service.job_runner.share_caches = settings.share_prefix_cache
    service.job_runner.batch_line = functools.partial(batches.run_line, service)
    service.job_runner.on_batch_done = functools.partial(batches.write_outputs, service)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        names = settings.served_model_names
        if names and len(names) != len(settings.models):
            raise ValueError(
                f"{len(names)} --served-model-name for {len(settings.models)} --model; give one per model"
            )
        for i, ref in enumerate(settings.models):
            model = await asyncio.to_thread(loader, ref)
            kind = "speech" if isinstance(model, SpeechModel) else "chat"
            name = names[i] if names else _served_name(ref, model)
            registry.add(
                ServedModel(name=name, model=model, kind=kind, max_concurrency=settings.max_concurrency)
            )
            log.info("loaded %s as %r (%s)", ref, name, kind)
        await asyncio.to_thread(add_lora_modules, registry, settings.lora_modules, settings.max_concurrency)
        service.inferlets = InferletRuntime(
            {m.name: m.model for m in registry if m.adapter is None},
            settings.inferlet_cache_dir or settings.state_dir,
            limits=RunLimits(wall_s=settings.inferlet_wall_s),
        )
        # Every path an upload takes, run once now: /ready means the first upload is as
        # quick as the next (api/http/warmup.py).
        await asyncio.to_thread(warm_uploads, functools.partial(token_counts, service), resolver.limits)
        registry.ready = True
        _announce_tenancy(keys, settings, store)
        reload_keys = _install_key_reload(keys)
        await service.job_runner.resume_all()  # jobs a killed server left unfinished
        frozen = freeze_startup_heap()  # the loaded heap out of the GC's walks (startup_heap.py)
        log.info("startup heap frozen: %d objects the garbage collector will skip", frozen)
        yield
        registry.ready = False
        reload_keys()
        unfreeze_startup_heap()
        proto = getattr(app.state, "pie_protocol", None)
        if proto is not None:
            await asyncio.to_thread(proto.daemons.close)
        await service.inferlet_runs.shutdown()
        await service.job_runner.shutdown()

    app = FastAPIOffline(
        title="pie-media",
        version="0.1.0",
        description="Images, audio and video in; text and speech out. OpenAI-compatible where OpenAI has a shape.",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.keys = keys
    app.state.operator_check = admin_only(keys, open_to_keys=settings.metrics_open)
    install_error_handlers(app, on_error=lambda code: service.metrics.media_errors.labels(code).inc())
    install_openapi(app, Service.error_responses(400)[400]["description"])  # 400, not FastAPI's 422
    auth = [Depends(bearer_auth(keys, share_caches=settings.share_prefix_cache))] if keys.enabled else []
    app.include_router(health.router)
    app.include_router(ui.router)  # the static page; its API calls carry the key
    app.include_router(pie_protocol.router)  # Pie's client at ws://HOST:PORT/ (signs in itself)
    for r in ROUTERS:
        app.include_router(r, dependencies=auth)
    app.add_middleware(_RequestMetrics, metrics=lambda: service.metrics)
    if keys.enabled:
        m = service.metrics
        app.add_middleware(
            KeyLimitsMiddleware,
            identify=keys.identify,
            limiter=service.key_limits,
            on_request=lambda caller: m.key_requests.labels(caller.name).inc(),
            on_limited=lambda caller, code: m.key_limited.labels(caller.name, code).inc(),
        )
    return app
