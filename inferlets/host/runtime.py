"""wasmtime host: one Engine per process, compiled components cached on disk by content
hash, one Store per run with memory, fuel, epoch and handle limits."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import threading
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import wasmtime
from wasmtime import component as wc

from engine import Context, Model
from inferlets.host.errors import (
    InferletError,
    InferletFailedError,
    InferletHandleError,
    InferletLimitError,
    InferletTimeoutError,
    InferletTrapError,
    InvalidComponentError,
)
from media.errors import PieMediaError

IFACE = "pie:media/host@0.1.0"
EPOCH_TICK_S = 0.01
_WASMTIME = importlib.metadata.version("wasmtime")


@dataclass(frozen=True)
class RunLimits:
    """Per-run budgets: guest memory, fuel (CPU), wall clock, live handles, string size."""

    memory_bytes: int = 256 << 20
    fuel: int = 2_000_000_000
    wall_s: float = 60.0
    max_handles: int = 64
    max_text_bytes: int = 1 << 20


class _Ticker:
    """Increments the engine's epoch every EPOCH_TICK_S on a daemon thread."""

    def __init__(self, engine: wasmtime.Engine):
        self.engine = engine
        threading.Thread(target=self._tick, daemon=True, name="inferlet-epoch").start()

    def _tick(self) -> None:
        ev = threading.Event()
        while not ev.wait(EPOCH_TICK_S):
            self.engine.increment_epoch()


class InferletRuntime:
    """Compiles/caches components and runs them against already-loaded models."""

    def __init__(self, models: Mapping[str, Any], cache_dir: Path, *, limits: RunLimits | None = None):
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
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"InferletRuntime(models={sorted(self.models)}, cache={str(self.cache_dir)!r})"

    def component(self, wasm: bytes | Path) -> tuple[str, wc.Component]:
        """(content hash, compiled component); compiled once, then deserialized from disk."""
        data = Path(wasm).read_bytes() if isinstance(wasm, Path) else wasm
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
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(comp.serialize())
                tmp.replace(path)
            self._components[key] = comp
            return key, comp

    def run(
        self,
        wasm: bytes | Path,
        args: list[str],
        *,
        loop: asyncio.AbstractEventLoop,
        on_send: Callable[[str], None] | None = None,
        limits: RunLimits | None = None,
    ) -> str:
        """Run to completion on this (worker) thread; host calls go to ``loop``. Returns
        the guest's result or raises a typed InferletError."""
        _, comp = self.component(wasm)
        run = _Run(self, loop, args, on_send or (lambda s: None), limits or self.limits)
        try:
            return run.execute(comp)
        finally:
            run.close()

    async def run_async(self, wasm: bytes | Path, args: list[str], **kw: Any) -> str:
        """Run on a worker thread; host calls come back to the running loop."""
        loop = asyncio.get_running_loop()
        return await asyncio.to_thread(self.run, wasm, args, loop=loop, **kw)


@dataclass
class _Run:
    rt: InferletRuntime
    loop: asyncio.AbstractEventLoop
    args: list[str]
    on_send: Callable[[str], None]
    limits: RunLimits
    handles: dict[int, Context] = field(default_factory=dict)
    next_handle: int = 1

    def _await(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _ctx(self, h: int) -> Context:
        ctx = self.handles.get(h)
        if ctx is None:
            raise InferletHandleError(f"no live context with handle {h} in this run", handle=h)
        return ctx

    def _add(self, ctx: Context) -> int:
        if len(self.handles) >= self.limits.max_handles:
            ctx.close()
            raise InferletLimitError(
                f"more than {self.limits.max_handles} live handles", limit=self.limits.max_handles
            )
        h = self.next_handle
        self.next_handle += 1
        self.handles[h] = ctx
        return h

    def _text(self, s: str) -> str:
        if len(s.encode()) > self.limits.max_text_bytes:
            raise InferletLimitError(
                f"text over {self.limits.max_text_bytes} bytes", limit=self.limits.max_text_bytes
            )
        return s

    def _wrap(self, fn: Callable[..., Any], tagged: bool) -> Callable[..., Any]:
        """Lower ok/err: wasmtime-py needs a Variant when both cases share a type
        (result<string, string>), the bare value otherwise."""

        def call(store: Any, *a: Any) -> Any:
            try:
                v = fn(*a)
                return wc.Variant("ok", v) if tagged else v
            except PieMediaError as e:
                msg = f"{e.code}: {e}"
                return wc.Variant("err", msg) if tagged else msg

        return call

    # host functions -------------------------------------------------------
    def create_context(self, model: str) -> int:
        m = self.rt.models.get(model)
        if not isinstance(m, Model):
            raise InferletHandleError(f"no text model named {model!r}; have {sorted(self.rt.models)}")
        return self._add(Context(m))

    def fill(self, h: int, text: str) -> int:
        self._ctx(h).fill(self._text(text))
        return h

    def user(self, h: int, text: str) -> int:
        self._ctx(h).user(self._text(text))
        return h

    def cue(self, h: int) -> int:
        self._ctx(h).cue()
        return h

    def generate(self, h: int, n: int) -> str:
        ctx = self._ctx(h)
        g = self._await(ctx.generate(max_tokens=n))
        return g.text

    def fork(self, h: int) -> int:
        return self._add(self._ctx(h).fork())

    def drop_context(self, h: int) -> int:
        self._ctx(h).close()
        del self.handles[h]
        return h

    def execute(self, comp: wc.Component) -> str:
        store = wasmtime.Store(self.rt.engine)
        store.set_limits(memory_size=self.limits.memory_bytes)
        store.set_fuel(self.limits.fuel)
        store.set_epoch_deadline(max(1, int(self.limits.wall_s / EPOCH_TICK_S)))
        store.set_wasi(wasmtime.WasiConfig())
        linker = wc.Linker(self.rt.engine)
        linker.add_wasip2()
        with linker.root() as root, root.add_instance(IFACE) as inst:
            inst.add_func("args", lambda store: list(self.args))
            inst.add_func("send", lambda store, s: self.on_send(s))
            inst.add_func("models", lambda store: sorted(self.rt.models))
            for name in ("create-context", "fill", "user", "cue", "generate", "fork", "drop-context"):
                inst.add_func(name, self._wrap(getattr(self, name.replace("-", "_")), name == "generate"))
        try:
            instance = linker.instantiate(store, comp)
            run = instance.get_func(store, "run")
            assert run is not None
            out = run(store)
        except wasmtime.WasmtimeError as e:
            msg = str(e)
            if "interrupt" in msg:
                raise InferletTimeoutError(f"inferlet passed its {self.limits.wall_s} s deadline") from None
            raise InferletTrapError("inferlet trapped: " + msg.splitlines()[-1][:300]) from None
        if isinstance(out, wc.Variant) and out.tag == "err":
            raise InferletFailedError(str(out.payload))
        return out.payload if isinstance(out, wc.Variant) else str(out)

    def close(self) -> None:
        for ctx in self.handles.values():
            ctx.close()
        self.handles.clear()


__all__ = ["InferletRuntime", "RunLimits", "InferletError"]
