"""Component values converted to and from Python by code built once per type.

Written by hand because wasmtime-py's own converters (``ValType.convert_to_c`` /
``convert_from_c``) read the type back from C on every value: a record asks C for its
fields, a variant for its cases (and works out again whether it is tagged), a list for its
element type, at each level of each value of each call. bench/inferlet_tax.py's perf
profile put those conversions first among a Pie inferlet's host costs (more than the host
functions themselves). ``codec(ty)`` walks the type once and returns closures that only
move values; the Python values are exactly wasmtime-py's (``Record``, ``Variant`` where the
type is tagged, ``None``/payload for untagged options and results, tuples, lists, ``bytes``
for ``list<u8>``, ``str`` for enums, ``set`` for flags, ``ResourceAny`` for handles), and so
is who frees what (a lifted value's C allocations are freed; a lowered one is handed over).

Two further savings:

* lists of numbers (token ids, positions, distributions) move through numpy in one step
  over the C array instead of one ctypes assignment per element;
* the C calls made here (allocations, frees) keep the GIL (a ``ctypes.PyDLL`` handle on
  the same library): each is a few hundred nanoseconds, and releasing the GIL around it,
  as ctypes' default handle does, hands the interpreter to another run's thread at every
  call when many runs are live (bench/inferlet_tax.py at 32 runs).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from wasmtime import WasmtimeError
from wasmtime import _bindings as bindings
from wasmtime import _ffi as ffi
from wasmtime import component as wc
from wasmtime.component._resources import ResourceAny, ResourceHost

Val = ffi.wasmtime_component_val
Lift = Callable[[Any], Any]
Lower = Callable[[Any, Any, Any], None]

_PY_DLL = ctypes.PyDLL(ffi.dll._name)


def gil_held(name: str) -> Any:
    """``name`` from wasmtime's library with wasmtime-py's signature, called with the GIL held."""
    src = getattr(bindings, f"_{name}")
    fn = _PY_DLL[name]
    fn.argtypes, fn.restype = src.argtypes, src.restype
    return fn


_byte_vec_new = gil_held("wasm_byte_vec_new_uninitialized")
_byte_vec_delete = gil_held("wasm_byte_vec_delete")
_val_new = gil_held("wasmtime_component_val_new")
_val_delete = gil_held("wasmtime_component_val_delete")
_list_new = gil_held("wasmtime_component_vallist_new_uninit")
_list_delete = gil_held("wasmtime_component_vallist_delete")
_record_new = gil_held("wasmtime_component_valrecord_new_uninit")
_record_delete = gil_held("wasmtime_component_valrecord_delete")
_tuple_new = gil_held("wasmtime_component_valtuple_new_uninit")
_tuple_delete = gil_held("wasmtime_component_valtuple_delete")
_flags_new = gil_held("wasmtime_component_valflags_new_uninit")
_flags_delete = gil_held("wasmtime_component_valflags_delete")
_resource_clone = gil_held("wasmtime_component_resource_any_clone")
_any_delete = gil_held("wasmtime_component_resource_any_delete")
_any_to_host = gil_held("wasmtime_component_resource_any_to_host")
_host_new = gil_held("wasmtime_component_resource_host_new")
_host_rep = gil_held("wasmtime_component_resource_host_rep")
_host_type = gil_held("wasmtime_component_resource_host_type")
_host_delete = gil_held("wasmtime_component_resource_host_delete")
_host_to_any = gil_held("wasmtime_component_resource_host_to_any")
_memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr  # type: ignore[attr-defined]
)
_byref = ctypes.byref
_string_at = ctypes.string_at

# the value kinds of wasmtime's C API (wasmtime_component_valkind_t), as ints
BOOL, S8, U8, S16, U16, S32, U32, S64, U64, F32, F64, CHAR = (
    getattr(ffi, f"WASMTIME_COMPONENT_{k}").value
    for k in ("BOOL", "S8", "U8", "S16", "U16", "S32", "U32", "S64", "U64", "F32", "F64", "CHAR")
)
STRING, LIST, RECORD, TUPLE, VARIANT, ENUM, OPTION, RESULT, FLAGS, RESOURCE = (
    getattr(ffi, f"WASMTIME_COMPONENT_{k}").value
    for k in ("STRING", "LIST", "RECORD", "TUPLE", "VARIANT", "ENUM", "OPTION", "RESULT", "FLAGS", "RESOURCE")
)
_VAL_SIZE = ctypes.sizeof(Val)
_UNION_AT = Val.of.offset
# list<number>: at least this many elements go through numpy (below it, per element is cheaper)
NUMPY_FROM = 8

_NUMBERS: dict[type, tuple[int, str, str, tuple[type, ...]]] = {
    # type: (kind, union field, numpy dtype, the Python classes wasmtime-py makes and accepts)
    wc.Bool: (BOOL, "boolean", "?", (bool,)),
    wc.S8: (S8, "s8", "<i1", (int,)),
    wc.U8: (U8, "u8", "<u1", (int,)),
    wc.S16: (S16, "s16", "<i2", (int,)),
    wc.U16: (U16, "u16", "<u2", (int,)),
    wc.S32: (S32, "s32", "<i4", (int,)),
    wc.U32: (U32, "u32", "<u4", (int,)),
    wc.S64: (S64, "s64", "<i8", (int,)),
    wc.U64: (U64, "u64", "<u8", (int,)),
    wc.F32: (F32, "f32", "<f4", (float,)),
    wc.F64: (F64, "f64", "<f8", (float,)),
}


@dataclass(frozen=True)
class ValueCodec:
    """``lift(val)``: the Python value of a C value, freeing what it holds; ``lower(store,
    value, val)``: the C value of a Python one written into ``val`` (which then owns it);
    ``classes``: the Python classes ``lift`` makes (an untagged variant picks its case by
    them, as wasmtime-py does)."""

    lift: Lift
    lower: Lower
    classes: tuple[type, ...]
    what: str

    def __repr__(self) -> str:
        return f"ValueCodec({self.what})"


def codec(ty: Any) -> ValueCodec:
    """The codec of the component value type ``ty`` (a ``wasmtime.component`` type)."""
    num = _NUMBERS.get(type(ty))
    if num is not None:
        return _number(type(ty).__name__.lower(), *num)
    if isinstance(ty, wc.Char):
        return _char()
    if isinstance(ty, wc.String):
        return ValueCodec(_lift_str, _lower_str, (str,), "string")
    if isinstance(ty, wc.ListType):
        return _list(ty)
    if isinstance(ty, wc.RecordType):
        return _record(ty)
    if isinstance(ty, wc.TupleType):
        return _tuple(ty)
    if isinstance(ty, wc.EnumType):
        return _enum(ty)
    if isinstance(ty, wc.FlagsType):
        return _flags()
    if isinstance(ty, wc.OptionType):
        return _variant_like(ty, OPTION, [("none", None), ("some", ty.payload)])
    if isinstance(ty, wc.ResultType):
        return _variant_like(ty, RESULT, [("ok", ty.ok), ("err", ty.err)])
    if isinstance(ty, wc.VariantType):
        return _variant_like(ty, VARIANT, ty.cases)
    if isinstance(ty, wc.OwnType):
        return ValueCodec(_lift_resource, _lower_own, (ResourceAny, ResourceHost, HostOwn), "own")
    if isinstance(ty, wc.BorrowType):
        return ValueCodec(_lift_resource, _lower_borrow, (ResourceAny, ResourceHost), "borrow")
    # futures, streams, error-context: wasmtime-py's own conversion (Pie's world has none)
    return ValueCodec(
        ty.convert_from_c,
        lambda store, v, val: ty.convert_to_c(store, v, ctypes.pointer(val)),
        (object,),
        repr(ty),
    )


# -- scalars ---------------------------------------------------------------------------------


def _number(name: str, kind: int, field: str, _dtype: str, classes: tuple[type, ...]) -> ValueCodec:
    is_float = classes == (float,)

    def lift(val: Any) -> Any:
        return getattr(val.of, field)

    def lower(store: Any, v: Any, val: Any) -> None:
        if not isinstance(v, classes) and not (is_float and isinstance(v, int)):
            raise TypeError(f"expected {classes[0].__name__} for {name}, got {type(v).__name__}")
        val.kind = kind
        setattr(val.of, field, v)

    return ValueCodec(lift, lower, classes, name)


def _char() -> ValueCodec:
    def lower(store: Any, v: Any, val: Any) -> None:
        if not isinstance(v, str) or len(v) != 1:
            raise TypeError("expected a one-character str for char")
        val.kind = CHAR
        val.of.character = ord(v)

    return ValueCodec(lambda val: chr(val.of.character), lower, (str,), "char")


def _name_of(vec: Any) -> str:
    return _string_at(vec.data, vec.size).decode("utf-8") if vec.size else ""


def _byte_vec(data: bytes) -> Any:
    vec = ffi.wasm_byte_vec_t()
    _byte_vec_new(_byref(vec), len(data))
    if data:
        _memmove(vec.data, data, len(data))
    return vec


def _take_text(vec: Any) -> str:
    """The text of a C byte vector, which is freed."""
    try:
        return _name_of(vec)
    finally:
        _byte_vec_delete(_byref(vec))


def _lift_str(val: Any) -> str:
    return _take_text(val.of.string)


def _lower_str(store: Any, v: Any, val: Any) -> None:
    if not isinstance(v, str):
        raise TypeError(f"expected str for string, got {type(v).__name__}")
    val.kind = STRING
    val.of.string = _byte_vec(v.encode("utf-8"))


def _enum(ty: Any) -> ValueCodec:
    names = set(ty.names)

    def lift(val: Any) -> str:
        return _take_text(val.of.enumeration)

    def lower(store: Any, v: Any, val: Any) -> None:
        if v not in names:
            raise TypeError(f"expected one of {sorted(names)} for the enum, got {v!r}")
        val.kind = ENUM
        val.of.enumeration = _byte_vec(v.encode("utf-8"))

    return ValueCodec(lift, lower, (str,), "enum")


def _flags() -> ValueCodec:
    def lift(val: Any) -> set[str]:
        f = val.of.flags
        try:
            return {_name_of(f.data[i]) for i in range(f.size)}
        finally:
            _flags_delete(_byref(f))

    def lower(store: Any, v: Any, val: Any) -> None:
        if not isinstance(v, set) or not all(isinstance(s, str) for s in v):
            raise TypeError("expected a set of str for flags")
        raw = ffi.wasmtime_component_valflags_t()
        _flags_new(raw, len(v))
        for i, s in enumerate(v):
            raw.data[i] = _byte_vec(s.encode("utf-8"))
        val.kind = FLAGS
        val.of.flags = raw

    return ValueCodec(lift, lower, (set,), "flags")


# -- resources -------------------------------------------------------------------------------


class GuestResource(ResourceAny):
    """A handle the guest passed in (``own`` or ``borrow``): wasmtime-py's ``ResourceAny``
    whose C calls keep the GIL, with ``host_handle`` reading a host resource's (rep, type)
    in one step (``to_host`` makes and frees a ``ResourceHost`` for it, five C calls)."""

    def _delete(self, ptr: Any) -> None:
        _any_delete(ptr)

    def host_handle(self, store: Any) -> tuple[int, int]:
        """(rep, type id) of a host-defined resource; ``WasmtimeError`` for a guest's own."""
        host = ctypes.POINTER(bindings.wasmtime_component_resource_host_t)()
        err = _any_to_host(store._context(), self.ptr(), _byref(host))
        if err:
            raise WasmtimeError._from_ptr(err)
        try:
            return _host_rep(host), _host_type(host)
        finally:
            _host_delete(host)


