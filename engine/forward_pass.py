"""One forward pass built by hand on a context: Pie 0.4's ``forward-pass`` resource.

``ctx.forward()`` returns a ``ForwardPass``; attach inputs, masks and slots, then
``await fp.execute()``::

    fp = ctx.forward()
    fp.input_tokens(ids, range(ctx.position, ctx.position + len(ids)))
    token = fp.sampler([len(ids) - 1], Slot.greedy())
    entropy = fp.sampler([len(ids) - 1], Slot.entropy())
    out = await fp.execute()
    out[token].token, out[entropy].value

What it does, as Pie's runtime does it (``inference.wit``; facts of Pie 0.4.0's CUDA path
where its docs are silent):

* Rows. Every input (tokens, a media span's placeholder rows, then speculative tokens)
  becomes a row of the context. Its K/V goes to the context's next row, in input order,
  whatever its position; positions only rotate (RoPE; a text position is all three
  M-RoPE components on Qwen3-VL). The rows are working rows afterwards
  (``engine.working_pages``): commit pages to make them part of the chain.
* ``input_image`` / ``input_audio`` place the placeholder rows only; the delimiters
  (``prepared.prefix_tokens`` / ``suffix_tokens``) are the caller's tokens, and
  ``media_position_span(prepared)`` says how far the position cursor moves past them.
* ``attention_mask``: one BRLE per input row over all the context's K/V rows after the
  pass (``engine.brle``), used as given: a row may see later rows of its own pass. It
  replaces causality, not the model's own structure: a sliding layer still cuts it to its
  window, and media blocks still see each other where a layer has them. Checked: one mask
  per row, each exactly the K/V length, none attending to nothing.
* ``sampler(indices, slot)``: one slot per index (into the pass's rows), in call order
  (``engine.slots``). Several slots on a row, and slots on several rows, are answered from
  the one pass's logits. ``logit_mask`` hides tokens from the token slots.
* Speculative tokens are rows after the inputs; the first token slot (it must read the
  last input row) verifies them: it samples at its row and at every draft row, and keeps
  the longest prefix of drafts it agrees with plus one token. Its result is then that many
  ``SlotToken`` s. Every draft row stays a working row: truncate the rejected ones
  (``truncate_working_page_tokens``), as Pie's SDK does.
* ``adapter``: a LoRA adapter for this pass only (on top of the context's stack).

Batching: the pass is one step of the model's scheduler, so it shares forward passes
with every other live context; a masked step is attended on its own by the torch
backend (a boolean mask to SDPA) and through ``custom_mask`` by flashinfer, while the
plain decode rows beside it keep their batched path.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine import brle, sampling
from engine.context import MM_TYPES, Context, Row, Span, accept_drafts
from engine.drafting import PromptLookupDrafter
from engine.errors import EngineError, InvalidRequestError
from engine.lora import Adapter
from engine.page_hashing import MediaRow
from engine.pass_sampling import SampleRequest
from engine.slots import Slot, SlotOutput, SlotRequest, SlotToken, check_slot, compute
from media import check_int, check_number

if TYPE_CHECKING:
    from encoders import Prepared


class ForwardPassError(EngineError, InvalidRequestError):
    """A forward pass that cannot run as built (the message says what to change); the
    context is left as it was."""

    code = "invalid_forward_pass"


def placeholder_span(prepared: Prepared) -> Prepared:
    """``prepared`` without its delimiter rows: the placeholder rows only, their positions
    relative to the first of them (what ``input_image`` / ``input_audio`` place)."""
    if prepared.kind == "video":
        raise ForwardPassError("a video goes into a pass frame by frame, each frame an image")
    rows = prepared.placeholder_rows()
    if rows.numel() == 0:
        raise ForwardPassError(f"the prepared {prepared.kind} has no placeholder rows")
    first, last = int(rows[0]), int(rows[-1])
    if last - first + 1 != rows.numel():
        raise ForwardPassError(f"the prepared {prepared.kind}'s placeholder rows are not one run")
    pos = prepared.positions[:, first : last + 1]
    pos = pos - pos.min()
    types = prepared.mm_token_type[first : last + 1] if prepared.mm_token_type else ()
    return dataclasses.replace(
        prepared,
        input_ids=prepared.input_ids[first : last + 1],
        positions=pos,
        position_span=int(pos.max()) + 1,
        mm_token_type=types,
    )


def media_position_span(prepared: Prepared) -> int:
    """How far the position cursor moves past a media item's placeholder rows (Pie's
    ``position-span``: the token count on 1-D RoPE, max(t, h, w) on M-RoPE)."""
    return placeholder_span(prepared).position_span


_VOCAB: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _vocab_size(model: Any) -> int:
    """``model.arch.vocab_size``, read once per model: it goes through transformers'
    config attribute lookups (0.8 us a read here, 0.1 us from this cache, against a
    one-token pass's ~40 us of host work), and every pass checks its tokens and each of
    its slots against it."""
    vocab = _VOCAB.get(model)
    if vocab is None:
        vocab = _VOCAB[model] = model.arch.vocab_size
    return vocab


@dataclass
class PassOutput:
    """What ``execute`` gives back: one result per slot, in slot order (``out[i]``,
    iterable), plus the speculative side channel."""

    slots: list[SlotOutput]
    spec_tokens: list[int] = field(default_factory=list)
    spec_positions: list[int] = field(default_factory=list)
    accepted: int = 0
    """Speculative tokens the verifying slot agreed with (0 without drafts)."""

    def __getitem__(self, i: int) -> SlotOutput:
        return self.slots[i]

    def __iter__(self) -> Iterator[SlotOutput]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def tokens(self) -> list[int]:
        """Every token slot's token, in slot order."""
        return [s.token for s in self.slots if isinstance(s, SlotToken)]


@dataclass
class _Plan:
    """A pass as ``execute`` runs it: its rows (inputs, then drafts), the count of inputs,
    the verifying slot's index, the masks decoded, and the rows whose logits / hidden
    states it reads (sorted, each once)."""

    rows: list[Any]
    n_in: int
    verify: int | None
    mask: torch.Tensor | None
    logit_mask: torch.Tensor | None
    logit_rows: list[int]
    hidden_rows: list[int]


class ForwardPass:
    """One hand-built forward pass of a context (see the module doc). Build it, execute it
    once. Inputs are checked as they are attached where they can be, the rest at
    ``execute`` before anything changes."""

    def __init__(self, ctx: Context):
        self._ctx = ctx
        self._inputs: list[Any] = []  # Row of the context, in input order
        self._drafts: list[Any] = []
        self._slots: list[tuple[int, Slot]] = []
        self._mask: list[Sequence[int]] | torch.Tensor | None = None
        self._logit_mask: Sequence[int] | torch.Tensor | None = None
        self._adapter: tuple[Adapter, float] | None = None
        self._output_spec = False
        self._speculate: bool | None = None  # None: as the scheduler's overlap (on with CUDA)
        self._executed = False

    # -- facts ------------------------------------------------------------------------------
    @property
    def context(self) -> Context:
        return self._ctx

    @property
    def start_row(self) -> int:
        """The K/V row the first input takes (the context's computed rows)."""
        return self._ctx.committed

    @property
    def start_position(self) -> int:
        """The position after the context's last row (where a plain next token goes)."""
        return self._ctx.position

    @property
    def num_rows(self) -> int:
        """Rows attached so far (inputs, then speculative tokens)."""
        return len(self._inputs) + len(self._drafts)

    def __repr__(self) -> str:
        return (
            f"ForwardPass({len(self._inputs)} input rows, {len(self._drafts)} speculative, "
            f"{len(self._slots)} slots{', masked' if self._mask is not None else ''})"
        )

    # -- inputs -----------------------------------------------------------------------------
    def input_tokens(self, tokens: Iterable[int], positions: Iterable[int] | None = None) -> ForwardPass:
        """Text rows at ``positions`` (default: from the cursor after the rows so far)."""
        self._open()
        self._inputs.extend(self._text_rows(tokens, positions, self._next_position(self._inputs)))
        return self

    def input_speculative_tokens(
        self, tokens: Iterable[int], positions: Iterable[int] | None = None
    ) -> ForwardPass:
        """Draft rows after the inputs, verified by the first token slot (module doc)."""
        self._open()
        at = self._next_position(self._drafts or self._inputs)
        self._drafts.extend(self._text_rows(tokens, positions, at))
        return self

    def output_speculative_tokens(self, flag: bool = True) -> ForwardPass:
        """Propose the next pass's drafts (prompt lookup over the context) in the output."""
        self._output_spec = bool(flag)
        return self

    def pass_speculation(self, flag: bool = True) -> ForwardPass:
        """Whether the runtime may stage the pass after this one: a greedy one-token pass
        submits its successor, fed the token it draws, while it runs; the next ``execute``
        that is exactly that pass then skips the queue (``Context._run_pass``). Unset, it
        follows the scheduler's overlap (on with CUDA; off on the CPU, where the two
        threads share one GIL: bench/forward_pass.py measured staging 1.6x slower there)."""
        self._speculate = bool(flag)
        return self

    def input_image(self, image: Any, anchor: int | None = None) -> Prepared:
        """Place an image's placeholder rows with their first position at ``anchor`` (default:
        the cursor); returns the item as placed (``token_count``, ``position_span``)."""
        return self._input_media("image", image, anchor)

    def input_audio(self, audio: Any, anchor: int | None = None) -> Prepared:
        return self._input_media("audio", audio, anchor)

    # -- masks, slots, adapter ---------------------------------------------------------------
    def attention_mask(self, masks: Sequence[Sequence[int]] | torch.Tensor) -> ForwardPass:
        """One BRLE per row (or a (rows, kv_len) boolean tensor), checked at ``execute``."""
        self._open()
        if isinstance(masks, torch.Tensor):
            if masks.dim() != 2:
                raise ForwardPassError(
                    f"an attention mask tensor is (rows, kv_len), got shape {tuple(masks.shape)}"
                )
            self._mask = masks.to(torch.bool)
        else:
            self._mask = [list(m) for m in masks]
        return self

    def logit_mask(self, mask: Sequence[int] | torch.Tensor) -> ForwardPass:
        """A BRLE over the vocabulary (or a (vocab,) boolean tensor): True = allowed. It
        applies to the token slots."""
        self._open()
        self._logit_mask = mask.to(torch.bool) if isinstance(mask, torch.Tensor) else list(mask)
        return self

    def sampler(self, indices: Iterable[int], slot: Slot | sampling.Sampler) -> int:
        """Attach ``slot`` at each of ``indices`` (rows of this pass); returns the index of
        the first of the slots made (one per index, consecutive)."""
        self._open()
        if isinstance(slot, sampling.Sampler):
            slot = Slot.sample(slot)
        if not isinstance(slot, Slot):
            raise ForwardPassError(f"a sampler slot is an engine Slot or Sampler, got {type(slot).__name__}")
        check_slot(slot, _vocab_size(self._ctx.model))
        rows = [check_int("sampler index", i, min=0) for i in indices]
        if not rows:
            raise ForwardPassError("sampler() needs at least one row index")
        first = len(self._slots)
        self._slots.extend((r, slot) for r in rows)
        return first

    def adapter(self, adapter: Adapter, scale: float = 1.0) -> ForwardPass:
        """Run this pass's rows under ``adapter`` too (this pass only)."""
        self._open()
        if not isinstance(adapter, Adapter):
            raise ForwardPassError(
                f"adapter() takes an Adapter from model.load_adapter(), got {type(adapter).__name__}"
            )
        if not self._ctx.model.owns_adapter(adapter):
            raise ForwardPassError(
                f"{adapter!r} was not loaded for this model ({self._ctx.model.name}); load it with "
                "model.load_adapter(path)"
            )
        self._adapter = (adapter, float(check_number("adapter scale", scale)))
        return self

    # -- running ----------------------------------------------------------------------------
    def check(self) -> None:
        """Every check ``execute`` makes before the pass joins the batch, without running
        it: for a host that hands the pass to the event loop from another thread and will
        not wait for the loop to hear of a bad pass (the Pie world's ``execute``,
        inferlets/host/pie_core/inference.py). The context must not change between this and
        ``execute`` (no pass of it running), or ``execute`` may still refuse it."""
        self._open()
        if self._one_token_slot() is None:
            self._plan()
        self._ctx._check_pass_ready(self.num_rows)

    def _one_token_slot(self) -> Slot | None:
        """The slot of the common pass (one token drawn from the last input row, nothing
        else asked), which ``_one_token`` serves; None for any other pass."""
        if len(self._slots) == 1 and not (
            self._drafts
            or self._mask is not None
            or self._logit_mask is not None
            or self._adapter
            or self._output_spec
        ):
            row, slot = self._slots[0]
            if slot.kind == "token" and row == len(self._inputs) - 1:
                return slot
        return None

    def _plan(self) -> _Plan:
        """The pass's rows, masks and the rows it reads, every one checked."""
        rows = self._inputs + self._drafts
        if not rows:
            raise ForwardPassError("this pass has no input rows; attach input_tokens() (or media) first")
        n_in = len(self._inputs)
        for r, _ in self._slots:
            if r >= len(rows):
                raise ForwardPassError(
                    f"a sampler reads row {r}; this pass has {len(rows)} rows (0..{len(rows) - 1})"
                )
        verify = self._verifier(n_in)
        mask = self._attention(len(rows), self._ctx.committed + len(rows))
        logit_mask = self._vocab_mask()
        # Rows whose logits / hidden states the pass returns: sorted, each once.
        logit_rows = sorted(
            {r for r, s in self._slots if s.needs_logits}
            | (set(range(n_in - 1, len(rows))) if verify is not None else set())
        )
        hidden_rows = sorted({r for r, s in self._slots if s.kind == "embedding"})
        return _Plan(rows, n_in, verify, mask, logit_mask, logit_rows, hidden_rows)

    async def execute(self) -> PassOutput:
        """Run the pass (batched with every other context's) and answer its slots."""
        self._open()
        self._executed = True
        one = self._one_token_slot()
        if one is not None:
            return await self._one_token(one)
        ctx = self._ctx
        plan = self._plan()
        rows, n_in, verify, mask, logit_mask = plan.rows, plan.n_in, plan.verify, plan.mask, plan.logit_mask
        logit_rows, hidden_rows = plan.logit_rows, plan.hidden_rows
        adapters = (self._adapter,) if self._adapter is not None else ()
        start = ctx.committed
        requests = [SlotRequest(r, s, self._slot_generator(s)) for r, s in self._slots]
        # The first token slot on the last row, when the pass reads no other row: drawn in
        # the pass with every other context's rows (one batched call), not afterwards.
        in_pass = None
        if verify is None and logit_mask is None and logit_rows == [len(rows) - 1] and not hidden_rows:
            in_pass = next((i for i, r in enumerate(requests) if r.slot.kind == "token"), None)
        sample = None
        if in_pass is not None:
            req = requests[in_pass]
            assert req.slot.sampler is not None
            sample = SampleRequest(req.slot.sampler, req.generator or ctx._rng())
        logits, hidden, sampled = await ctx._run_pass(
            rows,
            mask=mask,
            out_rows=tuple(logit_rows),
            hidden_rows=tuple(hidden_rows),
            adapters=adapters,
            sample=sample,
        )
        at = {r: i for i, r in enumerate(logit_rows)}
        hat = {r: i for i, r in enumerate(hidden_rows)}
        if sampled is None:
            in_pass = None  # the pass could not draw it: drawn below as any slot
        plain = [i for i in range(len(requests)) if i != verify and i != in_pass]
        outputs = (
            []
            if not plain
            else compute(
                [requests[i] for i in plain],
                logits,
                [at.get(requests[i].row, -1) for i in plain],
                hidden,
                [hat.get(requests[i].row, -1) for i in plain],
                logit_mask=logit_mask,
                generator=ctx._rng(),
            )
        )
        slots: list[Any] = list(outputs)
        if in_pass is not None:
            assert sampled is not None
            slots.insert(in_pass, SlotToken(sampled))
        accepted = 0
        if verify is not None:
            assert logits is not None
            tokens, accepted = self._verify(
                requests[verify], logits, [at[r] for r in range(n_in - 1, len(rows))], logit_mask
            )
            slots[verify:verify] = [SlotToken(t) for t in tokens]
        out = PassOutput(slots=slots, accepted=accepted)
        if self._output_spec:
            out.spec_tokens, out.spec_positions = self._propose(start, rows, n_in, out)
        return out

    async def _one_token(self, slot: Slot) -> PassOutput:
        """The common pass (rows in, one token drawn from the last): the token drawn in the
        pass with every other context's rows, nothing else to answer."""
        ctx = self._ctx
        assert slot.sampler is not None
        sample = SampleRequest(slot.sampler, self._slot_generator(slot) or ctx._rng())
        logits, _, sampled = await ctx._run_pass(
            self._inputs,
            mask=None,
            out_rows=(len(self._inputs) - 1,),
            hidden_rows=(),
            sample=sample,
            stage=(ctx.model.scheduler.overlap if self._speculate is None else self._speculate)
            and not slot.seed,
        )
        if sampled is None:  # the pass could not draw it: as any slot (raises its error)
            assert logits is not None
            return PassOutput(compute([SlotRequest(0, slot, sample.generator)], logits, [0], None, []))
        return PassOutput([SlotToken(sampled)])

    # -- internals --------------------------------------------------------------------------
    def _open(self) -> None:
        if self._executed:
            raise ForwardPassError("this forward pass was executed; build another with ctx.forward()")

    def _text_rows(self, tokens: Iterable[int], positions: Iterable[int] | None, at: int) -> list[Any]:
        try:
            ids = [operator.index(t) for t in tokens]
        except TypeError as e:
            raise ForwardPassError(f"token ids are integers: {e}") from None
        vocab = _vocab_size(self._ctx.model)
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = [t for t in ids if not 0 <= t < vocab]
            raise ForwardPassError(f"token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}")
        pos = (
            list(range(at, at + len(ids)))
            if positions is None
            else [check_int("position", p) for p in positions]
        )
        if len(pos) != len(ids):
            raise ForwardPassError(f"{len(ids)} tokens but {len(pos)} positions; give one position per token")
        self._check_positions(pos)
        axes = self._ctx.model.arch.position_axes
        return [Row(token=t, pos=(p,) * axes, next_pos=p + 1) for t, p in zip(ids, pos, strict=True)]

    def _check_positions(self, positions: Sequence[int]) -> None:
        limit = self._ctx.model.max_model_len
        bad = [p for p in positions if p < 0 or (limit is not None and p >= limit)]
        if bad:
            top = f"below {limit}" if limit is not None else "non-negative"
            raise ForwardPassError(f"positions must be {top} (the model's context length): got {bad[:5]}")

    def _next_position(self, rows: list[Any]) -> int:
        return rows[-1].next_pos if rows else self._ctx.position

    def _input_media(self, kind: str, media: Any, anchor: int | None) -> Prepared:
        self._open()
        if self._drafts:
            raise ForwardPassError("media go before the speculative tokens; attach them first")
        prepared = self._ctx.model.prepare(media)
        if prepared.kind != kind:
            raise ForwardPassError(f"input_{kind} was given {prepared.kind} media")
        arch = self._ctx.model.arch
        if prepared.family != arch.family or arch.placeholder_ids().get(kind) != prepared.placeholder_id:
            raise ForwardPassError(
                f"this {kind} was prepared for another model ({prepared.family}); prepare it on this one"
            )
        span_only = placeholder_span(prepared)
        anchor = self._next_position(self._inputs) if anchor is None else check_int("anchor", anchor, min=0)
        pos = (span_only.positions + anchor).t().tolist()
        self._check_positions([max(p) for p in pos])
        span = Span(prepared=span_only, start=self._ctx.committed + len(self._inputs))
        types = span_only.mm_token_type or (MM_TYPES[kind],) * span_only.num_rows
        after = anchor + span_only.position_span
        rows = [
            Row(
                int(token),
                tuple(pos[i]),
                after if i == span_only.num_rows - 1 else max(pos[i]) + 1,
                MediaRow(span_only.cache_key, i),
                span,
                i,
                int(types[i]),
            )
            for i, token in enumerate(span_only.input_ids)
        ]
        self._inputs.extend(rows)
        return span_only

    def _verifier(self, n_in: int) -> int | None:
        """Index of the slot that verifies the drafts (None without drafts)."""
        if not self._drafts:
            return None
        for i, (row, slot) in enumerate(self._slots):
            if slot.kind == "token":
                if row != n_in - 1:
                    raise ForwardPassError(
                        f"with speculative tokens the first token slot must read the last input row ({n_in - 1}), "
                        f"not row {row}"
                    )
                return i
        raise ForwardPassError("speculative tokens need a token slot on the last input row to verify them")

    def _attention(self, n: int, kv_len: int) -> torch.Tensor | None:
        m = self._mask
        if m is None:
            return None
        if isinstance(m, torch.Tensor):
            if tuple(m.shape) != (n, kv_len):
                raise ForwardPassError(
                    f"the attention mask is {tuple(m.shape)}; this pass needs ({n}, {kv_len}): one row per input "
                    "row over the context's K/V after the pass"
                )
            mask = m.cpu()
        else:
            if len(m) != n:
                raise ForwardPassError(f"{len(m)} attention masks for {n} input rows; give one per row")
            mask = torch.from_numpy(
                np.stack([brle.decode(r, kv_len, what=f"attention mask of row {i}") for i, r in enumerate(m)])
            )
        empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ForwardPassError(f"the attention mask of row(s) {empty[:5]} attends to nothing")
        return mask

    def _vocab_mask(self) -> torch.Tensor | None:
        m = self._logit_mask
        if m is None:
            return None
        vocab = _vocab_size(self._ctx.model)
        if isinstance(m, torch.Tensor):
            if tuple(m.shape) != (vocab,):
                raise ForwardPassError(f"the logit mask is {tuple(m.shape)}; it must be ({vocab},)")
            mask = m.cpu()
        else:
            mask = torch.from_numpy(brle.decode(m, vocab, what="logit mask"))
        if not bool(mask.any()):
            raise ForwardPassError("the logit mask allows no token")
        return mask

    def _slot_generator(self, slot: Slot) -> torch.Generator | None:
        if slot.kind == "token" and slot.seed:
            return sampling.generator(slot.seed)
        return None

    def _verify(
        self, request: SlotRequest, logits: torch.Tensor, at: list[int], logit_mask: torch.Tensor | None
    ) -> tuple[list[int], int]:
        """Sample the verifying slot at the last input row and every draft row; keep the
        drafts it agrees with, then its own next token (``engine.context.accept_drafts``
        with the context's ``_pick``, as ``generate`` and ``verify_draft`` verify)."""
        rows = logits[torch.tensor(at, device=logits.device)]
        if logit_mask is not None:
            rows = rows.masked_fill(~logit_mask.to(rows.device), float("-inf"))
        sampler = request.slot.sampler
        assert sampler is not None
        ctx, gen = self._ctx, request.generator
        return accept_drafts(
            rows, [r.token for r in self._drafts], lambda row: ctx._pick(row, sampler, None, None, gen)
        )

    def _propose(
        self, start: int, rows: list[Any], n_in: int, out: PassOutput
    ) -> tuple[list[int], list[int]]:
        """Drafts for the next pass: prompt lookup over the context's kept tokens and the
        token this pass sampled last; positions after that token's."""
        tokens = out.tokens()
        if not tokens:
            return [], []
        kept = n_in + out.accepted  # this pass's rows that stay (drafts past them are rejected)
        drafter = PromptLookupDrafter()
        drafter.update([*self._ctx.token_ids[: start + kept], tokens[-1]])
        proposed = drafter.draft()
        first = rows[kept - 1].next_pos + 1  # the sampled token goes at next_pos, drafts after it
        return proposed, list(range(first, first + len(proposed)))
