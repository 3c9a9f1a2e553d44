"""How the host's Python classes become a WIT world in wasmtime (Pie 0.4's, and the WASI
interfaces the host takes over from wasmtime).

An interface is a class (``Interface``) named by its WIT name, with methods marked
``@wit("[method]context.fork")`` (the component model's export names: plain functions,
``[constructor]r``, ``[static]r.f``, ``[method]r.f``). A WIT resource is a Python class
(``Resource``) naming the interface and resource that define it. The host objects are
plain Python: a method receives the objects its borrowed or owned resources stand for,
returns the objects it hands out, and raises to fail.

wasmtime-py's host functions are dynamically typed, so the conversions come from the
component itself: at link time every imported function's type (``Component.type``) says
which arguments are resources, which results are ``own<...>`` handles, whether a
``result`` is tagged. Each function gets one converter, built once per component.

* A ``result<T, E>`` function returns T; any exception becomes the ``err`` case: the
  message (E = string, Pie's ``error``), an MCP error record (E = record), or the value a
  ``WitErr`` carries (WASI's ``error-code`` enums). A nested ``result`` (``option<result>``)
  is given as ``Ok(v)`` / ``Err(e)``.
* A function without a ``result`` that raises traps: the run ends with the message.
* Resources are one table per run (``ResourceTable``): rep -> object, checked by class on
  every use (a handle of another kind, or one already dropped, is refused by name).

Written by hand because wasmtime-py has no bindgen for hosts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import wasmtime
from wasmtime import component as wc

from inferlets.host.value_codec import GuestResource, HostOwn, RawHandle, codec

log = logging.getLogger("inferlets.host")


class WitErr(Exception):
    """Raise to return exactly ``value`` as a ``result``'s err case."""

    def __init__(self, value: Any, message: str = ""):
        super().__init__(message or repr(value))
        self.value = value


class Ok:
    __slots__ = ("value",)

    def __init__(self, value: Any = None):
        self.value = value


class Err:
    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class HostResourceError(Exception):
    """A resource handle that is not what the call expects (another kind, a dropped one)."""


class Resource:
    """Base of every host object a guest holds as a WIT resource. ``WIT``: (interface,
    resource name) of the WIT definition. ``close()`` runs when the guest drops its handle
    and for whatever is left when the run ends."""

    WIT: ClassVar[tuple[str, str]]

    def close(self) -> None:
        pass


