"""Pie 0.4.0's world on the host: ``PieHost`` (one run's resources, waiter and bridges) and
``link_pie_world`` (every interface of inferlets/pie_wit, one file each under
``pie_core/``, ``pie_instruct/``, ``pie_mcp/``, ``pie_zo/``, and the WASI functions the host
takes over from wasmtime under ``wasi/``).

A component is of Pie's world when it imports any ``pie:core/*`` interface; it exports
``<package>/run`` (``run(input) -> result<string, string>``)."""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import wasmtime
from wasmtime import component as wc

from inferlets.host import wasi
from inferlets.host.binding import (
    FunctionShape,
    Interface,
    Resource,
    ResourceTable,
    function_shape,
    host_function,
    resource_classes,
)
from inferlets.host.errors import InvalidComponentError, UnknownModelError
from inferlets.host.message_broker import MessageBroker
from inferlets.host.pie_core.adapter import AdapterIface
from inferlets.host.pie_core.audio_out import AudioOut
from inferlets.host.pie_core.context import ContextIface
from inferlets.host.pie_core.inference import Inference
from inferlets.host.pie_core.media import Media
from inferlets.host.pie_core.messaging import Messaging
from inferlets.host.pie_core.model import ModelIface, ModelRes
from inferlets.host.pie_core.runtime import Runtime
from inferlets.host.pie_core.scheduling import Scheduling
from inferlets.host.pie_core.session import Session
from inferlets.host.pie_core.types import Types
from inferlets.host.pie_instruct.chat import Chat
from inferlets.host.pie_instruct.reasoning import Reasoning
from inferlets.host.pie_instruct.tool_use import ToolUse
from inferlets.host.pie_mcp.client import Client
from inferlets.host.pie_mcp.types import McpTypes
from inferlets.host.pie_zo.zo import Zo
from inferlets.host.state import RunState
from inferlets.host.typed_funcs import add_host_resource, add_typed_func, typed_codecs
from inferlets.host.value_codec import Lift, Lower
from inferlets.host.wasi.poll import Waiter
from inferlets.host.wasi.streams import IoError, OutputStream

log = logging.getLogger(__name__)

PIE_INTERFACES: tuple[type[Interface], ...] = (
    Types,
    ModelIface,
    AdapterIface,
    ContextIface,
    Messaging,
    Session,
    Runtime,
    Media,
    Inference,
    Scheduling,
    AudioOut,
    Chat,
    Reasoning,
    ToolUse,
    McpTypes,
    Client,
    Zo,
)
# wasi:io/error is the host's too: a failed /scratch file stream hands the guest an error the
# host made, whose error code (e.g. insufficient-space) filesystem-error-code answers.
ALL_INTERFACES: tuple[type[Interface], ...] = PIE_INTERFACES + tuple(wasi.INTERFACES) + (IoError,)
BY_NAME: dict[str, type[Interface]] = {i.NAME: i for i in ALL_INTERFACES}
RESOURCE_CLASSES: list[type[Resource]] = resource_classes(list(ALL_INTERFACES))
TYPE_IDS: dict[type[Resource], int] = {cls: 1000 + i for i, cls in enumerate(RESOURCE_CLASSES)}
BY_WIT: dict[tuple[str, str], type[Resource]] = {cls.WIT: cls for cls in RESOURCE_CLASSES}
BROKER = MessageBroker()
_instances = itertools.count(1)


def extern_type(x: Any) -> Any:
    """A component import/export's type (wasmtime-py >= 50 wraps it in ``ComponentExtern``)."""
    return x.ty if type(x).__name__ == "ComponentExtern" else x


def base_name(import_name: str) -> str:
    """``wasi:io/poll@0.2.9`` -> ``wasi:io/poll``."""
    return import_name.split("@", 1)[0]


def is_pie_world(engine: wasmtime.Engine, comp: wc.Component) -> bool:
    return any(base_name(n).startswith("pie:core/") for n in comp.type.imports(engine))


