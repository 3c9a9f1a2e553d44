"""Portable context snapshots: ``Context.snapshot() -> bytes``, ``Context.resume(model, data)``.

A snapshot holds what rebuilds the context's rows exactly: its text runs (token ids) and
media spans (each span's ``Prepared``: ids, positions, the model inputs), plus the chat
state, the sampling seed and generator state, the context's default sampler and stop
condition (``ctx.sampler`` / ``ctx.stop``; a custom sampler is code and stays behind),
and the model's fingerprint. By default KV
pages are not stored: a resumed context recomputes them on its next pass (the prefix
cache makes that free when the same prefix is still published), and then continues
greedy generation exactly as the original would. ``include_kv=True`` also stores the K/V
of every committed row (per storing layer, in the pool's storage: a quantized pool's int8
/ fp8 values with their per-row scales; the manifest records the ``kv_dtype`` and a pool
storing another refuses it with ``SnapshotModelMismatchError``) and which adapter stack
computed them: the resumed context takes fresh pages, writes them back and computes only
its last row again (its logits are not stored), on another process or machine too.

Format (version 1), all little-endian, no pickle anywhere (snapshots may come from
users): ``MAGIC | u32 version | u64 n | manifest JSON (n bytes) | u64 m | safetensors
(m bytes) | SHA-256 of everything before``. A wrong magic is ``NotASnapshotError``; a bad
checksum, truncation or an inconsistent manifest ``SnapshotCorruptError``; another
model's snapshot ``SnapshotModelMismatchError``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from engine import stopping
from engine.chat import ChatState
from engine.errors import NotASnapshotError, SnapshotCorruptError, SnapshotModelMismatchError
from engine.sampling import Sampler
from media.errors import PieMediaError

if TYPE_CHECKING:
    from engine.context import Context
    from engine.model import Model

MAGIC = b"PIESNAP\x00"
VERSION = 1
_DIGEST = 32

_PREPARED_FIELDS = (
    "kind",
    "family",
    "input_ids",
    "placeholder_id",
    "token_count",
    "grid",
    "position_span",
    "prefix_tokens",
    "suffix_tokens",
    "content_hash",
    "cache_key",
    "mm_token_type",
    "timestamps",
)


def model_identity(model: Model) -> str:
    from encoders import model_fingerprint

    return model_fingerprint(model.path, model.config)


def _segments(ctx: Context) -> tuple[list[dict[str, Any]], list[Any]]:
    """The rows as text runs and spans, in order."""
    segments: list[dict[str, Any]] = []
    spans: list[Any] = []
    rows = ctx._rows
    i = 0
    while i < len(rows):
        span = rows[i].span
        if span is None:
            run = []
            while i < len(rows) and rows[i].span is None:
                run.append(rows[i].token)
                i += 1
            segments.append({"text": run})
        else:
            segments.append({"span": len(spans)})
            spans.append(span.prepared)
            i += span.prepared.num_rows
    return segments, spans


def _kv(ctx: Context, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Store the committed rows' K/V; returns the manifest's ``kv`` entry."""
    pool, n = ctx.model.pool, ctx._n
    pages = torch.tensor(ctx._table.covering(n), dtype=torch.long, device=pool.device)
    layers = []
    for i, (k, v) in enumerate(zip(pool.k, pool.v, strict=True)):
        if k is None or v is None:
            continue
        layers.append(i)
        for name, t in _stored(pool, i):
            tensors[f"kv{i}.{name}"] = t.index_select(0, pages).flatten(0, 1)[:n].contiguous().cpu()
    salts = [[start, salt.hex()] for start, salt in ctx._table._salts if start < n] or [[0, ""]]
    return {"rows": n, "layers": layers, "dtype": _kv_dtype(pool), "salts": salts}


def _kv_dtype(pool: Any) -> str:
    """What the pool's pages store, as a snapshot records it: the torch dtype of a float
    pool ("torch.float32", as before quantized pools existed), else the format
    ("int8 (per-row scales)", ``engine.kv_quant``)."""
    fmt = pool.kv_format
    return fmt.describe() if fmt.quantized else str(pool.dtype)


