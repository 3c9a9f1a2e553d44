"""Host functions registered with their types read once (a workaround, by hand: wasmtime-py
has no such call). wasmtime-py's ``LinkerInstance.add_func`` routes every call through one
callback that reads the function's type back from C and builds its parameter and result
types again, on every call: ~38 us of ~50 us per host call here (bench/inferlet_tax.py's
profile; a Pie inferlet makes ~11 per token). The link already knows each function's type
from the component (``Component.type``), so ``add_typed_func`` keeps those types with the
function and its callback only converts the values, with codecs built once from those types
(``value_codec.py``: wasmtime-py's own converters read the types back from C per value)."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable
from typing import Any

from wasmtime import StoreContext, WasmtimeError
from wasmtime import _ffi as ffi
from wasmtime import component as wc
from wasmtime.component import _enter

from inferlets.host.value_codec import Lift, Lower, codec, gil_held, lift_raw_resource

# one C call per host function a run links (hundreds a launch): keeps the GIL (value_codec)
_add_func = gil_held("wasmtime_component_linker_instance_add_func")

_FUNCS: dict[int, tuple[Callable[..., Any], list[Any], Any]] = {}
_ids = itertools.count(1)


def call_entry(idx, context, ty_raw, args, nargs, results, nresults):  # type: ignore[no-untyped-def]
    """Every host function's entry from wasm (``_call`` is its C callback): the arguments
    lifted, the function called, its result lowered; wasmtime-py's ``catch_exceptions``
    inlined (one closure and one call less per host call)."""
    fn, params, lower_result = _FUNCS[idx or 0]
    store = StoreContext(context)
    try:
        value = fn(store, *[lift(args[i]) for i, lift in enumerate(params)])
        if lower_result is not None:
            lower_result(store, value, results[0])
    except WasmtimeError as e:
        return ctypes.cast(e._consume(), ctypes.c_void_p).value
    except Exception as e:  # noqa: BLE001 - re-raised by wasmtime-py where the guest was entered
        _enter.LAST_EXCEPTION = e
        return ctypes.cast(WasmtimeError("python exception")._consume(), ctypes.c_void_p).value
    finally:
        store._invalidate()
    return 0


_call = ffi.wasmtime_component_func_callback_t(call_entry)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _forget(idx):  # type: ignore[no-untyped-def]
    _FUNCS.pop(idx or 0, None)


# -- resources ----------------------------------------------------------------------------------

_drop_t = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32)
_add_resource = gil_held("wasmtime_component_linker_instance_add_resource")  # a function object of its own
_add_resource.argtypes = [
    *_add_resource.argtypes[:4],
    _drop_t,  # the store's context as a plain address: a drop does not look at it
    *_add_resource.argtypes[5:],
]
_DROPS: dict[int, Callable[[int], None]] = {}


def drop_entry(idx, context, rep):  # type: ignore[no-untyped-def]
    """A host resource's destructor, entered from wasm when the guest drops its handle:
    ``on_drop(rep)``, with no ``StoreContext`` made and none of wasmtime-py's closures
    (a Pie inferlet drops three handles a token)."""
    try:
        _DROPS[idx or 0](rep)
    except Exception as e:  # noqa: BLE001 - re-raised by wasmtime-py where the guest was entered
        _enter.LAST_EXCEPTION = e
        return ctypes.cast(WasmtimeError("python exception")._consume(), ctypes.c_void_p).value
    return 0


_drop = _drop_t(drop_entry)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _forget_drop(idx):  # type: ignore[no-untyped-def]
    _DROPS.pop(idx or 0, None)


def add_host_resource(
    inst: wc.LinkerInstance, name: str, type_id: int, on_drop: Callable[[int], None]
) -> None:
    """``inst.add_resource(name, ResourceType.host(type_id), dtor)`` with a leaner entry:
    ``on_drop(rep)`` is called when the guest drops a handle of it."""
    idx = next(_ids)
    _DROPS[idx] = on_drop
    raw = name.encode("utf-8")
    ty = wc.ResourceType.host(type_id)
    err = _add_resource(
        inst.ptr(), ctypes.create_string_buffer(raw), len(raw), ty.ptr(), _drop, idx, _forget_drop
    )
    if err:
        _DROPS.pop(idx, None)
        raise WasmtimeError._from_ptr(err)


def typed_codecs(ftype: wc.FuncType, *, raw_resources: bool = False) -> tuple[list[Lift], Lower | None]:
    """The lifts of ``ftype``'s parameters and the lower of its result (built once per type).
    ``raw_resources``: ``own`` / ``borrow`` parameters come as ``RawHandle``s (their host
    function resolves them: ``binding``), not ``ResourceAny`` objects."""
    result = ftype.result
    lifts = [
        lift_raw_resource if raw_resources and isinstance(t, (wc.OwnType, wc.BorrowType)) else codec(t).lift
        for _, t in ftype.params
    ]
    return lifts, None if result is None else codec(result).lower


def add_typed_func(
    inst: wc.LinkerInstance, name: str, fn: Callable[..., Any], lifts: list[Lift], lower: Lower | None
) -> None:
    """``inst.add_func(name, fn)`` with the conversions of the import's own type
    (``typed_codecs``), made once per component."""
    idx = next(_ids)
    _FUNCS[idx] = (fn, lifts, lower)
    raw = name.encode("utf-8")
    err = _add_func(inst.ptr(), ctypes.create_string_buffer(raw), len(raw), _call, idx, _forget)
    if err:
        _FUNCS.pop(idx, None)
        raise WasmtimeError._from_ptr(err)
