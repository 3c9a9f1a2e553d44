"""One forward pass over the pending work of many sequences.

Every sequence contributes a ``StepInput`` (a prefill chunk or one decode token): its
token ids, absolute positions, media embeddings for the placeholder rows in it, the
page table that covers its rows and how many rows its KV already holds. ``ForwardRunner``
flattens them into one batch row (see ``engine.attention``), builds the K/V slot of
every row, runs the architecture's language model once and returns, per sequence, the
logits it asked for (none, the last row's, or every row's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch

from engine import sampling_kernel, step_timing
from engine.architectures import Architecture, TextInputs
from engine.attention import AttentionBackend, BatchMeta, SeqMeta
from engine.errors import InvalidRequestError
from engine.kv_pool import KVPool
from engine.lora import pass_adapters
from engine.pass_sampling import SampleRequest, sample_pass

if TYPE_CHECKING:
    from encoders import Encoded, Prepared

LogitsWanted = Literal["none", "last", "all", "hidden", "states", "last+hidden", "head", "rows"]
"""What a step wants back: nothing, the last row's logits, every row's logits, the last
row's final hidden state, every row's final hidden states ("states", for embeddings), or
the last row's logits and its final hidden state as a pair ("last+hidden": a prompt's
prefill, whose hidden state the prefix cache keeps with its last page), or "head": what the
runner's ``BatchedHead`` makes of the last row's final hidden state (CSM's depth decoder),
computed in one batch for every "head" step of the pass; or "rows": the logits of the rows
``StepInput.out_rows`` names and the final hidden states of those ``hidden_rows`` names, as
a pair (``engine.forward_pass``'s sampler slots)."""
Encode = Callable[[list["Prepared"]], list["Encoded"]]


class GraphReplay(Protocol):
    """What the runner asks of ``engine.decode_graphs.DecodeGraphs`` (not imported: it
    builds on this file)."""

    inputs: str

    def takes(self, steps: Sequence[StepInput]) -> bool: ...

    def run(self, steps: Sequence[StepInput]) -> Sequence[torch.Tensor]: ...

    def launch(
        self, steps: Sequence[StepInput], fed: Any = None, fed_rows: Sequence[tuple[int, int]] = ()
    ) -> Any: ...

    def finish(self, launched: Any) -> list[torch.Tensor]: ...


class BatchedHead(Protocol):
    """Work on the last hidden state of every "head" step of a pass, done in one batch on
    the forward worker (CSM: codebook 0 from the backbone's head, then the depth decoder's
    codebook steps for all streams at once). ``requests[i]`` is ``StepInput.head`` of the
    step whose state is ``hidden[i]``; returns one result per step, in order."""

    def run(self, hidden: torch.Tensor, requests: Sequence[Any]) -> list[Any]: ...


@dataclass
class MediaRows:
    """Rows of one step that take embeddings of one media item."""

    rows: torch.Tensor
    """(M,) row indices inside the step."""
    prepared: Prepared
    index: torch.Tensor
    """(M,) which rows of the item's encoder output they take (placeholder ordinals)."""


@dataclass
class StepInput:
    tokens: list[int]
    positions: torch.Tensor | None
    """(n_axes, len(tokens)) long, absolute; None for a one-row step that gives ``pos``."""
    kv_start: int
    pages: list[int]
    """Page table covering ``kv_start + len(tokens)`` rows."""
    media: list[MediaRows] = field(default_factory=list)
    block_ids: torch.Tensor | None = None
    """(len(tokens),) bidirectional block id per row (-1 none), or None."""
    logits: LogitsWanted = "last"
    adapters: tuple = ()
    """(Adapter, scale) pairs this step's rows run under (``engine.lora``)."""
    embeds: torch.Tensor | None = None
    """(len(tokens), hidden) input embeddings of every row, used instead of embedding
    ``tokens`` (CSM: a prompt's merged text/audio embeddings, a generated frame's summed
    codebook embeddings); ``tokens`` then only name the rows (page keys, batch sizes)."""
    head: Any = None
    """With ``logits="head"``: this step's request to the runner's ``BatchedHead``."""
    argmax: int | None = None
    """Set by the runner for a "last" step when ``ForwardRunner.batch_argmax`` is on: the
    argmax of its logits, read for the whole pass in one device-to-host copy (a greedy
    context then needs no read of its own)."""
    sample: SampleRequest | None = None
    """For a "last" or "last+hidden" step: sample its last row in the pass, batched with
    the pass's other requests (``engine.pass_sampling``); the token lands in ``sampled``."""
    sampled: int | None = None
    after: StepInput | None = None
    """A decode step submitted before its token is known (``engine.scheduler``'s overlap):
    its one row's token is the one ``after`` (an earlier pass's step of the same context)
    sampled (``sampled``, else ``argmax`` for a greedy step without a sample request)."""
    dispatched: bool = False
    """Set by the scheduler when the step's pass is handed to the forward worker."""
    started: float = 0.0
    """``time.perf_counter()`` when the worker began the step's pass, while
    ``engine.step_timing`` records (else 0.0): a hand-built pass's queueing time."""
    skipped: bool = False
    """Set by the scheduler when ``after`` gave no token (its pass failed or its row could
    not be sampled): the step was not run and its result is ``engine.scheduler.SKIPPED``."""
    rng_state: tuple[torch.Tensor, torch.Tensor | None] | None = None
    """For an ``after`` step sampled with a seeded generator: the generator's state before
    and after this row drew, so a context that drops the step (it stopped one token
    earlier) can give the draw back when nothing drew since (``engine.pass_sampling``)."""
    pos: tuple[int, ...] | None = None
    """A one-row step's position per axis, in place of ``positions``: a decode step builds
    no tensor of its own; the runner builds the pass's positions at once (``pass_positions``)."""
    mask: torch.Tensor | None = None
    """(len(tokens), kv_start + len(tokens)) boolean attention mask (True = attend) chosen
    by the caller, in place of the causal rule (``engine.attention.SeqMeta.mask``)."""
    out_rows: tuple[int, ...] = ()
    """With ``logits="rows"``: the rows (indices into ``tokens``) whose logits come back."""
    hidden_rows: tuple[int, ...] = ()
    """With ``logits="rows"``: the rows whose final hidden states come back."""


class ForwardRunner:
    def __init__(
        self,
        arch: Architecture,
        pool: KVPool,
        *,
        device: torch.device,
        encode: Encode | None = None,
        backend: AttentionBackend | None = None,
    ):
        self.arch = arch
        self.encode = encode
        self.pool = pool
        self.device = device
        self.backend = backend
        self.block_overlay_layers = arch.block_overlay_layers()
        self.passes = 0
        self.rows_computed = 0
        self.batch_argmax = device.type == "cuda"
        """Compute every "last" step's argmax in one go per pass (``StepInput.argmax``): on
        CUDA it saves each greedy context a kernel launch and a synchronising read."""
        self.graphs: GraphReplay | None = None
        """One-token decode passes replayed from CUDA graphs (``engine.decode_graphs``), or None."""
        self.head: BatchedHead | None = None
        """What "head" steps get back (``BatchedHead``); None: such steps are refused."""
        if device.type == "cpu":
            sampling_kernel.warm_in_background()  # the passes' sampler, before a request needs it

    def run(self, steps: list[StepInput]) -> list[torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None]:
        """Per step: (V,) logits for "last", (rows, V) for "all", the last row's (H,) final
        hidden state for "hidden", (rows, H) for "states", ((V,), (H,)) for "last+hidden",
        None for "none"."""
        if not steps:
            return []
        if self.graphs is not None and self.graphs.takes(steps):
            replayed: list = list(self.graphs.run(steps))
            _sample_timed(steps, replayed)
            return replayed
        t_inputs = step_timing.start()
        dev = self.device
        ps = self.pool.page_size
        ids: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        pages_flat: list[int] = []
        blocks: list[torch.Tensor] = []
        media_rows: list[torch.Tensor] = []
        media: list[MediaRows] = []
        direct_rows: list[torch.Tensor] = []
        direct_embeds: list[torch.Tensor] = []
        start = 0
        lora_rows: dict[tuple[int, float], tuple[object, float, list[int]]] = {}
        for step in steps:
            n = len(step.tokens)
            for adapter, scale in step.adapters:
                entry = lora_rows.setdefault((id(adapter), scale), (adapter, scale, []))
                entry[2].extend(range(start, start + n))
            if n == 0:
                raise ValueError("a forward step must compute at least one row")
            need_pages = -(-(step.kv_start + n) // ps)
            if len(step.pages) < need_pages:
                raise RuntimeError(
                    f"page table covers {len(step.pages) * ps} rows, {step.kv_start + n} needed"
                )
            ids.extend(step.tokens)
            table = step.pages[:need_pages]
            tables.append(table)
            pages_flat.extend(table)
            # Each row's K/V slot; in Python for a decode step's row or few (a tensor op
            # per step costs more than the arithmetic, hundreds of steps per pass).
            if n == 1:
                kv = step.kv_start
                slots.append(table[kv // ps] * ps + kv % ps)
            elif n <= 16:
                slots.extend(table[r // ps] * ps + r % ps for r in range(step.kv_start, step.kv_start + n))
            else:
                rows = torch.arange(step.kv_start, step.kv_start + n)
                slots.extend((torch.tensor(table)[rows // ps] * ps + rows % ps).tolist())
            if step.block_ids is not None:
                blocks.append(step.block_ids.to(torch.long))
            for m in step.media:
                media_rows.append(m.rows + start)
                media.append(m)
            if step.embeds is not None:
                if step.embeds.shape[0] != n or step.media:
                    raise ValueError("a step's embeds cover all of its rows, and it then has no media")
                direct_rows.append(torch.arange(start, start + n))
                direct_embeds.append(step.embeds)
            if step.logits == "head" and self.head is None:
                raise ValueError('a "head" step needs a runner with a BatchedHead')
            start += n
        media_rows.extend(direct_rows)  # after the encoded media's rows, as their embeddings below

        # Every index tensor of the pass reaches the device in one copy (on CUDA: from
        # pinned memory, without a stream sync; one `.to(device)` per tensor would be a
        # synchronising copy each, dozens per decode pass at high concurrency).
        positions_cpu = pass_positions(steps, self.arch.position_axes)
        (ids_d, positions_flat, slots_d, media_rows_d, pages_d, blocks_d) = upload_indices(
            [
                torch.tensor(ids, dtype=torch.long),
                positions_cpu.reshape(-1),
                torch.tensor(slots, dtype=torch.long),
                torch.cat(media_rows) if media_rows else torch.empty(0, dtype=torch.long),
                torch.tensor(pages_flat, dtype=torch.long),
                torch.cat(blocks) if blocks else torch.empty(0, dtype=torch.long),
            ],
            dev,
        )
        seqs: list[SeqMeta] = []
        at_q = at_page = at_block = 0
        for step, table in zip(steps, tables, strict=True):
            n = len(step.tokens)
            first = table[0]
            consecutive = table[-1] - first == len(table) - 1 and table == list(
                range(first, first + len(table))
            )
            block_ids = None
            if step.block_ids is not None:
                block_ids = blocks_d[at_block : at_block + n]
                at_block += n
            end_page = at_page + len(table)
            seqs.append(
                SeqMeta(
                    at_q,
                    n,
                    step.kv_start,
                    None,
                    block_ids,
                    first if consecutive else None,
                    pages_of=pages_d,
                    at=at_page,
                    end=end_page,
                    mask=None if step.mask is None else step.mask.to(dev, non_blocking=True),
                )
            )
            at_q += n
            at_page = end_page

        media_embeds, media_deepstack = self._encode(media)
        media_embeds.extend(direct_embeds)
        media_deepstack.extend([None] * len(direct_embeds))
        deepstack = None
        if media_rows and any(d for d in media_deepstack):
            depth = max(len(d) for d in media_deepstack if d)
            deepstack = []
            for layer in range(depth):
                parts = []
                for emb, d in zip(media_embeds, media_deepstack, strict=True):
                    parts.append(d[layer] if d and layer < len(d) else torch.zeros_like(emb))
                deepstack.append(torch.cat(parts).to(dev))
        inp = TextInputs(
            ids=ids_d,
            positions=positions_flat.view(positions_cpu.shape),
            media_rows=media_rows_d,
            media_embeds=torch.cat([e.to(dev) for e in media_embeds]) if media_embeds else None,
            deepstack=deepstack,
        )
        meta = BatchMeta(
            pool=self.pool,
            seqs=seqs,
            slots=slots_d,
            block_overlay_layers=self.block_overlay_layers,
            backend=self.backend,
        )
        lora_table = [
            (torch.tensor(rows, dtype=torch.long, device=dev), adapter, scale)
            for adapter, scale, rows in lora_rows.values()
        ]
        step_timing.stop("worker: inputs (indices, encoder, copies)", t_inputs)
        t_model = step_timing.start()
        # A decode pass (every step one row, "last"): its logits are every row's, one per
        # step, without the per-step bookkeeping below (hundreds of steps a pass).
        decode = start == len(steps) and all(step.logits == "last" for step in steps)
        if decode:
            with torch.inference_mode(), pass_adapters(lora_table):
                logits = self.arch.logits(self.arch.hidden_states(inp, pie_batch=meta)).float()
            step_timing.stop("worker: model (eager)", t_model)
            self.passes += 1
            self.rows_computed += start
            rows = list(logits.unbind(0))
            if self.batch_argmax:
                _set_argmax(steps, logits)
            _sample_timed(steps, rows)
            return rows  # type: ignore[return-value]
        with torch.inference_mode(), pass_adapters(lora_table):
            hidden = self.arch.hidden_states(inp, pie_batch=meta)
            want_rows: list[int] = []
            for step, seq in zip(steps, seqs, strict=True):
                if step.logits in ("last", "last+hidden"):
                    want_rows.append(seq.q_start + seq.q_len - 1)
                elif step.logits == "all":
                    want_rows.extend(range(seq.q_start, seq.q_start + seq.q_len))
                elif step.logits == "rows":
                    want_rows.extend(seq.q_start + r for r in step.out_rows)
            logits = None
            if len(want_rows) == start:  # every row (a decode pass): no gather
                logits = self.arch.logits(hidden).float()
            elif want_rows:
                logits = self.arch.logits(hidden[torch.tensor(want_rows, device=dev)]).float()
            head_steps = [
                seq.q_start + seq.q_len - 1
                for step, seq in zip(steps, seqs, strict=True)
                if step.logits == "head"
            ]
            head_out: list[Any] = []
            if head_steps:
                assert self.head is not None
                head_out = self.head.run(
                    hidden[torch.tensor(head_steps, device=dev)],
                    [s.head for s in steps if s.logits == "head"],
                )
            last_hidden = [
                hidden[seq.q_start + seq.q_len - 1].clone()
                if step.logits in ("hidden", "last+hidden")
                else hidden[seq.q_start : seq.q_start + seq.q_len].clone()
                if step.logits == "states"
                else hidden[torch.tensor([seq.q_start + r for r in step.hidden_rows], device=dev)].float()
                if step.logits == "rows" and step.hidden_rows
                else None
                for step, seq in zip(steps, seqs, strict=True)
            ]
        step_timing.stop("worker: model (eager)", t_model)
        self.passes += 1
        self.rows_computed += start

        out: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None] = []
        last_rows: list[tuple[StepInput, int]] = []  # "last" steps and their row in ``logits``
        at = 0
        heads = iter(head_out)
        for step, h in zip(steps, last_hidden, strict=True):
            if step.logits == "none":
                out.append(None)
            elif step.logits == "head":
                out.append(next(heads))
            elif step.logits in ("hidden", "states"):
                out.append(h)
            elif step.logits == "rows":
                k = len(step.out_rows)
                out.append((logits[at : at + k] if k else None, h))
                at += k
            elif step.logits in ("last", "last+hidden"):
                assert logits is not None
                if step.logits == "last":
                    last_rows.append((step, at))
                out.append(logits[at] if step.logits == "last" else (logits[at], h))
                at += 1
            else:
                assert logits is not None
                n = len(step.tokens)
                out.append(logits[at : at + n])
                at += n
        if self.batch_argmax and last_rows:
            assert logits is not None
            picked = logits
            if len(last_rows) != logits.shape[0]:
                picked = logits[torch.tensor([r for _, r in last_rows], device=logits.device)]
            _set_argmax([step for step, _ in last_rows], picked)
        _sample_timed(steps, out)
        return out

    def can_launch(self, steps: Sequence[StepInput]) -> bool:
        """Whether ``launch`` takes this pass: a token-id decode pass the graphs replay,
        with the pass's argmax read by the runner (``batch_argmax``)."""
        graphs = self.graphs
        return (
            graphs is not None
            and self.batch_argmax
            and graphs.inputs == "ids"
            and bool(steps)
            and graphs.takes(steps)
        )

    def launch(
        self, steps: list[StepInput], fed: Any = None, fed_rows: Sequence[tuple[int, int]] = ()
    ) -> Any:
        """``run``'s first half for a pass ``can_launch`` takes: started, not waited for
        (``engine.decode_graphs.DecodeGraphs.launch``; ``fed``/``fed_rows``: token ids
        taken on the device from an earlier launched pass's argmax)."""
        assert self.graphs is not None
        return self.graphs.launch(steps, fed, fed_rows)

    def finish(self, launched: Any) -> list[torch.Tensor]:
        """``run``'s second half: wait for the pass's tokens, sample the rows that asked,
        return each step's (V,) logits."""
        assert self.graphs is not None
        out = self.graphs.finish(launched)
        _sample_timed(launched.steps, out)
        return out

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """(V,) float32 logits of one final hidden state kept by a "hidden" step."""
        with torch.inference_mode():
            return self.arch.logits(hidden[None].to(self.device))[0].float()

    def _encode(self, media: list[MediaRows]) -> tuple[list[torch.Tensor], list[list[torch.Tensor] | None]]:
        """Encoder output rows for every media slice of the batch: each distinct item runs
        through the tower once per pass (and not at all when the encoder cache has it)."""
        if not media:
            return [], []
        if self.encode is None:
            raise RuntimeError("this runner has no media encoder")
        unique: dict[str, Prepared] = {}
        for m in media:
            unique.setdefault(m.prepared.cache_key, m.prepared)
        encoded = dict(zip(unique, self.encode(list(unique.values())), strict=True))
        embeds, deepstack = [], []
        for m in media:
            enc = encoded[m.prepared.cache_key]
            if enc.embeddings.shape[0] != m.prepared.token_count:
                raise InvalidRequestError(
                    f"the encoder gave {enc.embeddings.shape[0]} rows for {m.prepared.token_count} placeholders"
                )
            idx = m.index.to(enc.embeddings.device)
            embeds.append(enc.embeddings[idx])
            deepstack.append([d[idx] for d in enc.deepstack] if enc.deepstack else None)
        return embeds, deepstack


def _set_argmax(steps: Sequence[StepInput], logits: torch.Tensor) -> None:
    """``StepInput.argmax`` of each step from its row of ``logits``, read in one copy."""
    t0 = step_timing.start()
    for step, best in zip(steps, logits.argmax(dim=-1).tolist(), strict=True):
        step.argmax = best
    step_timing.stop("worker: argmax (with its device-to-host read)", t0)


def _sample_timed(steps: Sequence[StepInput], out: Sequence[Any]) -> None:
    t0 = step_timing.start()
    sample_pass(steps, out)
    step_timing.stop("worker: sampling (with its device-to-host read)", t0)


def pass_positions(steps: Sequence[StepInput], axes: int) -> torch.Tensor:
    """(axes, rows) long: every step's positions in pass order, one array for the one-row
    steps that give ``pos`` (a decode pass: one numpy call, not a tensor per step)."""
    if all(step.pos is not None for step in steps):
        table = np.array([step.pos for step in steps], dtype=np.int64).reshape(len(steps), axes)
        return torch.from_numpy(np.ascontiguousarray(table.T))
    parts = []
    for step in steps:
        if step.pos is not None:
            parts.append(torch.tensor(step.pos, dtype=torch.long).view(axes, 1))
        else:
            assert step.positions is not None, "a step gives positions or pos"
            parts.append(step.positions.to(torch.long))
    return torch.cat(parts, dim=1)


def upload_indices(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """1-D long CPU tensors -> views of one tensor on ``device``, copied in one transfer
    (pinned and non-blocking on CUDA: the stream orders it before the kernels that read
    it, and the host does not wait). On the CPU, ``parts`` themselves."""
    if device.type == "cpu":
        return parts
    flat = torch.cat(parts)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    out, at = [], 0
    for p in parts:
        out.append(flat[at : at + p.numel()])
        at += p.numel()
    return out