@dataclass(frozen=True, slots=True)
class HostOwn:
    """A host resource handed to the guest as an ``own`` handle: its rep in the run's table
    and its resource type id (``ResourceType.host``)."""

    rep: int
    type_id: int


def _lift_resource(val: Any) -> ResourceAny:
    return GuestResource._from_ptr(ffi.take_pointer(val.of, "resource"))


def _raw(name: str, restype: Any, *argtypes: Any) -> Any:
    fn = _PY_DLL[name]  # a function object of its own: these argtypes are plain addresses
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


_VP = ctypes.c_void_p
_raw_any_to_host = _raw("wasmtime_component_resource_any_to_host", _VP, _VP, _VP, ctypes.POINTER(_VP))
_raw_any_drop = _raw("wasmtime_component_resource_any_drop", _VP, _VP, _VP)
_raw_any_delete = _raw("wasmtime_component_resource_any_delete", None, _VP)
_raw_host_rep = _raw("wasmtime_component_resource_host_rep", ctypes.c_uint32, _VP)
_raw_host_type = _raw("wasmtime_component_resource_host_type", ctypes.c_uint32, _VP)
_raw_host_delete = _raw("wasmtime_component_resource_host_delete", None, _VP)


def _context(store: Any) -> int:
    """The store context's address (``StoreContext._context()`` is a ctypes pointer)."""
    return _VP.from_buffer(store._context()).value


