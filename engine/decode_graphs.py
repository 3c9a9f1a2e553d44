"""Decode passes replayed from CUDA graphs (flashinfer attention).

A decode pass at high concurrency is host-bound: the GPU work of one token per context is
small, and the host launches every kernel of every layer from Python (transformers'
modules, our attention hook). A CUDA graph of the whole pass (embedding, layers, final
norm, LM head) is launched once instead. ``bench/gpu/profile_decode.py`` measures which
side bounds the pass.

What is captured: per batch-size bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to
``max_batch``), the language model and LM head over static input buffers (token ids,
positions, K/V slots) into a static logits buffer, with attention by flashinfer decode
wrappers made for graphs (``use_cuda_graph=True``: their page tables live in fixed
buffers, one set per bucket and layer kind). A pass of B steps runs in its bucket: rows
past B read token 0 at position 0 and write their K/V into a scratch page held for them
(one page of the pool, never given to a context); their attention reads only that page.
Before each replay the host plans the wrappers with the pass's page tables (this writes
the fixed buffers) and copies the inputs into the static buffers, without a sync.

Which passes: every step one new row wanting the last row's logits, no media rows, no
bidirectional blocks, no LoRA adapters, at most ``max_batch`` steps, and a flashinfer
backend with kernels for every layer's head size. Anything else runs as usual. An fp8 KV
pool (``kv_dtype="fp8_e4m3"``) works: its per-layer scales are fixed floats the graphs
hold; int8 K/V never reach here (no flashinfer backend for them).

Embedding-input passes (``inputs="embeds"``, CSM's backbone: ``speech.backbone``): every
step is one row given as its input embedding (``StepInput.embeds``, the previous frame's
summed codebook embeddings) and wants the runner's ``BatchedHead`` on its last hidden
state (``logits="head"``). The graph then reads a static embeddings buffer (B, hidden)
instead of token ids and writes the final hidden states into a static buffer (no LM head);
after the replay the runner's head runs on the pass's rows of it (CSM: the frame head,
itself replayed from ``speech.depth_graphs``). Padding rows embed whatever the buffer holds
and, as above, touch only the scratch page. Graphs of one kind take passes of that kind
only; anything else runs as usual.

``launch`` / ``finish`` split a token-id pass: launched without waiting (its logits
copied on the device, their argmax on its way to the host), finished when the tokens are
read. A pass launched while another runs can take its token ids from that one's argmax on
the device (``engine.scheduler``'s device feed); before planning, a launch waits for the
previous plan's copies (flashinfer stages its tables in a pinned host buffer it reuses).

``capture=False`` runs the same static-buffer function eagerly instead of replaying a
graph: everything but the capture itself, which is how it is tested without a GPU (with a
stand-in flashinfer that reads the fixed buffers as the kernels do). Why by hand: vLLM and
SGLang do this inside their own runners; there is no library to call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from engine import step_timing
from engine.architectures import TextInputs
from engine.attention import TORCH_BACKEND, BatchMeta
from engine.attention_flashinfer import FlashInferBackend, kv_scales, query_rows
from engine.forward import pass_positions, upload_indices

if TYPE_CHECKING:
    from engine.forward import ForwardRunner, StepInput

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class Launched:
    """A token-id pass on its way (``DecodeGraphs.launch``)."""

    steps: list[StepInput]
    out: torch.Tensor
    """(n, V) float32 logits, a device copy of the static buffer (the next pass reuses it)."""
    argmax: torch.Tensor | None
    """(n,) their argmax on the device (with the runner's ``batch_argmax``): what a pass fed
    from this one reads its token ids from."""
    host: torch.Tensor | None
    """(n,) the argmax's host copy (pinned, written when ``ready`` has passed on CUDA)."""
    ready: Any = None
    """The CUDA event after that copy (None on the CPU, where nothing waits)."""

    def done(self) -> bool:
        """Whether the pass's tokens have reached the host (no wait)."""
        return self.ready is None or bool(self.ready.query())


class _BucketAttention:
    """The attention backend of one bucket's passes: graph decode wrappers per layer kind."""

    name = "flashinfer-graph"

    def __init__(self, owner: DecodeGraphs, bucket: int):
        self.owner = owner
        self.bucket = bucket
        self.wrappers: dict[tuple[Any, ...], Any] = {}
        self.planned: set[tuple[Any, ...]] = set()
        self.table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def begin(self, table: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """A new pass: plan every wrapper made so far with its page table."""
        self.table = table
        self.planned.clear()
        for kind, wrapper in self.wrappers.items():
            self._plan(kind, wrapper)

    def _plan(self, kind: tuple[Any, ...], wrapper: Any) -> None:
        assert self.table is not None
        indptr, indices, last = self.table
        self.owner.backend.plan_decode(wrapper, kind, self.owner.page_size, indptr, indices, last)
        self.planned.add(kind)

    def write(self, meta: BatchMeta, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        TORCH_BACKEND.write(meta, layer, key, value)

    def attend(
        self,
        meta: BatchMeta,
        layer: int,
        query: torch.Tensor,
        *,
        scaling: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        kc, vc = meta.pool.kv(layer)
        q, kind = query_rows(query, kc, scaling=scaling, sliding_window=sliding_window, softcap=softcap)
        wrapper = self.wrappers.get(kind)
        if wrapper is None or kind not in self.planned:
            if self.owner.capturing:
                raise RuntimeError(f"layer kind {kind} met for the first time while capturing")
            if wrapper is None:
                wrapper = self.wrappers[kind] = self.owner.backend.new_decode_wrapper(
                    kind, self.owner.page_table_buffers(self.bucket)
                )
            self._plan(kind, wrapper)
        return wrapper.run(q.contiguous(), (kc, vc), **kv_scales(meta.pool)).transpose(0, 1).unsqueeze(0)


class DecodeGraphs:
    """Replays one-token decode passes from CUDA graphs (see the module doc)."""

    def __init__(
        self,
        runner: ForwardRunner,
        *,
        max_batch: int = 64,
        capture: bool | None = None,
        inputs: Literal["ids", "embeds"] = "ids",
    ):
        """``inputs``: "ids", one-token passes by token id into logits; "embeds", passes of
        one embedding row per step into the runner's head (see the module doc)."""
        if inputs not in ("ids", "embeds"):
            raise ValueError(f"inputs must be 'ids' or 'embeds', got {inputs!r}")
        if inputs == "embeds" and runner.head is None:
            raise ValueError("embedding-input graphs hand their hidden states to a head; the runner has none")
        backend = runner.backend
        if not isinstance(backend, FlashInferBackend):
            raise ValueError("CUDA-graph decode needs the flashinfer attention backend")
        missing = sorted({lay.head_dim for lay in runner.pool.layers if not backend.covers(lay.head_dim)})
        if missing:
            raise ValueError(f"flashinfer has no kernels for head size(s) {missing} of this model")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.runner = runner
        self.backend: FlashInferBackend = backend
        self.pool = runner.pool
        self.arch = runner.arch
        self.device = runner.device
        self.page_size = runner.pool.page_size
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.max_batch = max_batch
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.scratch_page = self.pool.allocate(1)[0]
        dev = self.device
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.arch.position_axes, max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full(
            (max_batch,), self.scratch_page * self.page_size, dtype=torch.long, device=dev
        )
        self.logits = torch.zeros(max_batch, self.arch.vocab_size, dtype=torch.float32, device=dev)
        self._no_rows = torch.empty(0, dtype=torch.long, device=dev)
        self.inputs = inputs
        self.embeds: torch.Tensor | None = None
        """With ``inputs="embeds"``: (max_batch, hidden) input embeddings of a pass."""
        self.hidden: torch.Tensor | None = None
        """With ``inputs="embeds"``: (max_batch, hidden) final hidden states of a pass."""
        if inputs == "embeds":
            dtype = getattr(self.arch.hf, "dtype", torch.float32)
            self.embeds = torch.zeros(max_batch, self.arch.hidden_size, dtype=dtype, device=dev)
            self.hidden = torch.zeros(max_batch, self.arch.hidden_size, dtype=dtype, device=dev)
            self._all_rows = torch.arange(max_batch, device=dev)
        self._attention: dict[int, _BucketAttention] = {}
        self._buffers: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._graphs: dict[int, Any] = {}
        self._mempool: Any = None
        self.capturing = False
        self._planned: Any = None
        """CUDA event recorded after the last pass's plan (see ``_replay``)."""
        self.replays = 0
        """Passes replayed from a graph (or, with ``capture=False``, run eagerly through
        the static buffers)."""
        self.captures = 0

    def __repr__(self) -> str:
        return (
            f"DecodeGraphs(buckets={self.buckets}, inputs={self.inputs}, captured={sorted(self._graphs)}, "
            f"replays={self.replays}, capture={self.capture})"
        )

    # -- which passes -------------------------------------------------------------------------
    def takes(self, steps: Sequence[StepInput]) -> bool:
        """Whether this pass replays a graph. Pages shared by several contexts (a common
        prefix) are listed once per context, so the pass's page list can outgrow the
        fixed index buffers (one pool's worth): such a pass runs as usual."""
        ps = self.page_size
        if self.inputs == "embeds":
            return (
                0 < len(steps) <= self.max_batch
                and all(
                    len(s.tokens) == 1
                    and s.logits == "head"
                    and s.embeds is not None
                    and s.embeds.shape[0] == 1
                    and not s.media
                    and s.block_ids is None
                    and s.mask is None
                    and not s.adapters
                    for s in steps
                )
                and sum(-(-(s.kv_start + 1) // ps) for s in steps) + self.max_batch <= self.pool.num_pages
            )
        return (
            0 < len(steps) <= self.max_batch
            and all(
                len(s.tokens) == 1
                and s.logits == "last"
                and not s.media
                and s.block_ids is None
                and s.mask is None
                and not s.adapters
                and s.embeds is None
                for s in steps
            )
            and sum(-(-(s.kv_start + 1) // ps) for s in steps) + self.max_batch <= self.pool.num_pages
        )

    def page_table_buffers(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fixed page-table buffers for one more graph wrapper of ``bucket`` (each wrapper
        has its own: flashinfer writes its plan's table into them)."""
        dev = self.device
        bufs = (
            torch.zeros(bucket + 1, dtype=torch.int32, device=dev),
            torch.zeros(self.pool.num_pages, dtype=torch.int32, device=dev),
            torch.zeros(bucket, dtype=torch.int32, device=dev),
        )
        self._buffers.setdefault(bucket, []).append(bufs)
        return bufs

    # -- capture ahead of traffic ---------------------------------------------------------------
    def warm(self) -> None:
        """Capture every bucket now, largest first (smaller graphs reuse its memory pool),
        each on a pass of padding rows only (they read and write the scratch page alone),
        so no request waits for a capture. ``Model.load(cuda_graphs=N)`` calls this."""
        for bucket in sorted(self.buckets, reverse=True):
            if bucket in self._graphs:
                continue
            scratch_slot = self.scratch_page * self.page_size
            (scratch,) = upload_indices(
                [torch.full((bucket,), self.scratch_page, dtype=torch.long)], self.device
            )
            table = (
                torch.arange(bucket + 1, dtype=torch.int32),
                scratch.to(torch.int32),
                torch.ones(bucket, dtype=torch.int32),
            )
            with torch.inference_mode():
                self.ids[:bucket].zero_()
                self.positions[:, :bucket].zero_()
                self.slots[:bucket].fill_(scratch_slot)
                attention = self._attention.setdefault(bucket, _BucketAttention(self, bucket))
                attention.begin(table)
                if self.capture:
                    self._capture(bucket)
                else:
                    self._forward(bucket)

    # -- a pass -------------------------------------------------------------------------------
    def run(self, steps: Sequence[StepInput]) -> list[Any]:
        """(V,) float32 logits per step, as ``ForwardRunner.run`` gives for "last"; with
        ``inputs="embeds"``, the runner's head's result per step, as for "head"."""
        if self.hidden is None:
            return self.finish(self.launch(steps))
        n, _ = self._replay(steps, None, ())
        assert self.runner.head is not None
        results = self.runner.head.run(self.hidden[:n], [s.head for s in steps])
        self._count(n)
        return list(results)

    def launch(
        self,
        steps: Sequence[StepInput],
        fed: Launched | None = None,
        fed_rows: Sequence[tuple[int, int]] = (),
    ) -> Launched:
        """Start a token-id pass (``inputs="ids"``) and return without waiting for it: its
        logits are copied on the device and, with the runner's ``batch_argmax``, their
        argmax is on its way to the host (``finish`` waits for it). ``fed_rows``: (row of
        this pass, row of ``fed``) pairs whose token id is ``fed``'s argmax of that row,
        taken on the device, so this pass can be launched before ``fed``'s tokens reach the
        host (``engine.scheduler``'s device feed)."""
        if self.hidden is not None:
            raise ValueError("embedding-input graphs hand their rows to the runner's head: use run()")
        n, cuda = self._replay(steps, fed, fed_rows)
        argmax = host = ready = None
        with torch.inference_mode():
            out = self.logits[:n].clone()
            if self.runner.batch_argmax:
                argmax = out.argmax(dim=-1)
                host = argmax
                if cuda:  # the tokens' copy to the host, not waited for here
                    host = torch.empty(n, dtype=torch.long, pin_memory=True)
                    host.copy_(argmax, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record()
        self._count(n)
        return Launched(list(steps), out, argmax, host, ready)

    def finish(self, launched: Launched) -> list[torch.Tensor]:
        """Wait for a launched pass's argmax to reach the host, set ``StepInput.argmax`` of
        its steps and return its (V,) logits rows."""
        if launched.host is not None:
            t0 = step_timing.start()
            if launched.ready is not None:
                launched.ready.synchronize()
            for step, best in zip(launched.steps, launched.host.tolist(), strict=True):
                step.argmax = best
            step_timing.stop("worker: argmax (with its device-to-host read)", t0)
        return list(launched.out)

    def _count(self, n: int) -> None:
        self.replays += 1
        self.runner.passes += 1
        self.runner.rows_computed += n

    def _replay(
        self, steps: Sequence[StepInput], fed: Launched | None, fed_rows: Sequence[tuple[int, int]]
    ) -> tuple[int, bool]:
        """Load the pass's inputs into the static buffers, plan its attention and replay
        (or run) its bucket; (rows, whether on CUDA)."""
        t_inputs = step_timing.start()
        n = len(steps)
        bucket = next(b for b in self.buckets if b >= n)
        ps = self.page_size
        pad = bucket - n
        # Python lists, one tensor each: a tensor element write per step and field cost
        # ~30 us a step (1 ms a pass at 32 contexts) on the host, outside the graph.
        ids_l: list[int] = []
        slots_l: list[int] = []
        last_l: list[int] = []
        counts_l: list[int] = []
        indices_l: list[int] = []
        for step in steps:
            kv_len = step.kv_start + 1
            pages = step.pages[: -(-kv_len // ps)]
            if len(pages) * ps < kv_len:
                raise RuntimeError(f"page table covers {len(pages) * ps} rows, {kv_len} needed")
            ids_l.append(max(step.tokens[0], 0))  # a fed row's id (-1 here) comes on the device
            slots_l.append(pages[step.kv_start // ps] * ps + step.kv_start % ps)
            last_l.append(kv_len - (len(pages) - 1) * ps)
            counts_l.append(len(pages))
            indices_l.extend(pages)
        ids = torch.tensor(ids_l + [0] * pad, dtype=torch.long)
        positions = torch.zeros(self.arch.position_axes, bucket, dtype=torch.long)
        positions[:, :n] = pass_positions(steps, self.arch.position_axes)
        slots = torch.tensor(slots_l + [self.scratch_page * ps] * pad, dtype=torch.long)
        last = torch.tensor(last_l + [1] * pad, dtype=torch.int32)
        counts = torch.tensor(counts_l + [1] * pad, dtype=torch.int32)
        indptr = torch.zeros(bucket + 1, dtype=torch.int32)
        indptr[1:] = counts.cumsum(0)
        indices = torch.tensor(indices_l + [self.scratch_page] * pad, dtype=torch.long)
        parts = [ids, positions.reshape(-1), slots, indices]
        if fed_rows:
            parts += [torch.tensor([d for d, _ in fed_rows]), torch.tensor([r for _, r in fed_rows])]
        cuda = self.device.type == "cuda"

        with torch.inference_mode():
            # One host-to-device copy for the pass; the rest are copies on the device.
            ids_d, pos_d, slots_d, indices_d, *feed = upload_indices(parts, self.device)
            self.ids[:bucket].copy_(ids_d)
            if fed_rows:
                assert fed is not None and fed.argmax is not None, "a fed pass needs its source's argmax"
                self.ids.index_copy_(0, feed[0], fed.argmax.index_select(0, feed[1]))
            self.positions[:, :bucket].copy_(pos_d.view(positions.shape))
            self.slots[:bucket].copy_(slots_d)
            if self.embeds is not None:
                self.embeds[:n].copy_(torch.cat([s.embeds for s in steps]))  # type: ignore[misc]
            step_timing.stop("worker: graph inputs (indices, copies)", t_inputs)
            t0 = step_timing.start()
            attention = self._attention.get(bucket)
            if attention is None:
                attention = self._attention[bucket] = _BucketAttention(self, bucket)
            if self._planned is not None:
                # flashinfer's plan stages its tables in one pinned host buffer per wrapper
                # and copies them without waiting: the previous pass's copy must have run
                # before this plan writes that buffer again (only a pass launched while
                # another runs gets here before it has).
                self._planned.synchronize()
                self._planned = None
            attention.begin((indptr, indices_d.to(torch.int32), last))
            if cuda:
                self._planned = torch.cuda.Event()
                self._planned.record()
            step_timing.stop("worker: attention planning (flashinfer plan)", t0)
            t0 = step_timing.start()
            if self.capture:
                graph = self._graphs.get(bucket)
                if graph is None:
                    graph = self._capture(bucket)
                graph.replay()
            else:
                self._forward(bucket)
            step_timing.stop("worker: graph replay (launch; eager without capture)", t0)
        return n, cuda

    def _forward(self, bucket: int) -> None:
        inp = TextInputs(
            ids=self.ids[:bucket],
            positions=self.positions[:, :bucket],
            media_rows=self._no_rows if self.embeds is None else self._all_rows[:bucket],
            media_embeds=None if self.embeds is None else self.embeds[:bucket],
            deepstack=None,
        )
        meta = BatchMeta(
            pool=self.pool,
            seqs=[],
            slots=self.slots[:bucket],
            backend=self._attention[bucket],  # type: ignore[arg-type]
        )
        hidden = self.arch.hidden_states(inp, pie_batch=meta)
        if self.hidden is not None:
            self.hidden[:bucket].copy_(hidden)
            return
        self.logits[:bucket].copy_(self.arch.logits(hidden).float())

    def _capture(self, bucket: int) -> Any:
        """Warm up on a side stream (the pass's own inputs: K/V writes are idempotent, so
        the warm-up runs are this pass computed twice), then capture one run."""
        dev = self.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        self.capturing = True
        try:
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                self._forward(bucket)
        finally:
            self.capturing = False
        self._graphs[bucket] = graph
        self.captures += 1
        log.info(
            "captured the decode pass for batch size %d (%d wrapper kinds)",
            bucket,
            len(self._attention[bucket].wrappers),
        )
        return graph

    def close(self) -> None:
        """Drop the graphs and give the scratch page back."""
        self._graphs.clear()
        self._attention.clear()
        self._buffers.clear()
        if self.scratch_page is not None:
            self.pool.decref([self.scratch_page])
            self.scratch_page = None  # type: ignore[assignment]
