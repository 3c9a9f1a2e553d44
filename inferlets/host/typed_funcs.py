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

from wasmtime import WasmtimeError
from wasmtime import _ffi as ffi
from wasmtime import component as wc
from wasmtime.component._enter import catch_exceptions

from inferlets.host.value_codec import Lift, Lower, codec, gil_held

# one C call per host function a run links (hundreds a launch): keeps the GIL (value_codec)
_add_func = gil_held("wasmtime_component_linker_instance_add_func")

_FUNCS: dict[int, tuple[Callable[..., Any], list[Any], Any]] = {}
_ids = itertools.count(1)


@ffi.wasmtime_component_func_callback_t
def _call(idx, context, ty_raw, args, nargs, results, nresults):  # type: ignore[no-untyped-def]
    fn, params, lower_result = _FUNCS[idx or 0]

    def run(store: Any) -> None:
        value = fn(store, *[lift(args[i]) for i, lift in enumerate(params)])
        if lower_result is not None:
            lower_result(store, value, results[0])

    return catch_exceptions(context, run)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _forget(idx):  # type: ignore[no-untyped-def]
    _FUNCS.pop(idx or 0, None)


def typed_codecs(ftype: wc.FuncType) -> tuple[list[Lift], Lower | None]:
    """The lifts of ``ftype``'s parameters and the lower of its result (built once per type)."""
    result = ftype.result
    return [codec(t).lift for _, t in ftype.params], None if result is None else codec(result).lower


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