def _check(err: int | None) -> None:
    """Raise the ``WasmtimeError`` a plain-address C call returned, if any."""
    if err:
        raise WasmtimeError._from_ptr(ctypes.cast(err, ctypes.POINTER(bindings.wasmtime_error_t)))


class RawHandle:
    """A resource handle a host function's parameter passed in (``own`` or ``borrow``), kept
    as its bare address: ``host_handle`` reads (rep, type) with plain-address C calls, and
    the handle is freed then (or when this object goes). The faster form of
    ``GuestResource`` for top-level parameters (``lift_raw_resource``): no ``ResourceAny``,
    no ``POINTER`` objects, no ``take_pointer`` (~4 us a handle here)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __del__(self) -> None:
        if self.ptr:
            _raw_any_delete(self.ptr)
            self.ptr = 0

    def host_handle(self, store: Any) -> tuple[int, int]:
        """(rep, type id) of a host-defined resource (the handle is freed);
        ``WasmtimeError`` for a guest's own."""
        ptr, self.ptr = self.ptr, 0
        try:
            host = _VP()
            _check(_raw_any_to_host(_context(store), ptr, _byref(host)))
            try:
                return _raw_host_rep(host), _raw_host_type(host)
            finally:
                _raw_host_delete(host)
        finally:
            _raw_any_delete(ptr)

    def drop(self, store: Any) -> None:
        """Run the resource's destructor (one of wasmtime's own), then free the handle."""
        ptr, self.ptr = self.ptr, 0
        try:
            _check(_raw_any_drop(_context(store), ptr))
        finally:
            _raw_any_delete(ptr)