class PieHost:
    """One run of a Pie-world component: its resource table, the waiter its ``poll`` sleeps
    on, and what the interfaces reach (the run's state, the models, the broker, the
    launcher of children, the MCP relay)."""

    def __init__(
        self,
        state: RunState,
        *,
        broker: MessageBroker | None = None,
        launch_child: Callable[..., Any] | None = None,
        mcp: Any = None,
        sandbox_root: Path | None = None,
    ):
        self.state = state
        self.waiter = Waiter(state.check, lambda: state.deadline)
        if state.control is not None:
            state.control.on_cancel(self.waiter.wake)
        self.table = ResourceTable(TYPE_IDS, state.limits.max_handles * 64)
        self.broker = broker or BROKER
        self.launch_child = launch_child
        self.mcp = mcp
        self.children = 0
        self.instance_id = str(uuid.uuid4())
        self.namespace = state.control.namespace if state.control is not None else ""
        self._outputs: dict[str, OutputStream] = {}
        self._sandbox_root = sandbox_root
        self._sandbox: Path | None = None

    def __repr__(self) -> str:
        return f"PieHost({len(self.table)} live resources, namespace={self.namespace!r})"

    @property
    def sandbox_dir(self) -> Path:
        """This run's own directory, the guest's ``/scratch`` (made on first use, removed with
        the run): under ``<sandbox root>/<tenant>/<instance id>``, never shared."""
        if self._sandbox is None:
            import tempfile

            root = self._sandbox_root or Path(tempfile.gettempdir()) / "pie-media-sandboxes"
            tenant = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.namespace) or "_local"
            path = root / tenant / self.instance_id
            path.mkdir(parents=True, exist_ok=True)
            self._sandbox = path
        return self._sandbox

    # -- models -------------------------------------------------------------------------------
    def model_res(self, name: str) -> ModelRes:
        return ModelRes(name, self.state.model(name))

    def text_model(self, m: ModelRes) -> Any:
        from engine import Model

        if not isinstance(m.model, Model):
            raise UnknownModelError(
                f"model {m.name!r} is not a text model (contexts and passes need one)", model=m.name
            )
        return m.model

    # -- bridges --------------------------------------------------------------------------------
    def on_loop(self, fn: Callable[..., Any], *a: Any) -> Any:
        return self.state.on_loop(fn, *a)

    def wait_for(self, coro: Any) -> Any:
        return self.state.wait_for(coro)

    def wait_future(self, fut: Any) -> Any:
        """The result of a ``concurrent.futures.Future`` (another thread's work), waiting no
        longer than the run may: cancel or the deadline ends the wait with their error."""
        import concurrent.futures

        while True:
            try:
                return fut.result(timeout=0.05)
            except concurrent.futures.TimeoutError:
                try:
                    self.state.check()
                except Exception:
                    fut.cancel()
                    raise

    def output_stream(self, name: str) -> OutputStream:
        st = self.state
        if name not in self._outputs:
            import codecs

            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

            def write(data: bytes) -> None:
                text = decoder.decode(data)
                if text:
                    try:
                        st.output(name, text)
                    except Exception:  # noqa: BLE001 - the guest's write succeeds whatever the listener does
                        log.exception("inferlet %s listener failed", name)

            self._outputs[name] = OutputStream(write)
        return OutputStream(self._outputs[name]._write)

    def engine_adapter(self, adapter: Any, zo_seed: int | None) -> Any:
        """The engine adapter a pass runs under: a Pie adapter's current weights, or their
        perturbation by ``zo_seed`` (``pie:zo``)."""
        if adapter is None:
            raise ValueError("adapter-seed needs an adapter on the pass (forward-pass.adapter)")
        if zo_seed is not None:
            from engine.evolution import perturbed

            return perturbed(adapter.handle, zo_seed)
        return adapter.handle.adapter

    def close(self) -> None:
        self.table.close_all()
        if self._sandbox is not None:
            import shutil

            shutil.rmtree(self._sandbox, ignore_errors=True)


def _groups(engine: wasmtime.Engine, comp: wc.Component) -> list[tuple[Any, type[Resource] | None]]:
    """Every resource type the component imports, with the host class it stands for (by
    equality with a definition a class names; None for wasmtime's own)."""
    found: list[tuple[Any, str, str]] = []
    for name, item in comp.type.imports(engine).items():
        for rname, ext in extern_type(item).exports(engine).items():
            t = extern_type(ext)
            if isinstance(t, wc.ResourceType):
                found.append((t, base_name(name), rname))
    groups: list[list[Any]] = []  # [type, class]
    for t, iface, rname in found:
        cls = BY_WIT.get((iface, rname))
        for g in groups:
            if g[0] == t:
                if cls is not None:
                    g[1] = cls
                break
        else:
            groups.append([t, cls])
    return [(g[0], g[1]) for g in groups]


def check_imports(engine: wasmtime.Engine, comp: wc.Component) -> None:
    """Refuse a component importing an interface this host does not serve, naming it."""
    for name in comp.type.imports(engine):
        base = base_name(name)
        if base in BY_NAME or base.startswith("wasi:"):
            continue
        raise InvalidComponentError(
            f"the component imports {name}, which this host does not provide "
            f"(it serves Pie 0.4.0's world: pie:core, pie:instruct, pie:mcp, pie:zo, and WASI 0.2)",
            interface=name,
        )


@dataclass(frozen=True)
class _FuncLink:
    name: str
    attr: str | None  # the Interface method serving it (None: answered "not implemented")
    shape: FunctionShape
    lifts: list[Lift]
    lower: Lower | None


@dataclass(frozen=True)
class _InstanceLink:
    link_name: str
    base: str
    iface_cls: type[Interface]
    resources: list[tuple[str, int]]  # (resource name, host type id)
    funcs: list[_FuncLink]


