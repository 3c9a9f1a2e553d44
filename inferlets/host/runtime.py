"""wasmtime host: one Engine per process, compiled components cached on disk by content
hash, one Store per run with memory, fuel, epoch and handle limits."""

from __future__ import annotations

import asyncio
import codecs
import contextvars
import functools
import hashlib
import importlib.metadata
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import wasmtime
from wasmtime import component as wc
from wasmtime.component import ResourceHost

from inferlets.host import output_capture
from inferlets.host import wit_values as wv
from inferlets.host.control import InferletRun
from inferlets.host.errors import (
    InferletCancelledError,
    InferletError,
    InferletFailedError,
    InferletTimeoutError,
    InferletTrapError,
    InvalidComponentError,
)
from inferlets.host.iface_context import ContextCalls
from inferlets.host.iface_media import MediaCalls
from inferlets.host.iface_runtime import ModelCalls, RuntimeCalls
from inferlets.host.iface_speech import SpeechCalls
from inferlets.host.limits import RunLimits
from inferlets.host.output_capture import OutputCapture
from inferlets.host.pie_world import (
    PieHost,
    check_imports,
    extern_type,
    handler_export,
    is_daemon,
    is_pie_world,
    link_pie_world,
    plan_pie_world,
    run_export,
)
from inferlets.host.state import RunState
from inferlets.host.typed_funcs import add_typed_func, typed_codecs
from inferlets.host.value_codec import Lift, Lower
from inferlets.host.wasi.http import HttpExchange, IncomingRequest, ResponseOutparam
from inferlets.host.wasmtime_slab import install as _install_thread_safe_slabs
from media import cache_scope, use_cache_scope
from media.errors import PieMediaError

PACKAGE = "pie:media"
VERSION = "0.1.0"
INTERFACES: dict[str, type] = {
    "runtime": RuntimeCalls,
    "models": ModelCalls,
    "context": ContextCalls,
    "media": MediaCalls,
    "speech": SpeechCalls,
}
EPOCH_TICK_S = 0.01
log = logging.getLogger("inferlets.host")
_WASMTIME = importlib.metadata.version("wasmtime")
_install_thread_safe_slabs()


class _Ticker:
    """Increments the engine's epoch every EPOCH_TICK_S on a daemon thread while a run holds
    it (``with ticker:``). With no run in flight the thread sleeps on a condition: ticking
    all the time woke it, and took the GIL, 100 times a second in every server process,
    inferlets or not. A store's deadline counts ticks from when it is set, inside the hold."""

    def __init__(self, engine: wasmtime.Engine):
        self.engine = engine
        self.ticks = 0
        self._runs = 0
        self._cond = threading.Condition()
        threading.Thread(target=self._tick, daemon=True, name="inferlet-epoch").start()

    def __enter__(self) -> _Ticker:
        with self._cond:
            self._runs += 1
            self._cond.notify()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._runs -= 1

    def _tick(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._runs > 0)
            time.sleep(EPOCH_TICK_S)
            self.engine.increment_epoch()
            self.ticks += 1


def _host_func(
    run: RunState, fn: Callable[..., Any], tagged: bool, returns_result: bool
) -> Callable[..., Any]:
    """A linker function: checks the run's budgets, calls ``fn``, and lowers any failure to
    the WIT ``error`` record (no exception ever reaches wasmtime: a host call cannot crash
    the host)."""
    if not returns_result:
        return lambda store, *a: fn(*a)

    def call(store: Any, *a: Any) -> Any:
        try:
            run.check()
            return wv.ok(fn(*a), tagged)
        except PieMediaError as e:
            rec = wv.error(e.code, e.message, wv.error_kind(e))
        except Exception as e:  # noqa: BLE001 - reported to the guest as a typed error
            log.exception("inferlet host call %s failed", getattr(fn, "__name__", fn))
            rec = wv.error("inferlet_host_error", f"{type(e).__name__}: {e}", "host")
        return wv.err(rec, tagged)

    return call