_RESOURCE_OFFSET = Val.of.offset  # the union's first field is the resource pointer


def lift_raw_resource(val: Any) -> RawHandle:
    """A top-level ``own`` / ``borrow`` parameter as a ``RawHandle`` (its field in ``val``
    set to NULL: the handle is ours now, as ``take_pointer`` leaves it)."""
    slot = _VP.from_address(ctypes.addressof(val) + _RESOURCE_OFFSET)
    ptr = slot.value
    slot.value = None
    return RawHandle(ptr or 0)


def _host_own_to_any(store: Any, v: HostOwn) -> Any:
    host = _host_new(True, v.rep, v.type_id)
    try:
        out = ctypes.POINTER(bindings.wasmtime_component_resource_any_t)()
        err = _host_to_any(store._context(), host, _byref(out))
        if err:
            raise WasmtimeError._from_ptr(err)
        return out
    finally:
        _host_delete(host)


def _lower_own(store: Any, v: Any, val: Any) -> None:
    if isinstance(v, HostOwn):
        ptr = _host_own_to_any(store, v)
    elif isinstance(v, ResourceHost):
        ptr = v.to_any(store)._consume()
    elif isinstance(v, ResourceAny):
        ptr = v._consume()
    else:
        raise TypeError(f"expected HostOwn, ResourceAny or ResourceHost for own, got {type(v).__name__}")
    val.kind = RESOURCE
    val.of.resource = ptr


def _lower_borrow(store: Any, v: Any, val: Any) -> None:
    val.kind = RESOURCE
    if isinstance(v, ResourceAny):
        val.of.resource = _resource_clone(v.ptr())
    elif isinstance(v, ResourceHost):
        val.of.resource = v.to_any(store)._consume()
    else:
        raise TypeError(f"expected ResourceAny or ResourceHost for borrow, got {type(v).__name__}")


# -- lists, records, tuples ------------------------------------------------------------------


def _abandon(raw: Any, done: int, n: int, delete: Any) -> None:
    """A list or tuple whose lowering failed after ``done`` of its ``n`` values: the rest
    are cleared (their memory was never set) and the whole freed."""
    data = raw.data
    for j in range(done, n):
        _clear(data[j])
    delete(_byref(raw))