def _stored(pool: Any, i: int) -> list[tuple[str, torch.Tensor]]:
    """A storing layer's per-row tensors: K, V and, for per-row scales, their scales."""
    out = [("k", pool.k[i]), ("v", pool.v[i])]
    if pool.kv_format.scales == "row":
        out += [("k_scale", pool.k_scale[i]), ("v_scale", pool.v_scale[i])]
    return out


def _restore_kv(ctx: Context, kv: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write stored K/V into fresh pages of ``ctx`` and mark those rows committed."""
    pool, table = ctx.model.pool, ctx._table
    n = int(kv["rows"])
    if not 0 <= n <= len(ctx._rows):
        raise SnapshotCorruptError(f"the snapshot stores K/V of {n} rows but holds {len(ctx._rows)}")
    want = [i for i, k in enumerate(pool.k) if k is not None]
    have = _kv_dtype(pool)
    if kv["dtype"] != have:
        raise SnapshotModelMismatchError(
            f"the snapshot's K/V are stored as {kv['dtype']} but this model's KV pool stores {have}; "
            "load the model with the same dtype and kv_dtype, or resume without K/V",
            snapshot_kv_dtype=kv["dtype"],
            model_kv_dtype=have,
        )
    if kv["layers"] != want:
        raise SnapshotModelMismatchError(
            f"the snapshot's K/V (storing layers {kv['layers']}) do not fit this model's "
            f"pool (storing layers {want}); resume without K/V"
        )
    for i in want:
        for name, dst in _stored(pool, i):
            t = tensors[f"kv{i}.{name}"]
            if tuple(t.shape) != (n, *dst.shape[2:]) or t.dtype != dst.dtype:
                raise SnapshotCorruptError(
                    f"stored {name} of layer {i} is {tuple(t.shape)} {t.dtype}, expected "
                    f"{(n, *dst.shape[2:])} {dst.dtype}"
                )
    if n == 0:
        return
    table._salts = [(int(start), bytes.fromhex(salt)) for start, salt in kv["salts"]]
    table.reserve(0, n)  # OutOfPagesError: nothing taken
    ps = pool.page_size
    pages = torch.tensor(table.covering(n), dtype=torch.long, device=pool.device)
    full = len(pages) * ps
    for i in want:
        for name, dst in _stored(pool, i):
            src = _bytes(tensors[f"kv{i}.{name}"]).to(pool.device)
            if full > n:  # the last page is partly filled: pad (those rows are never read)
                src = torch.cat([src, src.new_zeros(full - n, *src.shape[1:])])
            _bytes(dst).index_copy_(0, pages, src.view(len(pages), ps, *src.shape[1:]))
    ctx._n = n
    table.publish(ctx._rows, n)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 as uint8 (CPU torch has no index_copy_ / cat for float8); others unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _sampler_json(s: Sampler | None) -> dict[str, Any] | None:
    """The context's default sampler; a custom one is code and is not stored (None)."""
    if s is None or s.is_custom:
        return None
    return {"temperature": s.temperature, "topk": s.topk, "topp": s.topp, "minp": s.minp}


def snapshot(ctx: Context, *, include_kv: bool = False) -> bytes:
    segments, spans = _segments(ctx)
    tensors: dict[str, torch.Tensor] = {}
    prepared = []
    for k, p in enumerate(spans):
        fields = {name: getattr(p, name) for name in _PREPARED_FIELDS}
        tensors[f"span{k}.positions"] = p.positions.contiguous().cpu()
        for name, t in p.inputs.items():
            tensors[f"span{k}.inputs.{name}"] = t.contiguous().cpu()
        fields["inputs"] = sorted(p.inputs)
        fields["meta"] = json.loads(json.dumps(p.meta, default=str))
        prepared.append(fields)
    generator = ctx._generator
    if generator is not None:
        tensors["generator"] = generator.get_state()
    chat = ctx._chat
    manifest = {
        "model": model_identity(ctx.model),
        "segments": segments,
        "prepared": prepared,
        "chat": {
            "messages": chat.messages,
            "open_turn": chat.open_turn,
            "turn_tokens": chat.turn_tokens,
            "options": chat.options,
        },
        "seed": ctx._seed,
        "rows": len(ctx._rows),
        "sampler": _sampler_json(ctx.sampler),
        "stop": stopping.to_json(ctx.stop),
    }
    if include_kv:
        manifest["kv"] = _kv(ctx, tensors)
    head = json.dumps(manifest, separators=(",", ":")).encode()
    blob = save_tensors(tensors) if tensors else b""
    body = MAGIC + struct.pack("<IQ", VERSION, len(head)) + head + struct.pack("<Q", len(blob)) + blob
    return body + hashlib.sha256(body).digest()


def _parse(data: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise NotASnapshotError(f"a snapshot is bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data.startswith(MAGIC):
        raise NotASnapshotError("these bytes are not a pie-media context snapshot (wrong magic)")
    if len(data) < len(MAGIC) + 12 + 8 + _DIGEST:
        raise SnapshotCorruptError(f"the snapshot is truncated ({len(data)} bytes)")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise SnapshotCorruptError("the snapshot's checksum does not match: it was truncated or altered")
    version, n = struct.unpack_from("<IQ", body, len(MAGIC))
    if version != VERSION:
        raise SnapshotCorruptError(f"snapshot format version {version}; this engine reads version {VERSION}")
    at = len(MAGIC) + 12
    try:
        manifest = json.loads(body[at : at + n])
        (m,) = struct.unpack_from("<Q", body, at + n)
        blob = body[at + n + 8 : at + n + 8 + m]
        tensors = load_tensors(blob) if m else {}
    except (ValueError, struct.error, RuntimeError) as e:
        raise SnapshotCorruptError(f"the snapshot cannot be read: {e}") from None
    return manifest, tensors


def resume(model: Model, data: bytes) -> Context:
    from encoders import Prepared
    from engine.context import Context

    manifest, tensors = _parse(data)
    if manifest.get("model") != model_identity(model):
        raise SnapshotModelMismatchError(
            "the snapshot was taken on another model (its fingerprint differs); resume it on the same checkpoint"
        )
    try:
        spans = []
        for k, fields in enumerate(manifest["prepared"]):
            inputs = {name: tensors[f"span{k}.inputs.{name}"] for name in fields["inputs"]}
            values = {name: fields[name] for name in _PREPARED_FIELDS}
            for name in ("input_ids", "grid", "prefix_tokens", "suffix_tokens", "mm_token_type"):
                values[name] = tuple(values[name])
            if values["timestamps"] is not None:
                values["timestamps"] = tuple(values["timestamps"])
            spans.append(
                Prepared(
                    **values, positions=tensors[f"span{k}.positions"], inputs=inputs, meta=fields["meta"]
                )
            )
        ctx = Context(model, seed=manifest["seed"])
        for seg in manifest["segments"]:
            if "text" in seg:
                ctx._append_text([int(t) for t in seg["text"]])
            else:
                ctx._append_span(spans[seg["span"]])
        chat = manifest["chat"]
        ctx._chat = ChatState(
            list(chat["messages"]),
            bool(chat["open_turn"]),
            [int(t) for t in chat["turn_tokens"]],
            dict(chat.get("options") or {}),  # snapshots saved before options have none
        )
        if "generator" in tensors:
            ctx._generator = torch.Generator()
            ctx._generator.set_state(tensors["generator"])
        if manifest.get("sampler") is not None:
            ctx.sampler = Sampler(**manifest["sampler"])
        ctx.stop = stopping.from_json(manifest.get("stop"))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise SnapshotCorruptError(f"the snapshot's manifest is inconsistent: {e}") from None
    if len(ctx._rows) != manifest["rows"]:
        ctx.close()
        raise SnapshotCorruptError(
            f"the snapshot rebuilds {len(ctx._rows)} rows, it recorded {manifest['rows']}"
        )
    if "kv" in manifest:
        try:
            _restore_kv(ctx, manifest["kv"], tensors)
        except PieMediaError:
            ctx.close()
            raise
        except (KeyError, TypeError, ValueError, IndexError) as e:
            ctx.close()
            raise SnapshotCorruptError(f"the snapshot's K/V are inconsistent: {e}") from None
        except BaseException:
            ctx.close()
            raise
    return ctx