class InferletRuntime:
    """Compiles/caches components and runs them against already-loaded models."""

    def __init__(
        self,
        models: Mapping[str, Any],
        cache_dir: Path,
        *,
        limits: RunLimits | None = None,
        max_concurrent_runs: int = 64,
    ):
        cfg = wasmtime.Config()
        cfg.consume_fuel = True
        cfg.epoch_interruption = True
        self.engine = wasmtime.Engine(cfg)
        self._ticker = _Ticker(self.engine)
        self.models = dict(models)
        self.cache_dir = Path(cache_dir) / "inferlets"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.limits = limits or RunLimits()
        self._components: dict[str, wc.Component] = {}
        self._worlds: dict[str, bool] = {}
        self._file_keys: dict[tuple[str, int, int], str] = {}
        self._plans: dict[int, tuple[wc.Component, Any]] = {}  # id -> (component, its link plan)
        self._lock = threading.Lock()
        # Guests spend most of their time waiting on host calls: one thread each, more than
        # asyncio's default executor gives (cores + 4), so concurrent runs batch together.
        self._threads = ThreadPoolExecutor(max_workers=max_concurrent_runs, thread_name_prefix="inferlet")

    def __repr__(self) -> str:
        return f"InferletRuntime(models={sorted(self.models)}, cache={str(self.cache_dir)!r})"

    def component(self, wasm: bytes | Path) -> tuple[str, wc.Component]:
        """(content hash, compiled component); compiled once, then deserialized from disk. A
        file's hash is remembered by (path, size, mtime): a launch does not re-read and hash
        a 21 MB component it has seen (bench/pie_protocol.py found that the launch's largest
        cost)."""
        if isinstance(wasm, str | Path):
            st = os.stat(wasm)
            stamp = (str(wasm), st.st_size, st.st_mtime_ns)
            key = self._file_keys.get(stamp)
            if key is not None and key in self._components:
                return key, self._components[key]
            data = Path(wasm).read_bytes()
            key = hashlib.sha256(data).hexdigest()[:32]
            self._file_keys[stamp] = key
        else:
            data = wasm
            key = hashlib.sha256(data).hexdigest()[:32]
        with self._lock:
            if key in self._components:
                return key, self._components[key]
            path = self.cache_dir / f"{key}-{_WASMTIME}.cwasm"
            if path.exists():
                comp = wc.Component.deserialize_file(self.engine, str(path))
            else:
                try:
                    comp = wc.Component(self.engine, data)
                except wasmtime.WasmtimeError as e:
                    raise InvalidComponentError("not a WebAssembly component", detail=str(e)[:200]) from None
                tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
                tmp.write_bytes(comp.serialize())
                tmp.replace(path)
            self._components[key] = comp
            return key, comp

    def check_component(self, wasm: bytes | Path) -> str:
        """Compile (cached) and check a component is one this host runs; its world's name:
        ``"pie"`` (Pie 0.4.0's world: every import one this host serves, a ``<pkg>/run``
        export), ``"pie-daemon"`` (Pie's imports, ``wasi:http/incoming-handler`` exported:
        ``serve_http``) or ``"pie:media"`` (this project's own world: its imports, a ``run``
        export). ``InvalidComponentError`` names what does not fit."""
        key, comp = self.component(wasm)
        imports = list(comp.type.imports(self.engine))
        exports = list(comp.type.exports(self.engine))
        if self.is_pie_world(wasm):
            check_imports(self.engine, comp)
            if is_daemon(self.engine, comp):
                return "pie-daemon"
            if not any(e.split("@", 1)[0].endswith("/run") for e in exports):
                raise InvalidComponentError(
                    "the component exports no <package>/run interface (Pie's run entry point) "
                    "and no wasi:http/incoming-handler (a daemon's)"
                )
            return "pie"
        foreign = sorted(i for i in imports if i.startswith("pie:") and not i.startswith(f"{PACKAGE}/"))
        if foreign:
            raise InvalidComponentError(
                f"the component imports {', '.join(foreign[:4])}, which neither world this host serves "
                f"(Pie 0.4.0's pie:core/instruct/mcp/zo, pie-media's {PACKAGE}@{VERSION}) has",
                interface=foreign[0],
            )
        if "run" not in exports:
            raise InvalidComponentError(f"the component exports no run function (world {PACKAGE}/inferlet)")
        return PACKAGE

    def is_pie_world(self, wasm: bytes | Path) -> bool:
        """Whether the component is of Pie 0.4.0's world (it takes one input JSON string)
        rather than pie-media's own ``pie:media`` world (a list of arguments)."""
        key, comp = self.component(wasm)
        found = self._worlds.get(key)
        if found is None:
            found = self._worlds[key] = is_pie_world(self.engine, comp)
        return found

    def run(
        self,
        wasm: bytes | Path,
        args: list[str],
        *,
        loop: asyncio.AbstractEventLoop,
        on_send: Callable[[str], None] | None = None,
        limits: RunLimits | None = None,
        control: InferletRun | None = None,
        on_output: Callable[[str, str], None] | None = None,
        on_file: Callable[[bytes], None] | None = None,
    ) -> str:
        """Run to completion on this (worker) thread; engine calls go to ``loop`` (which
        must be running on another thread). Returns the guest's result or raises a typed
        InferletError; however the run ends, its contexts are closed (pages back to the
        pool) and its media and streams released. ``control``: messages for the guest's
        ``receive`` and ``cancel()`` (see ``InferletRun``). ``on_output(stream, text)``: what
        the guest writes to WASI stdout / stderr ("stdout" / "stderr", decoded as UTF-8 on
        this thread as it comes; without it both are dropped). ``on_file(data)``: a file the
        guest sends (Pie's ``session.send-file``; kept as ``state.on_file``, None: dropped)."""
        _, comp = self.component(wasm)
        state = RunState(self.models, loop, args, on_send or (lambda s: None), limits or self.limits, control)
        state.on_output = on_output
        state.on_file = on_file
        state.on_file = on_file
        # Host calls hop to the loop with this thread's context (call_soon_threadsafe copies
        # it): the run's contexts key their caches under its caller's scope.
        scope = control.cache_scope if control is not None else cache_scope()
        try:
            with use_cache_scope(scope):
                return self._execute(state, comp)
        finally:
            state.flush_output()
            state.close()

    def serve_http(
        self,
        wasm: bytes | Path,
        exchange: HttpExchange,
        *,
        loop: asyncio.AbstractEventLoop,
        limits: RunLimits | None = None,
        control: InferletRun | None = None,
        on_output: Callable[[str, str], None] | None = None,
    ) -> None:
        """Serve one HTTP request with a fresh instance of a daemon component (one that
        exports ``wasi:http/incoming-handler``), as Pie does: on this (worker) thread, engine
        calls on ``loop``, under the run's limits. The response goes out through
        ``exchange``'s callbacks as the guest writes it; ``exchange.end`` is called however
        the request ends (with why, when it failed: a guest that never set a response gets
        a 500 saying so)."""
        _, comp = self.component(wasm)
        state = RunState(self.models, loop, [], lambda s: None, limits or self.limits, control)
        state.on_output = on_output
        scope = control.cache_scope if control is not None else cache_scope()
        failed: str | None = None
        try:
            with use_cache_scope(scope), self._ticker:
                self._execute_daemon(state, comp, exchange)
        except Exception as e:
            failed = getattr(e, "message", None) or str(e) or type(e).__name__
            raise
        finally:
            state.flush_output()
            state.close()
            if not exchange.answered:
                exchange.answered = True
                why = failed or "the daemon returned without setting a response (response-outparam.set)"
                exchange.on_head(500, [("content-type", b"text/plain; charset=utf-8")])
                exchange.on_body(f"{why}\n".encode())
                exchange.end(None)
            else:
                exchange.end(failed)

    def _pie_world_run(
        self, state: RunState, comp: wc.Component
    ) -> tuple[PieHost, wasmtime.Store, wc.Linker]:
        """A Pie-world run's host, store and linker (both closed if the link fails)."""
        state.pie = host = self._pie_host(state)
        store = self._store(state.limits)
        store.set_wasi(wasmtime.WasiConfig())
        try:
            plan = self._link_plan(comp, lambda c: plan_pie_world(self.engine, c))
            return host, store, link_pie_world(self.engine, plan, host)
        except BaseException:
            host.close()
            store.close()
            raise

    def _execute_daemon(self, state: RunState, comp: wc.Component, exchange: HttpExchange) -> None:
        host, store, linker = self._pie_world_run(state, comp)

        def start(instance: Any, store: wasmtime.Store) -> Any:
            handle = handler_export(instance, store, comp, self.engine)
            request = host.table.own(IncomingRequest(exchange))
            response_out = host.table.own(ResponseOutparam(exchange))
            return handle(
                store,
                ResourceHost.own(request.rep, request.type_id),
                ResourceHost.own(response_out.rep, response_out.type_id),
            )

        self._instantiate_and_run(
            state, host, store, linker, comp, "a Pie daemon (wasi:http/incoming-handler)", start
        )
        _check_ended(state)

    @property
    def threads(self) -> ThreadPoolExecutor:
        """The worker threads runs and daemon requests run on (``max_concurrent_runs``)."""
        return self._threads

    def is_daemon(self, wasm: bytes | Path) -> bool:
        """Whether the component exports ``wasi:http/incoming-handler`` (served by
        ``launch_daemon``, a request at a time) rather than a run entry point."""
        _, comp = self.component(wasm)
        return is_daemon(self.engine, comp)

    async def run_async(self, wasm: bytes | Path, args: list[str], **kw: Any) -> str:
        """Run on a worker thread; host calls come back to the running loop. Keywords as
        ``run`` (``on_send``, ``limits``, ``control``, ``on_output``, ``on_file``)."""
        loop = asyncio.get_running_loop()
        call = functools.partial(self.run, wasm, args, loop=loop, **kw)
        # in the caller's context (run_in_executor would start from an empty one): its cache scope
        return await loop.run_in_executor(self._threads, contextvars.copy_context().run, call)

    def _link_plan(self, comp: wc.Component, make: Callable[[wc.Component], Any]) -> Any:
        """``make(comp)``, worked out on the component's first run and kept with it."""
        got = self._plans.get(id(comp))
        if got is None or got[0] is not comp:
            with self._lock:
                got = self._plans.get(id(comp))
                if got is None or got[0] is not comp:
                    got = self._plans[id(comp)] = (comp, make(comp))
        return got[1]

    def _legacy_plan(self, comp: wc.Component) -> dict[tuple[str, str], tuple[list[Lift], Lower | None]]:
        """(interface, function) -> the conversions of each function the component imports
        from this host's own world (``typed_codecs``)."""
        plan: dict[tuple[str, str], tuple[list[Lift], Lower | None]] = {}
        imports = comp.type.imports(self.engine)
        for name in INTERFACES:
            item = imports.get(f"{PACKAGE}/{name}@{VERSION}")
            if item is None:
                continue
            for fname, t in extern_type(item).exports(self.engine).items():
                t = extern_type(t)
                if isinstance(t, wc.FuncType):
                    plan[(name, fname)] = typed_codecs(t)
        return plan

    def _linker(self, state: RunState, comp: wc.Component) -> wc.Linker:
        plan = self._link_plan(comp, self._legacy_plan)
        linker = wc.Linker(self.engine)
        linker.add_wasip2()
        with linker.root() as root:
            with root.add_instance(f"{PACKAGE}/types@{VERSION}"):
                pass
            for name, cls in INTERFACES.items():
                calls = cls(state)
                with root.add_instance(f"{PACKAGE}/{name}@{VERSION}") as inst:
                    for wit_name, (method, tagged, returns_result) in cls.FUNCS.items():
                        codecs = plan.get((name, wit_name))
                        if codecs is None:
                            continue  # not imported by this component
                        fn = _host_func(state, getattr(calls, method), tagged, returns_result)
                        add_typed_func(inst, wit_name, fn, *codecs)
        return linker

    def _execute(self, state: RunState, comp: wc.Component) -> str:
        with self._ticker:
            return self._execute_ticked(state, comp)

    def _execute_ticked(self, state: RunState, comp: wc.Component) -> str:
        if is_pie_world(self.engine, comp):
            return self._execute_pie(state, comp)
        state.pie = host = self._pie_host(state)
        store = self._store(state.limits)
        wasi = wasmtime.WasiConfig()
        capture: OutputCapture | None = None
        try:
            if state.on_output is not None:
                if output_capture.available():
                    capture = OutputCapture(state.output)
                    capture.configure(wasi)
                    state.output_source = capture.drain
                else:
                    wasi.stdout_custom = _output_writer("stdout", state.output)
                    wasi.stderr_custom = _output_writer("stderr", state.output)
            store.set_wasi(wasi)
            linker = self._linker(state, comp)
        except BaseException:
            if capture is not None:
                capture.close()
            host.close()
            store.close()
            raise
        try:
            out = self._instantiate_and_run(
                state,
                host,
                store,
                linker,
                comp,
                "this host's world (pie:media/inferlet)",
                self._legacy_run,
            )
        finally:
            if capture is not None:
                capture.close()
        _check_ended(state)
        if isinstance(out, wc.Variant):
            if out.tag == "ok":
                return str(out.payload)
            out = out.payload
        if isinstance(out, str):
            return out
        code, message = getattr(out, "code", "inferlet_failed"), getattr(out, "message", str(out))
        raise InferletFailedError(
            f"{code}: {message}", guest_code=code, guest_kind=getattr(out, "kind", "guest")
        )

    launch_child: Callable[..., Any] | None = None
    """``(program, input, parent_state) -> (pid, concurrent future of the result, cancel)``:
    how Pie's ``runtime.launch`` starts a child (a server sets it to reach its program
    store); None: launches fail with an error that says so."""

    def _store(self, limits: RunLimits) -> wasmtime.Store:
        store = wasmtime.Store(self.engine)
        store.set_limits(memory_size=limits.memory_bytes)
        store.set_fuel(limits.fuel)
        store.set_epoch_deadline(max(1, int(limits.wall_s / EPOCH_TICK_S)))
        return store

    @staticmethod
    def _legacy_run(instance: Any, store: wasmtime.Store) -> Any:
        run = instance.get_func(store, "run")
        if run is None:
            raise InvalidComponentError("the component exports no run function")
        return run(store)

    @staticmethod
    def _instantiate_and_run(
        state: RunState,
        host: PieHost,
        store: wasmtime.Store,
        linker: wc.Linker,
        comp: wc.Component,
        world: str,
        start: Callable[[Any, wasmtime.Store], Any],
    ) -> Any:
        """Instantiate and call the entry point (``start``); a trap becomes the run's typed
        error (``_ended``); the run's host and store close however it ends."""
        try:
            try:
                instance = linker.instantiate(store, comp)
            except wasmtime.WasmtimeError as e:
                raise InvalidComponentError(
                    f"the component does not fit {world}", detail=str(e)[:600]
                ) from None
            return start(instance, store)
        except wasmtime.WasmtimeError as e:
            raise _ended(state, e) from None
        finally:
            host.close()
            store.close()

    def _pie_host(self, state: RunState) -> PieHost:
        return PieHost(
            state,
            launch_child=self.launch_child,
            mcp=getattr(state.control, "mcp", None),
            sandbox_root=self.cache_dir / "sandboxes",
        )

    def _execute_pie(self, state: RunState, comp: wc.Component) -> str:
        """Run a component of Pie 0.4.0's world (``pie_world``)."""
        host, store, linker = self._pie_world_run(state, comp)

        def start(instance: Any, store: wasmtime.Store) -> Any:
            return run_export(instance, store, comp, self.engine)(
                store, state.args[0] if state.args else "{}"
            )

        out = self._instantiate_and_run(
            state, host, store, linker, comp, "Pie 0.4.0's world as this host serves it", start
        )
        _check_ended(state)
        if isinstance(out, wc.Variant):
            if out.tag == "ok":
                return str(out.payload)
            raise InferletFailedError(str(out.payload), guest_code="inferlet_error", guest_kind="guest")
        return str(out)