def _clear(val: Any) -> None:
    """Mark a slot whose value was moved out (or never written) as holding nothing to free."""
    val.kind = BOOL
    val.of.boolean = False


def _list(ty: Any) -> ValueCodec:
    el_ty = ty.element
    el = codec(el_ty)
    num = _NUMBERS.get(type(el_ty))
    is_bytes = isinstance(el_ty, wc.U8)
    cls = (bytes,) if is_bytes else (list,)
    dtype = (
        np.dtype(
            {"names": ["k", "v"], "formats": ["u1", num[2]], "offsets": [0, _UNION_AT], "itemsize": _VAL_SIZE}
        )
        if num is not None
        else None
    )
    el_lift, el_lower = el.lift, el.lower

    def view(data: Any, n: int) -> np.ndarray:
        addr = ctypes.cast(data, ctypes.c_void_p).value
        return np.frombuffer((ctypes.c_char * (n * _VAL_SIZE)).from_address(addr), dtype=dtype)

    def lift(val: Any) -> Any:
        raw = val.of.list
        n = raw.size
        try:
            if dtype is not None and n >= NUMPY_FROM:
                values = view(raw.data, n)["v"]
                return values.tobytes() if is_bytes else values.tolist()
            data = raw.data
            out = []
            for i in range(n):
                item = data[i]
                out.append(el_lift(item))
                _clear(item)
            return bytes(out) if is_bytes else out
        finally:
            _list_delete(_byref(raw))

    def lower(store: Any, v: Any, val: Any) -> None:
        if is_bytes:
            if not isinstance(v, (bytes, bytearray)):
                raise TypeError(f"expected bytes for list<u8>, got {type(v).__name__}")
        elif not isinstance(v, (list, tuple)):
            raise TypeError(f"expected a list for list<{el.what}>, got {type(v).__name__}")
        n = len(v)
        raw = ffi.wasmtime_component_vallist_t()
        _list_new(raw, n)
        done = 0
        try:
            if dtype is not None and n >= NUMPY_FROM:
                arr = np.frombuffer(bytes(v), np.uint8) if is_bytes else np.asarray(v)
                if arr.dtype.kind not in ("f" if el.classes == (float,) else "") + (
                    "b" if num[0] == BOOL else "iu"
                ):
                    raise TypeError(f"expected {el.classes[0].__name__} elements for list<{el.what}>")
                out = view(raw.data, n)
                out["k"] = num[0]
                out["v"] = arr
                done = n
            else:
                data = raw.data
                for x in v:
                    el_lower(store, x, data[done])
                    done += 1
        except BaseException:
            _abandon(raw, done, n, _list_delete)
            raise
        val.kind = LIST
        val.of.list = raw

    return ValueCodec(lift, lower, cls, f"list<{el.what}>")


def _record(ty: Any) -> ValueCodec:
    fields = [(name, codec(t)) for name, t in ty.fields]
    names = [(name, name.encode("utf-8")) for name, _ in fields]
    n = len(fields)

    def lift(val: Any) -> wc.Record:
        raw = val.of.record
        out = wc.Record()
        try:
            data = raw.data
            for i, (name, c) in enumerate(fields):
                item = data[i].val
                setattr(out, name, c.lift(item))
                _clear(item)
            return out
        finally:
            _record_delete(_byref(raw))

    def lower(store: Any, v: Any, val: Any) -> None:
        raw = ffi.wasmtime_component_valrecord_t()
        _record_new(raw, n)
        data = raw.data
        done = 0
        try:
            for (name, c), (_, encoded) in zip(fields, names, strict=True):
                entry = data[done]
                c.lower(store, getattr(v, name), entry.val)
                entry.name = _byte_vec(encoded)
                done += 1
        except BaseException:
            for j in range(done, n):
                _clear(data[j].val)
                data[j].name = _byte_vec(names[j][1])
            _record_delete(_byref(raw))
            raise
        val.kind = RECORD
        val.of.record = raw

    return ValueCodec(lift, lower, (wc.Record,), "record{" + ",".join(nm for nm, _ in fields) + "}")