def wit(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a method as the host side of the WIT function ``name``."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__wit__ = name  # type: ignore[attr-defined]
        return fn

    return mark


class Interface:
    """One WIT interface the host implements. ``NAME`` is the WIT name without version
    (``pie:core/context``, ``wasi:io/poll``); ``RESOURCES`` the resources it defines."""

    NAME: ClassVar[str]
    RESOURCES: ClassVar[tuple[type[Resource], ...]] = ()

    def __init__(self, host: Any):
        self.host = host

    @classmethod
    def functions(cls) -> dict[str, str]:
        """WIT name -> method name, for every ``@wit`` method."""
        out: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            for attr, fn in vars(klass).items():
                name = getattr(fn, "__wit__", None)
                if name is not None:
                    out[name] = attr
        return out


class ResourceTable:
    """The run's resources: rep -> object. Reps are never reused within a run."""

    def __init__(self, type_ids: dict[type[Resource], int], limit: int):
        self._type_ids = type_ids
        self._by_id = {v: k for k, v in type_ids.items()}
        self._live: dict[int, Resource] = {}
        self._next = 1
        self.limit = limit

    def __len__(self) -> int:
        return len(self._live)

    def own(self, obj: Resource) -> HostOwn:
        cls = type(obj)
        ty = self._type_ids.get(cls)
        if ty is None:
            for base in cls.__mro__:
                if base in self._type_ids:
                    ty = self._type_ids[base]
                    break
            else:
                raise TypeError(f"{cls.__name__} is not a resource of this world")
        if len(self._live) >= self.limit:
            obj.close()
            from inferlets.host.errors import InferletLimitError

            raise InferletLimitError(
                f"more than {self.limit} live resources in this run; drop some first", limit=self.limit
            )
        rep = self._next
        self._next += 1
        self._live[rep] = obj
        return HostOwn(rep, ty)

    def lookup(self, rep: int, ty: int, want: type[Resource] | None) -> Resource:
        obj = self._live.get(rep)
        if obj is None:
            kind = self._by_id.get(ty)
            raise HostResourceError(
                f"{kind.WIT[1] if kind else 'resource'} handle {rep} is not live in this run (dropped?)"
            )
        if want is not None and not isinstance(obj, want):
            raise HostResourceError(f"a {want.WIT[1]} was expected, got a {type(obj).WIT[1]}")
        return obj

    def drop(self, rep: int) -> None:
        obj = self._live.pop(rep, None)
        if obj is not None:
            obj.close()

    def close_all(self) -> None:
        while self._live:
            _, obj = self._live.popitem()
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - cleanup goes on for the rest
                log.exception("closing %s at the end of a run failed", type(obj).__name__)


# -- conversions built from the component's types -------------------------------------------


def _arg_converter(t: Any, resource_of: Callable[[Any], type[Resource] | None]) -> Callable[..., Any] | None:
    """(store, table, value) -> host value, or None when the value passes as it is."""
    if isinstance(t, (wc.BorrowType, wc.OwnType)):
        want = resource_of(t.ty)

        def res(store: Any, table: ResourceTable, v: Any) -> Any:
            if want is None:  # one of wasmtime's own resources: released, not looked at
                v.drop(store)
                return None
            if isinstance(v, (RawHandle, GuestResource)):
                return table.lookup(*v.host_handle(store), want)
            h = v.to_host(store)
            return table.lookup(h.rep, h.type, want)

        return res
    if isinstance(t, wc.ListType):
        inner = _arg_converter(t.element, resource_of)
        if inner is None:
            return None
        return lambda store, table, v: [inner(store, table, x) for x in v]
    if isinstance(t, wc.OptionType) and not t._tagged():
        inner = _arg_converter(t.payload, resource_of)
        if inner is None:
            return None
        return lambda store, table, v: None if v is None else inner(store, table, v)
    if isinstance(t, wc.ResultType):
        return _result_arg_converter(t, resource_of)
    return None


def _result_arg_converter(
    t: Any, resource_of: Callable[[Any], type[Resource] | None]
) -> Callable[..., Any] | None:
    """A ``result`` argument holding resources (``response-outparam.set``) -> ``Ok(x)`` /
    ``Err(e)``; the case of an untagged one is told by the value's class, as wasmtime-py
    tells it."""
    ok_c = _arg_converter(t.ok, resource_of) if t.ok is not None else None
    err_c = _arg_converter(t.err, resource_of) if t.err is not None else None
    if ok_c is None and err_c is None:
        return None
    tagged = t._tagged()
    ok_classes = codec(t.ok).classes if t.ok is not None else None

    def conv(store: Any, table: ResourceTable, v: Any) -> Any:
        if tagged:
            is_ok, payload = v.tag == "ok", v.payload
        else:
            is_ok = v is None if ok_classes is None else isinstance(v, ok_classes)
            payload = v
        c = ok_c if is_ok else err_c
        x = payload if c is None else c(store, table, payload)
        return Ok(x) if is_ok else Err(x)

    return conv


def _out_converter(t: Any) -> Callable[[ResourceTable, Any], Any] | None:
    """(table, value) -> wasmtime value, or None when the value passes as it is."""
    if isinstance(t, wc.OwnType):
        return lambda table, v: table.own(v)
    if isinstance(t, wc.OptionType):
        inner = _out_converter(t.payload)
        if inner is None:
            return None
        return lambda table, v: None if v is None else inner(table, v)
    if isinstance(t, wc.TupleType):
        parts = [_out_converter(e) for e in t.elements]
        if all(p is None for p in parts):
            return None
        return lambda table, v: tuple(x if p is None else p(table, x) for p, x in zip(parts, v, strict=True))
    if isinstance(t, wc.ListType):
        inner = _out_converter(t.element)
        if inner is None:
            return None
        return lambda table, v: [inner(table, x) for x in v]
    if isinstance(t, wc.ResultType):
        ok_c = _out_converter(t.ok) if t.ok is not None else None
        err_c = _out_converter(t.err) if t.err is not None else None
        tagged = t._tagged()

        def res(table: ResourceTable, v: Any) -> Any:
            if isinstance(v, Err):
                e = v.value if err_c is None else err_c(table, v.value)
                return wc.Variant("err", e) if tagged else e
            x = v.value if isinstance(v, Ok) else v
            x = x if ok_c is None else ok_c(table, x)
            return wc.Variant("ok", x) if tagged else x

        return res
    return None


def _error_value(t: Any, e: BaseException) -> Any:
    """The err payload of type ``t`` for the exception ``e``."""
    if isinstance(e, WitErr):
        return e.value
    code = getattr(e, "code", None)
    msg = getattr(e, "message", None) or str(e) or type(e).__name__
    text = f"{code}: {msg}" if code else msg
    if isinstance(t, wc.RecordType):  # pie:mcp/types.error
        rpc = getattr(e, "rpc_code", code if isinstance(code, int) else -32603)
        r = wc.Record()
        r.code = int(rpc)
        r.message = msg if isinstance(code, int) else text
        data = getattr(e, "data_json", None)
        data = data() if callable(data) else data if data is not None else getattr(e, "data", None)
        r.data = data if isinstance(data, str) or data is None else None
        return r
    return text[:8000]


@dataclass(frozen=True)
class FunctionShape:
    """What a host function's WIT type asks of the conversions around it, worked out once
    per component (``function_shape``) and shared by every run of it."""

    params: list[Callable[..., Any] | None]  # (store, table, value) -> host value, or None
    out: Callable[[ResourceTable, Any], Any] | None  # (table, value) -> wasmtime value, or None
    is_result: bool
    tagged: bool
    err_t: Any


def function_shape(ftype: wc.FuncType, resource_of: Callable[[Any], type[Resource] | None]) -> FunctionShape:
    result_t = ftype.result
    is_result = isinstance(result_t, wc.ResultType)
    return FunctionShape(
        params=[_arg_converter(t, resource_of) for _, t in ftype.params],
        out=_out_converter(result_t) if result_t is not None else None,
        is_result=is_result,
        tagged=is_result and result_t._tagged(),
        err_t=result_t.err if is_result else None,
    )


def host_function(
    iface: str,
    name: str,
    method: Callable[..., Any] | None,
    shape: FunctionShape,
    table: ResourceTable,
    check: Callable[[], None],
    on_trap: Callable[[BaseException], None],
) -> Callable[..., Any]:
    """The wasmtime host function for ``iface``'s ``name`` (see the module doc)."""
    params, out, is_result, tagged, err_t = (
        shape.params,
        shape.out,
        shape.is_result,
        shape.tagged,
        shape.err_t,
    )
    where = f"{iface}.{name}"

    if method is None:

        def method(*_a: Any) -> Any:
            raise NotImplementedError(f"{where} is not implemented by this host")

    def call(store: Any, *args: Any) -> Any:
        try:
            conv = [a if c is None else c(store, table, a) for c, a in zip(params, args, strict=True)]
            check()
            value = method(*conv)
            return value if out is None else out(table, value)
        except Exception as e:  # noqa: BLE001 - a host call never crashes the host
            if not is_result:
                on_trap(e)
                # The trap itself carries the call and the reason, as a WasmtimeError: the run
                # ends with the typed trap error (or the deadline / cancel that refused the
                # call). Any other exception, wasmtime-py keeps in one process-wide slot and
                # re-raises, untyped, from whichever run's thread next leaves wasm.
                raise wasmtime.WasmtimeError(f"{where}: {_error_value(None, e)}") from None
            if not isinstance(e, (WitErr, HostResourceError)) and not hasattr(e, "code"):
                log.debug("%s failed", where, exc_info=True)
            ev = _error_value(err_t, e)
            return wc.Variant("err", ev) if tagged else ev

    call.__name__ = where
    return call


def resource_classes(interfaces: list[type[Interface]]) -> list[type[Resource]]:
    out: list[type[Resource]] = []
    for i in interfaces:
        out.extend(i.RESOURCES)
    return out