@dataclass(frozen=True)
class PieLinkPlan:
    """How one component links to Pie's world: every import this host serves, its resources
    and functions with their conversions. Worked out once per component (``plan_pie_world``:
    thousands of C calls reading the component's types back); each run then links from it
    (``link_pie_world``: one C call per instance, resource and function)."""

    instances: list[_InstanceLink]

    def __repr__(self) -> str:
        return f"PieLinkPlan({len(self.instances)} interfaces, {sum(len(i.funcs) for i in self.instances)} functions)"


def plan_pie_world(engine: wasmtime.Engine, comp: wc.Component) -> PieLinkPlan:
    check_imports(engine, comp)
    groups = _groups(engine, comp)

    def resource_of(t: Any) -> type[Resource] | None:
        for gt, cls in groups:
            if gt == t:
                return cls
        return None

    wasi_version = wasi.wasmtime_wasi_version()
    instances: list[_InstanceLink] = []
    for name, item in comp.type.imports(engine).items():
        base = base_name(name)
        iface_cls = BY_NAME.get(base)
        if iface_cls is None:
            continue
        is_wasi = base.startswith("wasi:") and base not in wasi.HOST_ONLY  # wasmtime has it too
        methods = iface_cls.functions()
        exports = {k: extern_type(v) for k, v in extern_type(item).exports(engine).items()}
        resources: list[tuple[str, int]] = []
        for rname, t in exports.items():
            if not isinstance(t, wc.ResourceType):
                continue
            cls = resource_of(t)
            if cls is None:
                continue
            if is_wasi and cls not in iface_cls.RESOURCES:
                continue  # wasmtime's instance keeps its alias (see docs/pie_world_wasi_poll.md)
            resources.append((rname, TYPE_IDS[cls]))
        funcs: list[_FuncLink] = []
        for fname, t in exports.items():
            if not isinstance(t, wc.FuncType):
                continue
            attr = methods.get(fname)
            if attr is None and is_wasi:
                continue  # wasmtime's own function stays
            funcs.append(
                _FuncLink(fname, attr, function_shape(t, resource_of), *typed_codecs(t, raw_resources=True))
            )
        link_name = f"{base}@{wasi_version}" if is_wasi else name
        instances.append(_InstanceLink(link_name, base, iface_cls, resources, funcs))
    return PieLinkPlan(instances)


def link_pie_world(engine: wasmtime.Engine, plan: PieLinkPlan, host: PieHost) -> wc.Linker:
    """A linker serving ``plan``'s imports with this run's ``host``."""
    linker = wc.Linker(engine)
    linker.allow_shadowing = True
    linker.add_wasip2()

    def on_trap(e: BaseException) -> None:
        """A result-less call failed: the run ends there, with the host's typed error (a
        refused budget keeps the error it set first)."""
        from media.errors import PieMediaError

        if isinstance(e, PieMediaError) and host.state.ended_by is None:
            host.state.ended_by = e

    table = host.table
    check = host.state.check

    with linker.root() as root:
        for link in plan.instances:
            iface = link.iface_cls(host)
            with root.add_instance(link.link_name) as inst:
                for rname, type_id in link.resources:
                    add_host_resource(inst, rname, type_id, table.drop)
                for f in link.funcs:
                    method = getattr(iface, f.attr) if f.attr is not None else None
                    fn = host_function(link.base, f.name, method, f.shape, table, check, on_trap)
                    add_typed_func(inst, f.name, fn, f.lifts, f.lower)
    return linker


def is_daemon(engine: wasmtime.Engine, comp: wc.Component) -> bool:
    """Whether the component exports ``wasi:http/incoming-handler`` (a Pie daemon)."""
    return any(base_name(n) == "wasi:http/incoming-handler" for n in comp.type.exports(engine))


def handler_export(
    instance: wc.Instance, store: wasmtime.Store, comp: wc.Component, engine: wasmtime.Engine
) -> Any:
    """The component's ``wasi:http/incoming-handler.handle`` function."""
    for name in comp.type.exports(engine):
        if base_name(name) == "wasi:http/incoming-handler":
            idx = instance.get_export_index(store, name)
            fidx = None if idx is None else instance.get_export_index(store, "handle", idx)
            if fidx is not None:
                return instance.get_func(store, fidx)
    raise InvalidComponentError("the component exports no wasi:http/incoming-handler with a handle function")


def run_export(
    instance: wc.Instance, store: wasmtime.Store, comp: wc.Component, engine: wasmtime.Engine
) -> Any:
    """The component's ``<package>/run`` function."""
    for name in comp.type.exports(engine):
        if base_name(name).endswith("/run"):
            idx = instance.get_export_index(store, name)
            if idx is None:
                continue
            fidx = instance.get_export_index(store, "run", idx)
            if fidx is not None:
                return instance.get_func(store, fidx)
    if is_daemon(engine, comp):
        raise InvalidComponentError(
            "this component is a daemon (it exports wasi:http/incoming-handler, not a run "
            "function): serve it with launch_daemon"
        )
    raise InvalidComponentError("the component exports no <package>/run interface with a run function")
