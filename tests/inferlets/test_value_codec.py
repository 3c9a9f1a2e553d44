"""inferlets/host/value_codec.py against wasmtime-py's own converters, on real component
types (a WAT component compiled by wasmtime): what one side lowers the other lifts to the
same Python value, for every kind of type Pie's world uses (and char, flags, enums)."""

from __future__ import annotations

import ctypes

import pytest
import wasmtime
from wasmtime import _ffi as ffi
from wasmtime import component as wc

from inferlets.host.value_codec import NUMPY_FROM, codec

WAT = """
(component
  (type $rec' (record (field "a" u32) (field "b-c" string) (field "d" (list u8))))
  (import "rec" (type $rec (eq $rec')))
  (type $var' (variant (case "none") (case "num" u32) (case "txt" string) (case "pair" (tuple u32 f32))))
  (import "var" (type $var (eq $var')))
  (type $en' (enum "red" "green"))
  (import "en" (type $en (eq $en')))
  (type $fl' (flags "x" "y" "z"))
  (import "fl" (type $fl (eq $fl')))
  (import "f" (func
    (param "rec" $rec) (param "var" $var) (param "en" $en) (param "fl" $fl)
    (param "opt" (option u32)) (param "optopt" (option (option u32)))
    (param "res" (result u64 (error string))) (param "floats" (list f32)) (param "ch" char)
    (param "vars" (list $var)) (param "ids" (list u32)) (param "bools" (list bool))
    (param "bytes" (list u8)) (param "pairs" (list (tuple u32 f32))) (param "s64" s64)
    (param "f64" f64) (param "strs" (list string)) (param "unit" (result))
    (result (result (list (tuple u32 f32)) (error $rec)))))
)
"""


@pytest.fixture(scope="module")
def types() -> dict[str, object]:
    engine = wasmtime.Engine()
    comp = wc.Component(engine, WAT)
    f = comp.type.imports(engine)["f"]
    f = f.ty if type(f).__name__ == "ComponentExtern" else f
    out = dict(f.params)
    out["result"] = f.result
    return out


def record(**fields: object) -> wc.Record:
    r = wc.Record()
    for k, v in fields.items():
        setattr(r, k.replace("_", "-"), v)
    return r


SAMPLES: dict[str, list[object]] = {
    "rec": [record(a=7, b_c="héllo", d=b"\x00\x01\xff"), record(a=0, b_c="", d=b"")],
    # untagged (wasmtime-py's rule: no two cases lift to the same Python class)
    "var": [None, 4_000_000_000, "t", (3, 0.5)],
    "en": ["red", "green"],
    "fl": [set(), {"x", "z"}, {"x", "y", "z"}],
    "opt": [None, 0, 12],
    "optopt": [wc.Variant("none"), wc.Variant("some", None), wc.Variant("some", 5)],
    "res": [18_000_000_000_000_000_000, "bad"],
    "floats": [[], [0.25], [float(i) / 4 for i in range(NUMPY_FROM * 40)]],
    "ch": ["a", "é"],
    "vars": [[], [1, "x", None, (2, 0.75)]],
    "ids": [[], [5], list(range(0, 4 * NUMPY_FROM * 1000, 3)), [2**32 - 1] * NUMPY_FROM],
    "bools": [[True, False], [i % 3 == 0 for i in range(NUMPY_FROM * 5)]],
    "bytes": [b"", b"ab", bytes(range(256))],
    "pairs": [[], [(1, 0.5), (2, 1.5)]],
    "s64": [-(2**63), 2**63 - 1],
    "f64": [0.1, -1e300],
    "strs": [[], ["a", "", "ünï"]],
    "unit": [wc.Variant("ok"), wc.Variant("err")],  # tagged: both cases lift to None
    "result": [[(1, 0.5)], record(a=1, b_c="x", d=b"\x02")],
}


def ours_then_theirs(ty: object, value: object) -> object:
    val = ffi.wasmtime_component_val()
    codec(ty).lower(None, value, val)
    return ty.convert_from_c(val)


def theirs_then_ours(ty: object, value: object) -> object:
    val = ffi.wasmtime_component_val()
    ty.convert_to_c(None, value, ctypes.pointer(val))
    return codec(ty).lift(val)


def ours_both_ways(ty: object, value: object) -> object:
    val = ffi.wasmtime_component_val()
    c = codec(ty)
    c.lower(None, value, val)
    return c.lift(val)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_value_crosses_both_ways_equal_to_wasmtime_py(types: dict[str, object], name: str) -> None:
    ty = types[name]
    for value in SAMPLES[name]:
        for way in (ours_then_theirs, theirs_then_ours, ours_both_ways):
            got = way(ty, value)
            assert got == value, f"{name} via {way.__name__}: {got!r} != {value!r}"
            assert type(got) is type(value), f"{name} via {way.__name__}: {type(got)} != {type(value)}"


def test_lists_of_numbers_come_back_as_python_numbers(types: dict[str, object]) -> None:
    many = list(range(NUMPY_FROM * 3))
    got = ours_both_ways(types["ids"], many)
    assert got == many and all(type(x) is int for x in got)
    floats = ours_both_ways(types["floats"], [float(x) for x in many])
    assert all(type(x) is float for x in floats)


def test_the_codec_of_a_type_says_what_it_is(types: dict[str, object]) -> None:
    assert repr(codec(types["ids"])) == "ValueCodec(list<u32>)"
    assert "record{a,b-c,d}" in repr(codec(types["rec"]))


@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        ("ids", [1, 2, "3"], TypeError),
        ("ids", [1.5] * NUMPY_FROM, TypeError),
        ("floats", ["x"] * NUMPY_FROM, TypeError),
        ("strs", ["a", "b", 3, "d"], TypeError),
        ("rec", record(a=1, b_c=2, d=b""), TypeError),
        ("var", wc.Variant("num", 1), ValueError),
        ("var", 1.5, ValueError),
        ("unit", None, TypeError),
        ("unit", wc.Variant("maybe"), TypeError),
        ("en", "blue", TypeError),
        ("fl", ["x"], TypeError),
        ("opt", "x", ValueError),
        ("ch", "ab", TypeError),
        ("bytes", [1, 2], TypeError),
        ("pairs", [(1, 0.5), (2,)], TypeError),
    ],
)
def test_a_value_of_the_wrong_shape_is_a_typed_error(
    types: dict[str, object], name: str, value: object, error: type[Exception]
) -> None:
    """What a host function returns wrongly is refused before anything reaches the guest, and
    a half-built list or record is freed (no crash, and the next value crosses fine)."""
    val = ffi.wasmtime_component_val()
    with pytest.raises(error):
        codec(types[name]).lower(None, value, val)
    good = SAMPLES[name][-1]
    assert ours_both_ways(types[name], good) == good