def _ended(state: RunState, e: wasmtime.WasmtimeError) -> Exception:
    """The typed error a trapped run ends with: cancelled, a refused host call's own error
    (deadline, budget), the wall clock, or the trap's reason."""
    msg = str(e)
    log.debug("inferlet run trapped: %s", msg)
    if state.control is not None and state.control.cancelled:
        return InferletCancelledError("the run was cancelled")
    if state.ended_by is not None:
        return state.ended_by
    if "interrupt" in msg:
        return InferletTimeoutError(f"inferlet passed its {state.limits.wall_s} s deadline")
    return InferletTrapError("inferlet trapped: " + _trap_reason(msg))


def _check_ended(state: RunState) -> None:
    """A run that returned after a cancel or a refused host call ends with that error."""
    if state.control is not None and state.control.cancelled:
        raise InferletCancelledError("the run was cancelled")
    if state.ended_by is not None:
        raise state.ended_by


def _output_writer(stream: str, on_output: Callable[[str, str], None]) -> Callable[[bytes], None]:
    """A WASI output callback: bytes decoded incrementally (a character split across writes
    stays whole), handed on as text (to ``RunState.output``); a failing callback is logged,
    never the guest's."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(data: bytes) -> None:
        text = decoder.decode(data)
        if text:
            try:
                on_output(stream, text)
            except Exception:  # noqa: BLE001 - the guest's write succeeds whatever the listener does
                log.exception("inferlet %s listener failed", stream)

    return write


def _trap_reason(msg: str) -> str:
    """The useful line of a wasmtime trap message (the reason, not the backtrace)."""
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    for ln in lines:
        low = ln.lower()
        if any(w in low for w in ("fuel", "out of bounds", "unreachable", "memory", "overflow", "stack")):
            return ln[:300]
    return (lines[-1] if lines else msg)[:300]


__all__ = ["InferletRuntime", "RunLimits", "InferletError", "InferletRun"]