def _tuple(ty: Any) -> ValueCodec:
    parts = [codec(t) for t in ty.elements]
    n = len(parts)

    def lift(val: Any) -> tuple:
        raw = val.of.tuple
        try:
            data = raw.data
            out = []
            for i, c in enumerate(parts):
                item = data[i]
                out.append(c.lift(item))
                _clear(item)
            return tuple(out)
        finally:
            _tuple_delete(_byref(raw))

    def lower(store: Any, v: Any, val: Any) -> None:
        if not isinstance(v, tuple) or len(v) != n:
            raise TypeError(f"expected a tuple of {n} for tuple<{','.join(c.what for c in parts)}>")
        raw = ffi.wasmtime_component_valtuple_t()
        _tuple_new(raw, n)
        data = raw.data
        done = 0
        try:
            for c, x in zip(parts, v, strict=True):
                c.lower(store, x, data[done])
                done += 1
        except BaseException:
            _abandon(raw, done, n, _tuple_delete)
            raise
        val.kind = TUPLE
        val.of.tuple = raw

    return ValueCodec(lift, lower, (tuple,), f"tuple<{','.join(c.what for c in parts)}>")


# -- variants, options, results --------------------------------------------------------------


def _variant_like(ty: Any, kind: int, cases: list[tuple[str, Any]]) -> ValueCodec:
    what = {OPTION: "option", RESULT: "result", VARIANT: "variant"}[kind]
    tagged = ty._tagged()  # wasmtime-py's own rule, read once
    built = [(name, None if t is None else codec(t)) for name, t in cases]
    by_name = dict(built)
    index = {name: i for i, (name, _) in enumerate(built)}
    encoded = {name: name.encode("utf-8") for name, _ in built}

    def pick(v: Any) -> tuple[str, Any]:
        """(case name, payload) of a Python value."""
        if tagged:
            if not isinstance(v, wc.Variant) or v.tag not in by_name:
                raise TypeError(f"expected a Variant with a tag of {list(by_name)}, got {v!r}")
            return v.tag, v.payload
        for name, c in built:
            if c is None:
                if v is None:
                    return name, None
            elif isinstance(v, c.classes):
                return name, v
        raise ValueError(f"value not valid for this {what}: {v!r}")

    def payload_box(store: Any, c: Any, payload: Any) -> Any:
        if c is None:
            return None
        raw = Val()
        c.lower(store, payload, raw)
        return _val_new(_byref(raw))

    def unbox(name: str, box: Any) -> Any:
        c = by_name[name]
        if c is None:
            return wc.Variant(name) if tagged else None
        item = box.contents
        payload = c.lift(item)
        _clear(item)
        _val_delete(box)
        return wc.Variant(name, payload) if tagged else payload

    if kind == OPTION:

        def lift(val: Any) -> Any:
            box = val.of.option
            return unbox("some" if box else "none", box)

        def lower(store: Any, v: Any, val: Any) -> None:
            name, payload = pick(v)
            box = payload_box(store, by_name[name], payload)
            val.kind = OPTION
            val.of.option = box

    elif kind == RESULT:

        def lift(val: Any) -> Any:
            r = val.of.result
            return unbox("ok" if r.is_ok else "err", r.val)

        def lower(store: Any, v: Any, val: Any) -> None:
            name, payload = pick(v)
            box = payload_box(store, by_name[name], payload)
            val.kind = RESULT
            val.of.result.is_ok = name == "ok"
            val.of.result.val = box

    else:

        def lift(val: Any) -> Any:
            var = val.of.variant
            name = _take_text(var.discriminant)
            if name not in index:
                raise ValueError(f"tag {name} not found in variant cases")
            return unbox(name, var.val)

        def lower(store: Any, v: Any, val: Any) -> None:
            name, payload = pick(v)
            box = payload_box(store, by_name[name], payload)
            val.kind = VARIANT
            val.of.variant.discriminant = _byte_vec(encoded[name])
            val.of.variant.val = box

    classes: tuple[type, ...]
    if tagged:
        classes = (wc.Variant,)
    else:
        found: list[type] = []
        for _, c in built:
            for k in (object,) if c is None else c.classes:
                if k not in found:
                    found.append(k)
        classes = tuple(found)
    return ValueCodec(lift, lower, classes, what)
