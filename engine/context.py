"""Context: a token history with its KV pages (Pie's context, in Python, async).

Life cycle (as in Pie): fill (``fill``, ``fill_tokens``, role methods, ``append_image`` ...)
buffers rows; ``flush()`` prefills them into KV pages; ``generate()`` samples, checks stop
conditions and runs one decode pass per token (passes of concurrent contexts are
batched by the model's scheduler).

Rows. Every token of the context is a ``Row``: its id, its position ids (all M-RoPE axes),
and for media rows the span it belongs to. Rows ``[0, committed)`` have K/V in the
pages; the rest are pending. Positions are assigned when a row is appended: text rows
advance the cursor by one, a media span by its ``position_span`` (M-RoPE: not its row
count), exactly as the reference's rope index.

Pages. ``pages[i]`` holds rows ``[i*P, (i+1)*P)``; the context's ``engine.page_table.PageTable``
keeps them. Full committed pages are published in the pool under a chain hash of their
content (``engine.page_hashing``), so a context that fills rows matching a published page
takes that page instead of computing it (prefix cache), and forks share pages by
reference. A page is written only while this context is its only holder and it is
unpublished; otherwise it is copied first (copy-on-write), so sharing never corrupts
anyone's history.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from engine import sampling, stopping
from engine.chat import RESERVED_TEMPLATE_KEYS, ROLES, ChatState, Message, chat_message, template_pieces
from engine.drafting import MAX_DRAFT, Drafter, checked_draft
from engine.errors import ContextClosedError, ContextLengthExceededError, InvalidRequestError, OutOfPagesError
from engine.forward import LogitsWanted, MediaRows, StepInput
from engine.grammar import Grammar, GrammarMatcher
from engine.incremental_text import IncrementalText
from engine.lora import AdapterStack
from engine.masks import HiddenRows, sequence_causal_mask
from engine.page_hashing import MediaRow
from engine.page_table import PageTable, rows_key
from engine.pass_sampling import SampleRequest
from engine.penalties import Penalties, PenaltyState
from engine.scheduler import SKIPPED
from engine.step_timing import start as _phase_start
from engine.step_timing import stop as _phase_stop
from engine.step_timing import stop_at as _phase_stop_at
from engine.tool_calls import tool_call_format
from engine.working_pages import WorkingPages
from media import check_int

if TYPE_CHECKING:
    from encoders import Prepared
    from engine.model import Model

MM_TYPES = {"image": 1, "video": 2, "audio": 3}
DEFAULT_MAX_TOKENS = 256
LOGPROBS_MAX = 20
"""Alternatives per token a stream reports at most (OpenAI's limit)."""


class Row(NamedTuple):
    """One committed or pending row of a context. A named tuple, not a frozen dataclass:
    an image adds a row per token, and a frozen dataclass's ``__init__`` (one
    ``object.__setattr__`` per field) made building them ~3x slower."""

    token: int
    pos: tuple[int, ...]
    next_pos: int
    """The position cursor after this row."""
    media: MediaRow | None = None
    span: Span | None = None
    emb: int = -1
    """Index of this row's embedding in the span's encoder output (-1: not a placeholder)."""
    mm_type: int = 0


@dataclass(eq=False)
class Span:
    """One media item placed in a context."""

    prepared: Prepared
    start: int
    """Row index of its first row (in the context where it was appended)."""

    @property
    def rows(self) -> range:
        """Row indices of the span in the context (delimiters included)."""
        return range(self.start, self.start + self.prepared.num_rows)


@dataclass
class Generation:
    """The outcome of ``generate``."""

    text: str
    tokens: list[int]
    reason: stopping.StopReason

    @property
    def finish_reason(self) -> str:
        return self.reason.kind


@dataclass
class TokenEvent:
    """One streamed step of a generation."""

    token: int
    text: str
    """Text this token made visible: empty while a multi-byte character is open or while the
    text could still be the start of a stop string (it shows once that is decided), so the
    texts of all events join to exactly the final text."""
    done: stopping.StopReason | None = None
    logprob: float | None = None
    """log p(token) under the model's raw distribution (when the stream asked for logprobs)."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The most probable (token, logprob) pairs, most probable first (when asked)."""


@dataclass
class Distribution:
    ids: torch.Tensor
    probs: torch.Tensor


class Context(WorkingPages):
    """A conversation with a model. ``Context(model)``; async methods run forward passes.
    ``forward()`` builds one pass by hand (Pie's forward pass, ``engine.forward_pass``);
    the working-page calls come from ``engine.working_pages``."""

    def __init__(self, model: Model, *, seed: int | None = None):
        self.model = model
        model.live_contexts.add(self)
        # The pages this context holds; released when it closes or is collected.
        self._table = PageTable(model.pool)
        self._finalizer = weakref.finalize(self, PageTable.release, self._table)
        self._rows: list[Row] = []
        self._n = 0  # committed rows
        self._hidden = HiddenRows()
        """Rows masked out of every later pass (``mask_token_range``)."""
        self._cursor = 0  # position of the next appended row
        self._last_logits: torch.Tensor | None = None
        self._argmax_hint: tuple[torch.Tensor, int] | None = None
        """(logits, their argmax) from the runner (``StepInput.argmax``); used only while
        those very logits are ``_last_logits``."""
        self._sample_request: SampleRequest | None = None
        """Set by ``stream`` around a pass whose row it samples next: the runner samples
        it with the rest of the pass (``engine.pass_sampling``)."""
        self._sample_hint: tuple[torch.Tensor, sampling.Sampler, int] | None = None
        """(logits, sampler, the token the runner drew from them); taken once, only for
        those very logits and that sampler."""
        # After flush(): the last committed row's final hidden state, its logits not yet
        # computed (the LM head runs only if something samples or asks for them).
        self._last_hidden: torch.Tensor | None = None
        self._chat = ChatState()
        self.cached_rows = 0
        """Rows a prefill took from the prefix cache (published pages, a kept tail) instead
        of computing them (usage's ``cached_tokens``)."""
        self._seed = seed
        self._generator: torch.Generator | None = None
        self._busy = False
        self._overlap: list[_Submitted] = []
        self._staged: _Staged | None = None
        """The next hand-built pass, submitted while the one before ran (Pie's pass
        speculation, ``engine.forward_pass``); taken if the next pass is the one predicted."""
        """Decode steps of ``_decode_plain`` submitted lately (closing cancels those still
        waiting for a pass); ended ones are dropped as new ones come."""
        self._closed = False
        self.adapters = AdapterStack()
        """LoRA adapters this context's rows run under (push/pop/clear)."""
        self.sampler: sampling.Sampler | None = None
        """What ``generate``/``stream`` sample with when given no sampler (None: greedy);
        forks and snapshots carry it."""
        self.stop: stopping.StopCondition | None = None
        """When ``generate``/``stream`` stop when given no condition (None: the model's EOS
        ids or ``max_tokens``); forks and snapshots carry it."""

    # -- facts ------------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        """All token ids, committed and pending."""
        return [r.token for r in self._rows]

    @property
    def committed(self) -> int:
        """Rows whose K/V are in the pages."""
        return self._n

    @property
    def pending(self) -> int:
        return len(self._rows) - self._n

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def position(self) -> int:
        """The position the next row gets (M-RoPE: the text axis value)."""
        return self._cursor

    @property
    def pages(self) -> list[int]:
        """Page ids holding the committed rows."""
        return self._table.covering(self._n)

    @property
    def spans(self) -> list[Span]:
        """The media placed in this context, in order: each span's ``prepared`` and ``rows``."""
        out: list[Span] = []
        for r in self._rows:
            if r.span is not None and (not out or out[-1] is not r.span):
                out.append(r.span)
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def busy(self) -> bool:
        """A forward pass of this context is running (it refuses a second one)."""
        return self._busy

    def text(self, *, skip_special_tokens: bool = False) -> str:
        return self.model.detokenize(self.token_ids, skip_special_tokens=skip_special_tokens)

    # -- filling (buffers only) ------------------------------------------------------------
    def fill(self, text: str) -> Context:
        """Append text (tokenized; special-token text such as ``<|im_start|>`` becomes the id)."""
        return self.fill_tokens(self.model.tokenize(text))

    def fill_tokens(self, ids: Iterable[int]) -> Context:
        self._check_open()
        ids = [int(i) for i in ids]
        vocab = self.model.arch.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise InvalidRequestError(f"token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}")
        self._check_room(len(ids))
        self._append_text(ids)
        return self

    def system(self, *content: Any) -> Context:
        return self._turn("system", content)

    def user(self, *content: Any) -> Context:
        """A user turn; ``content`` parts are text and media (``media.Image``/``Audio``/
        ``Video`` or ``Prepared``), in order, as in a chat message's content list."""
        return self._turn("user", content)

    def assistant(self, *content: Any, tool_calls: Sequence[Mapping[str, Any]] | None = None) -> Context:
        """An assistant turn; ``tool_calls`` (OpenAI's shape: ``{"type": "function",
        "function": {"name", "arguments"}}``) are the calls it made, as the template renders them."""
        return self._turn("assistant", content, {"tool_calls": list(tool_calls)} if tool_calls else None)

    def tool(self, *content: Any, call_id: str | None = None) -> Context:
        """A tool's result (the answer to the assistant's call ``call_id``)."""
        return self._turn("tool", content, {"tool_call_id": call_id} if call_id else None)

    def use_tools(self, tools: Sequence[Mapping[str, Any]]) -> Context:
        """The tools (OpenAI's function definitions) the template renders into this
        conversation. Set before the first turn: templates write them at its start. The
        model's output is parsed with ``engine.tool_calls.tool_call_format(model)``."""
        tool_call_format(self.model)
        if self._chat.messages:
            raise InvalidRequestError("use_tools() comes before the first turn (tools render at its start)")
        if tools:
            self._chat.options["tools"] = [dict(t) for t in tools]
        else:
            self._chat.options.pop("tools", None)
        return self

    def template_options(self, **options: Any) -> Context:
        """Keywords every render of this conversation passes to the chat template (e.g.
        ``enable_thinking=True`` for Gemma-4 and Qwen3; vLLM's ``chat_template_kwargs``),
        over the model's own. Set before the first turn."""
        reserved = sorted(set(options) & RESERVED_TEMPLATE_KEYS)
        if reserved:
            raise InvalidRequestError(
                f"template option {reserved[0]!r} is set by the engine, not by options",
                param="chat_template_kwargs",
            )
        if self._chat.messages:
            raise InvalidRequestError("template_options() comes before the first turn")
        self._chat.options.update(options)
        return self

    def turns(
        self, turns: Iterable[tuple[str, Sequence[Any]] | tuple[str, Sequence[Any], Mapping | None]]
    ) -> Context:
        """Several turns at once, each ``(role, content parts)`` with role ``"system"``,
        ``"user"``, ``"assistant"`` or ``"tool"`` (and optionally a third item: the message's
        other keys, ``tool_calls`` or ``tool_call_id``): the rows the same role calls in
        order would append (for a prefix-stable template, token for token), with the
        template rendered once for all of them, as the reference processor renders a whole
        conversation. A history sent whole (a chat request) goes here: role call by role
        call, each renders the history again."""
        self._check_open()
        messages: list[Message] = []
        media: list[Prepared] = []
        for role, content, *extra in turns:
            if role not in ROLES:
                raise InvalidRequestError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
            message, items = chat_message(role, content, self.model.prepare, extra[0] if extra else None)
            messages.append(message)
            media.extend(items)
        if not messages:
            return self
        self._close_turn()
        chat = self._chat
        self._fill_template(self.model.chat.turns(chat.messages, messages, chat.options), media)
        chat.messages.extend(messages)
        return self

    def cue(self) -> Context:
        """The template's generation prompt (e.g. ``<|im_start|>assistant\\n``)."""
        self._check_open()
        self._close_turn()
        self._fill_template(self.model.chat.cue(self._chat.messages, self._chat.options), [])
        self._chat.open()
        return self

    def append_image(self, image: Any, **params: Any) -> Prepared:
        """Place an image here (raw, outside any template turn); returns its ``Prepared``
        (``token_count``, ``position_span``, ... are known before any forward pass)."""
        return self._append_media("image", image, params)

    def append_audio(self, audio: Any, **params: Any) -> Prepared:
        return self._append_media("audio", audio, params)

    def append_video(self, video: Any, **params: Any) -> Prepared:
        return self._append_media("video", video, params)

    # -- forward passes ---------------------------------------------------------------------
    async def flush(self, *, return_logits: bool = False) -> torch.Tensor | None:
        """Prefill every pending row. With ``return_logits`` the logits of all of them
        ((rows, vocab) float32) come back, and the prefix cache is not used. Without, no
        logits are computed now: the next sample or ``next_token_logits`` applies the LM
        head to the kept last hidden state (a flushed prefix that is only forked pays no
        head)."""
        self._check_open()
        with self._guard():
            return await self._prefill("all" if return_logits else "hidden")

    async def hidden_states(self) -> torch.Tensor:
        """Prefill every pending row and return their final hidden states ((rows, hidden)
        float32, after the model's final norm): what embeddings pool. Every pending row is
        computed (no prefix-cache reuse), as with ``flush(return_logits=True)``."""
        self._check_open()
        with self._guard():
            out = await self._prefill("states")
        assert out is not None
        return out

    async def decode_step_dist(
        self, sampler: sampling.Sampler | None = None, *, top_n: int | None = None
    ) -> Distribution:
        """Distribution of the next token (after flushing pending rows): ids and their
        probabilities, most probable first (``sampler`` post-processing applied; default
        plain softmax)."""
        self._check_open()
        with self._guard():
            await self._ensure_logits()
        assert self._last_logits is not None
        ids, probs = sampling.dist(self._last_logits, sampler or sampling.Sampler.multinomial(1.0), top_n)
        return Distribution(ids=ids, probs=probs)

    async def next_token_logits(self) -> torch.Tensor:
        """(vocab,) float32 logits for the next token."""
        self._check_open()
        with self._guard():
            await self._ensure_logits()
        assert self._last_logits is not None
        return self._last_logits

    async def generate(
        self,
        sampler: sampling.Sampler | None = None,
        stop: stopping.StopCondition | None = None,
        *,
        max_tokens: int | None = None,
        grammar: Grammar | None = None,
        drafter: Drafter | None = None,
        penalties: Penalties | None = None,
    ) -> Generation:
        """Sample until ``stop`` (default: the model's EOS ids or ``max_tokens``, default 256).
        Generated tokens join the context (the last one stays pending). ``grammar``: the
        output must match it; ``drafter``: speculative decoding; ``penalties``: logit bias
        and repetition/frequency/presence penalties (see ``stream``)."""
        tokens: list[int] = []
        reason = None
        async for ev in self.stream(
            sampler, stop, max_tokens=max_tokens, grammar=grammar, drafter=drafter, penalties=penalties
        ):
            tokens.append(ev.token)
            reason = ev.done
        assert reason is not None
        return Generation(text=reason.text, tokens=tokens, reason=reason)

    async def stream(
        self,
        sampler: sampling.Sampler | None = None,
        stop: stopping.StopCondition | None = None,
        *,
        max_tokens: int | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        drafter: Drafter | None = None,
        penalties: Penalties | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """``generate`` one token at a time: yields a ``TokenEvent`` per token; the last one
        carries ``done`` (the stop reason). ``logprobs=k`` adds each token's log-probability
        and the ``k`` most probable alternatives (raw model distribution, before the
        sampler's temperature and filters, as OpenAI and vLLM report them).

        ``grammar`` (``engine.grammar.Grammar``: a JSON schema, regex or Lark grammar):
        before each token every token it forbids is masked out, whatever the sampler; the
        generation ends with reason "grammar" when the grammar allows nothing more. When the
        grammar forces the next tokens they are checked in the same pass as the token before
        them (jump-forward; custom samplers excepted), so a constrained generation needs
        fewer passes and gives the same tokens.

        ``drafter`` (``engine.drafting.Drafter``, e.g. ``PromptLookupDrafter()``): each pass
        also checks the tokens it proposes and keeps those the sampler agrees with, plus one
        more (``engine.drafting`` says why greedy and seeded output are unchanged). Events
        still come one per token; the tokens of one pass come together (the pass's time is
        spread over them in the inter-token latency histogram).

        ``penalties`` (``engine.penalties.Penalties``): logit bias and repetition /
        frequency / presence penalties on every row before the grammar mask and the
        sampler (greedy included); the counts are this generation's own."""
        self._check_open()
        if logprobs is not None:
            check_int("logprobs", logprobs, min=0, max=LOGPROBS_MAX)
        if penalties is not None:
            penalties.check_vocab(self.model.arch.vocab_size)
        adjust = penalties.start(self.token_ids) if penalties is not None else None
        sampler = sampler or self.sampler or sampling.Sampler.greedy()
        cond = self._stop_condition(stop if stop is not None else self.stop, max_tokens)
        matcher = None
        if grammar is not None:  # the first one per model builds a vocabulary index (~1 s)
            matcher = await asyncio.to_thread(GrammarMatcher, grammar, self.model)
        tracker = cond.start()
        gen = _Emission(self, cond, tracker, matcher, logprobs)
        budget = _token_budget(cond)
        jump = matcher is not None and not sampler.is_custom
        # Rows this generation samples as they come are sampled in their pass, batched
        # with the pass's other contexts, unless a grammar or a custom sampler decides
        # (or, greedy without penalties, the runner's pass-wide argmax already serves).
        batched = None
        argmax_serves = sampler.is_greedy and adjust is None and self.model.runner.batch_argmax
        if matcher is None and not sampler.is_custom and not argmax_serves:
            batched = SampleRequest(sampler, self._rng(), adjust)
        plain = matcher is None and drafter is None and not sampler.is_custom
        with self._guard():
            self._sample_request = batched
            try:
                await self._ensure_logits()
            finally:
                self._sample_request = None
        self._check_open()
        if drafter is not None:
            drafter.update(self.token_ids)
        assert self._last_logits is not None
        rows: Sequence[torch.Tensor] = [self._last_logits]
        drafts: list[int] = []
        events: list[TokenEvent] = []  # the tokens of one pass

        def emit(token: int, row: torch.Tensor) -> bool:
            t0 = _phase_start()
            events.append(gen.emit(token, row))
            _phase_stop("loop: emit (detokenize, stop checks)", t0)
            return events[-1].done is not None

        while True:
            self._check_open()
            events.clear()
            self._take(rows, drafts, sampler, matcher, emit, adjust)
            gen.observe(len(events))
            if drafter is not None:
                drafter.update([ev.token for ev in events])
            for ev in events:
                yield ev
                if ev.done is None:
                    self._check_open()  # the consumer may close it while holding an event
            if events[-1].done is not None:
                return
            if plain:  # every further token: the decode loop (with the overlap where it is on)
                ahead = self.model.scheduler.overlap and not self._hidden
                async for ev in self._decode_plain(gen, sampler, batched, budget, adjust, ahead):
                    yield ev
                return
            drafts = []
            if jump and matcher is not None:
                drafts = matcher.forced()
            if not drafts and drafter is not None:
                drafts = drafter.draft()
            if drafts:
                limit = min(MAX_DRAFT, budget - len(gen.generated) - 1)
                drafts = checked_draft(drafts, self.model.arch.vocab_size, limit)
            start = self._n
            if drafts and self._table.can_reserve(start, start + 1 + len(drafts)):
                rows = await self._verify(drafts)
            else:
                drafts = []
                self.model.counters.fed_back_tokens += 1
                with self._guard():
                    self._sample_request = batched
                    try:
                        await self._prefill("last")
                    finally:
                        self._sample_request = None
                self._check_open()  # closed while that pass ran: its rows are gone
                assert self._last_logits is not None
                rows = [self._last_logits]

    async def _decode_plain(
        self,
        gen: _Emission,
        sampler: sampling.Sampler,
        request: SampleRequest | None,
        budget: int,
        adjust: PenaltyState | None = None,
        overlap: bool = False,
    ) -> AsyncIterator[TokenEvent]:
        """``stream``'s decode loop for a generation without grammar, drafter or custom
        sampler: one decode step per token, submitted and awaited without the general
        prefill's checks (a one-row step never takes cached pages). With ``overlap`` the
        host's work runs beside the passes: while the pass of the pending row runs, the
        step of the row after it (its token is what that pass samples) is already
        submitted (``StepInput.after``), so the scheduler hands it to the forward worker as
        soon as that pass ends, while this loop streams the token, checks the stops and
        submits the next one. A stop leaves one such step computed in vain: its row stays
        pending (as without overlap), a seeded generator gets its draw back, and its K/V
        are rewritten when the row is next computed. Tokens, seeded ones included, are the
        same either way."""
        counters = self.model.counters
        cur: _Submitted | None = self._enqueue_decode(request, None)
        ahead = None
        if overlap and len(gen.generated) + 1 < budget:
            ahead = self._enqueue_ahead(request, cur.step)
        try:
            while True:
                assert cur is not None
                with self._guard():  # busy while a pass of its rows runs
                    result = await cur.future
                self._check_open()  # closed while the pass ran: its rows are gone
                step, cur = cur.step, None
                if result is SKIPPED:  # its token never came: run its row as usual
                    if ahead is not None:
                        await self._drop_ahead(ahead)
                        ahead = None
                    cur = self._enqueue_decode(request, None)
                    continue
                counters.fed_back_tokens += 1
                self._n += 1
                self._table.publish(self._rows, self._n)
                self._land(step, result)
                token = self._pick(result, sampler, None, adjust)
                if ahead is not None and token != _token_of(step):
                    await self._drop_ahead(ahead)  # computed for another token: redo
                    ahead = None
                self._append_text([token])
                t0 = _phase_start()
                event = gen.emit(token, result)
                gen.observe(1)
                _phase_stop("loop: emit (detokenize, stop checks)", t0)
                if event.done is None:
                    t0 = _phase_start()
                    cur = ahead if ahead is not None else self._enqueue_decode(request, None)
                    ahead = None
                    if overlap and len(gen.generated) + 1 < budget:
                        ahead = self._enqueue_ahead(request, cur.step)
                    _phase_stop("loop: build and submit the next step", t0)
                yield event
                if event.done is not None:
                    return
                self._check_open()  # the consumer may close it while holding an event
        finally:
            if ahead is not None:
                await self._drop_ahead(ahead)

    def _enqueue_decode(
        self, request: SampleRequest | None, after: StepInput | None, pos: int | None = None
    ) -> _Submitted:
        """Submit the decode step of the pending last row (``after`` None), or of the row
        after it, whose token ``after``'s pass samples, at position ``pos`` (default: the
        cursor's); the step's future comes back."""
        start = len(self._rows) - (after is None)
        self._table.set_salt(self.adapters.identity(), start)
        if after is None:
            assert self._n == start, "one pending row"
            step = self._build_step(start, start + 1, "last")  # its pages: a copy of the table's
        else:
            self._table.reserve(start, start + 1)
            step = StepInput(
                tokens=[-1],
                positions=None,
                pos=(self._cursor if pos is None else pos,) * self.model.arch.position_axes,
                kv_start=start,
                pages=list(self._table.pages),
                logits="last",
                adapters=self.adapters.items,
                after=after,
            )
        step.sample = request
        submitted = _Submitted(step, self.model.scheduler.enqueue(step))
        inflight = self._overlap
        if len(inflight) >= 4:  # at most two are live at a time: drop those that ended
            inflight[:] = [s for s in inflight if not s.future.done()]
        inflight.append(submitted)
        return submitted

    def _enqueue_ahead(
        self, request: SampleRequest | None, after: StepInput, pos: int | None = None
    ) -> _Submitted | None:
        """``_enqueue_decode`` of the row after the pending one (or after a hand-built
        pass's last row: a staged pass), or None (that row then waits for its token): when
        its page is shared (reserving it would copy the page the pending row's pass is
        writing) or no page is free."""
        start = len(self._rows)
        if self._table.shares(start, start + 1):
            return None
        try:
            return self._enqueue_decode(request, after, pos)
        except OutOfPagesError:
            return None

    def _land(self, step: StepInput, logits: torch.Tensor) -> None:
        """A decode step's logits became the last row's (with the runner's argmax / draw)."""
        self._last_logits, self._last_hidden = logits, None
        self._argmax_hint = (logits, step.argmax) if step.argmax is not None else None
        self._sample_hint = None
        if step.sampled is not None and step.sample is not None:
            self._sample_hint = (logits, step.sample.sampler, step.sampled)

    async def _drop_ahead(self, ahead: _Submitted) -> None:
        """Drop a step submitted ahead of its token: unrun, it never runs; run (or running,
        then once its pass ends), its row stays pending and a seeded generator gets back
        the draw it made."""
        step, future = ahead
        if not step.dispatched:
            future.cancel()
            return
        if not future.done():
            try:
                await asyncio.shield(future)
            except Exception:  # its pass failed: nothing was drawn that matters
                return
        if step.skipped:
            return
        self.model.counters.fed_back_tokens += 1  # a generation row, not a prompt row
        if step.sample is not None and step.sample.adjust is not None and step.sampled is not None:
            step.sample.adjust.discard(step.sampled)  # its draw never became a token
        generator = step.sample.generator if step.sample is not None else None
        if generator is not None and step.rng_state is not None:
            before, after = step.rng_state
            if after is not None and torch.equal(generator.get_state(), after):
                generator.set_state(before)  # nothing drew since: give the draw back

    async def _run_pass(
        self,
        rows: list[Row],
        *,
        mask: torch.Tensor | None,
        out_rows: tuple[int, ...],
        hidden_rows: tuple[int, ...],
        adapters: tuple[tuple[Any, float], ...] = (),
        sample: SampleRequest | None = None,
        stage: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None]:
        """``engine.forward_pass``'s one step: append ``rows`` (their K/V at the next rows,
        whatever their positions), compute them in one pass under ``mask`` (None: causal),
        and return the logits of ``out_rows``, the final hidden states of ``hidden_rows``
        (sorted row indices into ``rows``) and, with ``sample`` (when ``out_rows`` is the
        last row alone), the token the pass drew from that row with it, batched with the
        pass's other rows (``engine.pass_sampling``; None if it could not). A step whose
        only output is its last row's logits takes the runner's decode path. On an error
        the rows are gone again and the context is as it was.

        ``stage`` (a greedy ``sample`` on the last row, no mask, no adapter): while this pass
        runs, the next one is submitted too, taking the token this one draws at the next
        row and position (``StepInput.after``, the overlap's mechanism); if the next call
        is exactly that pass it awaits the staged one instead of queueing (a hit), else the
        staged pass is dropped (a miss) and the call runs as usual. Tokens are the same
        either way."""
        t_call = _phase_start()
        self._check_open()
        self._check_not_busy()
        if self._staged is not None:
            if self._staged_fits(rows, mask, out_rows, hidden_rows, adapters, sample):
                return await self._run_staged(rows, stage, t_call)
            staged, self._staged = self._staged, None
            self.model.counters.staged_misses += 1
            await self._drop_ahead(staged.submitted)
        self._check_pass_ready(len(rows))
        start, end = self._n, self._n + len(rows)
        with self._guard():
            salt = self.adapters.identity()
            if adapters:
                salt += b"|" + "|".join(f"{a.digest}:{k!r}" for a, k in adapters).encode()
            self._table.set_salt(salt, start)
            self._rows.extend(rows)
            try:
                last_only = out_rows == (len(rows) - 1,) and not hidden_rows
                step = self._plain_step(start, end, "last" if last_only else "rows")
                if mask is not None and self._hidden:
                    mask = mask & self._hidden.visible(end)[None, :]
                elif mask is None and self._hidden:
                    mask = self._default_mask(start, end)
                step.mask, step.out_rows, step.hidden_rows = mask, out_rows, hidden_rows
                if adapters:
                    step.adapters = self.adapters.items + tuple(adapters)
                step.sample = sample if last_only else None
                future = self.model.scheduler.enqueue(step)
                if stage and last_only and sample is not None and sample.sampler.is_greedy:
                    if mask is None and not adapters and not self._hidden:
                        self._stage_after(step, rows[-1].next_pos)
                result = await future
            except BaseException:
                del self._rows[start:]  # their K/V were never (all) written
                self._unstage()
                raise
        _phase_stop_at("queue: a hand-built pass, execute to its pass's start", t_call, step.started)
        if last_only:
            self._computed(rows, result)
            return result.unsqueeze(0), None, step.sampled
        logits, hidden = result
        last = out_rows and out_rows[-1] == len(rows) - 1 and logits is not None
        self._computed(rows, logits[-1] if last else None)
        return logits, hidden, None

    def _check_not_busy(self) -> None:
        if self._busy:
            raise InvalidRequestError(
                "cannot run a forward pass while one of this context runs; await it first"
            )

    def _check_pass_ready(self, n_rows: int) -> None:
        """What ``_run_pass`` refuses before a pass of ``n_rows`` rows joins the batch (its
        context's state, not the pass's inputs): closed, a pass running, filled rows not
        computed, no room left."""
        self._check_open()
        self._check_not_busy()
        if self.pending:
            raise InvalidRequestError(
                f"the context has {self.pending} filled rows not computed yet: flush() them first, or put "
                "them in the pass as input tokens"
            )
        self._check_room(n_rows)

    def _computed(self, rows: list[Row], last_logits: torch.Tensor | None) -> None:
        """A hand-built pass's ``rows`` were computed: they join the context's K/V rows;
        ``last_logits``: the last row's, if the pass returned them (a later ``generate``
        samples from them)."""
        self._n += len(rows)
        self._cursor = rows[-1].next_pos
        self._last_hidden = self._argmax_hint = self._sample_hint = None
        self._last_logits = last_logits
        if self._chat.open_turn:
            self._chat.record([r.token for r in rows if r.span is None])

    def _stage_after(self, step: StepInput, pos: int) -> None:
        """Submit the pass after ``step``'s (its row's token is what ``step`` draws), at the
        row after the context's and position ``pos``: the decode loop's step ahead
        (``_enqueue_ahead``); nothing when its page is shared or the pool has none."""
        assert step.kv_start + len(step.tokens) == len(self._rows), "staged after the context's last row"
        submitted = self._enqueue_ahead(step.sample, step, pos)
        if submitted is not None:
            self._staged = _Staged(submitted, submitted.step.pos, self.adapters.items)

    def _staged_fits(
        self,
        rows: list[Row],
        mask: torch.Tensor | None,
        out_rows: tuple[int, ...],
        hidden_rows: tuple[int, ...],
        adapters: tuple[tuple[Any, float], ...],
        sample: SampleRequest | None,
    ) -> bool:
        """Whether this pass is the staged one: one text row with the token the pass before
        drew, at the predicted position, its logits alone, drawn with the same sampler."""
        staged = self._staged
        assert staged is not None
        step = staged.submitted.step
        before = step.after
        return (
            len(rows) == 1
            and rows[0].span is None
            and before is not None
            and rows[0].token == before.sampled
            and rows[0].pos == staged.pos
            and mask is None
            and out_rows == (0,)
            and not hidden_rows
            and not adapters
            and not self._hidden
            and self.adapters.items == staged.adapters
            and sample is not None
            and step.sample is not None
            and sample.sampler == step.sample.sampler
        )

    async def _run_staged(
        self, rows: list[Row], stage: bool, t_call: float = 0.0
    ) -> tuple[torch.Tensor, None, int | None]:
        """``_run_pass`` of the staged pass: its row joins the context, the result is the
        staged step's (staging the one after it first, when asked). ``t_call``: when the
        pass was asked for (``engine.step_timing``'s queueing time)."""
        staged, self._staged = self._staged, None
        assert staged is not None
        step, start = staged.submitted.step, self._n
        with self._guard():
            self._rows.extend(rows)
            if stage:
                self._stage_after(step, rows[0].next_pos)
            try:
                result = await staged.submitted.future
            except BaseException:
                del self._rows[start:]
                self._unstage()
                raise
        if result is SKIPPED:  # its token never came: run the row as usual
            del self._rows[start:]
            self._unstage()
            return await self._run_pass(rows, mask=None, out_rows=(0,), hidden_rows=(), sample=step.sample)
        self.model.counters.staged_hits += 1
        _phase_stop_at(
            "queue: a hand-built pass, execute to its pass's start (staged hit)", t_call, step.started
        )
        self._computed(rows, result)
        return result.unsqueeze(0), None, step.sampled

    def _unstage(self) -> None:
        """Drop a staged pass before anything else changes the context: cancelled if it has
        not been handed to the forward worker, else its pages are held until its pass ends
        (the row it writes is past the context's; it draws nothing: it is greedy)."""
        staged = self._staged
        if staged is None:
            return
        self._staged = None
        self.model.counters.staged_misses += 1
        submitted = staged.submitted
        if not submitted.step.dispatched:
            submitted.future.cancel()
        elif not submitted.future.done():
            pages, pool = list(submitted.step.pages), self.model.pool
            pool.incref(pages)
            self.model.scheduler.on_worker_after_passes(lambda: pool.decref(pages))

    async def verify_draft(self, draft: Sequence[int], sampler: sampling.Sampler | None = None) -> list[int]:
        """One speculative step outside ``generate``: check ``draft`` (the tokens a caller
        expects next) in one pass and append the longest prefix the sampler agrees with plus
        one more sampled token; returns those tokens (at least one). A context whose last
        row is pending (as after a generation or an earlier call) checks everything in one
        pass; otherwise its pending rows are prefilled first and the draft's first token is
        checked against the logits that gives. No stop conditions apply."""
        self._check_open()
        sampler = sampler or self.sampler or sampling.Sampler.greedy()
        draft = checked_draft(list(draft), self.model.arch.vocab_size, MAX_DRAFT)
        out: list[int] = []

        def note(token: int, row: torch.Tensor) -> bool:
            out.append(token)
            return False

        if self.pending != 1:
            with self._guard():
                await self._ensure_logits()
            assert self._last_logits is not None
            self._take([self._last_logits], [], sampler, None, note)
            if not draft or out[-1] != draft[0]:
                return out
            draft = draft[1:]
        if draft and self._table.can_reserve(self._n, self._n + 1 + len(draft)):
            rows: Sequence[torch.Tensor] = await self._verify(draft)
        else:
            draft = []
            with self._guard():
                await self._prefill("last")
            assert self._last_logits is not None
            rows = [self._last_logits]
        self._check_open()
        self._take(rows, draft, sampler, None, note)
        return out

    def _take(
        self,
        rows: Sequence[torch.Tensor],
        drafts: list[int],
        sampler: sampling.Sampler,
        matcher: GrammarMatcher | None,
        emit: Callable[[int, torch.Tensor], bool],
        adjust: PenaltyState | None = None,
    ) -> None:
        """Sample ``rows`` in order (row i: the distribution after the pending token and
        ``drafts[:i]``); a drafted token is kept while it is what was sampled, and the first
        mismatch, the last row or ``emit`` returning True (a stop) ends it. The kept rows
        stay, the rest are rolled back, and a sampled (not drafted) last token joins the
        context pending."""
        tokens, kept = accept_drafts(
            rows, drafts, lambda row: self._pick(row, sampler, matcher, adjust), emit
        )
        if drafts:
            self._settle(len(drafts), kept, rows)
        if kept < len(tokens):
            self._append_text([tokens[-1]])

    def _pick(
        self,
        logits: torch.Tensor,
        sampler: sampling.Sampler,
        matcher: GrammarMatcher | None,
        adjust: PenaltyState | None = None,
        generator: torch.Generator | None = None,
    ) -> int:
        """The next token from one row of logits (penalties, grammar mask, then the sampler
        and ``generator``, default this context's); the matcher and the penalty counts
        advance past it."""
        drawn = self._sample_hint
        if (
            drawn is not None
            and matcher is None
            and drawn[0] is logits
            and (drawn[1] is sampler or drawn[1] == sampler)
        ):
            self._sample_hint = None  # the runner drew it, penalties applied and counted
            return drawn[2]
        if adjust is not None:
            logits = adjust.apply(logits)  # a new tensor: the runner's argmax hint is not for it
        hint = self._argmax_hint
        if matcher is None and sampler.is_greedy and hint is not None and hint[0] is logits:
            token = hint[1]  # the runner read it with the whole pass's argmaxes
        else:
            scores = logits if matcher is None else matcher.mask(logits)
            token = int(sampling.sample(scores[None], sampler, generator or self._rng())[0])
        if matcher is not None:
            matcher.accept(token)
        if adjust is not None:
            adjust.add(token)
        return token

    async def _verify(self, drafts: list[int]) -> torch.Tensor:
        """One pass over the pending last token plus ``drafts`` (appended as rows), every
        row's logits returned: row i is the distribution after the i-th of them. The rows
        stay committed until ``_settle`` keeps the accepted ones."""
        start = self._n
        assert len(self._rows) == start + 1, "a verify step follows exactly one pending token"
        self._append_text(drafts)
        end = len(self._rows)
        with self._guard():
            self._table.set_salt(self.adapters.identity(), start)
            step = self._build_step(start, end, "all")
            try:
                result = await self.model.scheduler.submit(step)
            except BaseException:
                self._drop_rows(start + 1)
                raise
        self._check_open()  # closed while the pass ran: its rows are gone
        self._n = end
        self._last_logits = self._last_hidden = self._argmax_hint = self._sample_hint = None
        counters = self.model.counters
        counters.fed_back_tokens += end - start  # generation rows, so prompt_tokens stays right
        counters.drafted_tokens += len(drafts)
        assert result is not None
        return result

    def _settle(self, drafted: int, kept: int, rows: Sequence[torch.Tensor]) -> None:
        """After a verify pass: keep the pending token and the first ``kept`` drafted rows
        (committed), roll the rest back (rows, chat record, pages past them)."""
        self.model.counters.accepted_draft_tokens += kept
        keep = len(self._rows) - drafted + kept
        self._drop_rows(keep)
        self._n = keep
        self._table.truncate(keep)
        self._table.publish(self._rows, keep)
        # The last kept row's logits are known: a generation that stops on an accepted
        # draft leaves no pending row, and the next sample needs no pass.
        self._last_logits = rows[kept]

    def _drop_rows(self, keep: int) -> None:
        removed = len(self._rows) - keep
        if removed > 0:
            del self._rows[keep:]
            self._cursor = self._rows[-1].next_pos if self._rows else 0
            self._chat.forget(removed)

    # -- branching and persistence ---------------------------------------------------------
    def fork(self) -> Context:
        """A child with the same history: committed pages shared by reference (a partly
        filled last page is copied when either side first writes to it), pending rows,
        chat state and sampling state copied."""
        self._check_open()
        if self._busy:
            raise InvalidRequestError("cannot fork a context while it runs a forward pass")
        child = Context(self.model, seed=self._seed)
        child._adopt_table(self._table.fork(self._n))
        for adapter, scale in self.adapters.items:
            child.adapters.push(adapter, scale)
        child._rows = list(self._rows)
        child._n = self._n
        child._hidden = self._hidden.copy()
        child._cursor = self._cursor
        child._last_logits = self._last_logits
        child._argmax_hint = self._argmax_hint
        child._last_hidden = self._last_hidden
        child._chat = self._chat.copy()
        child.sampler, child.stop = self.sampler, self.stop
        if self._generator is not None:
            child._generator = torch.Generator(device=self._generator.device)
            child._generator.set_state(self._generator.get_state())
        return child

    def save(self, name: str, *, overwrite: bool = False) -> None:
        """Pin this context's state (pages by reference) under ``name`` in the model
        (``model.saved.save``); ``Context.open(model, name)`` forks from it;
        ``model.saved.delete(name)`` unpins."""
        self.model.saved.save(name, self, overwrite=overwrite)

    @classmethod
    def open(cls, model: Model, name: str) -> Context:
        """A new context forked from the one saved as ``name`` (``model.saved.open``)."""
        return model.saved.open(name)

    def truncate(self, n: int) -> Context:
        """Keep the first ``n`` rows (committed or pending); a media span cannot be cut."""
        self._check_open()
        if self._busy:
            raise InvalidRequestError("cannot truncate a context while it runs a forward pass")
        self._unstage()
        n = check_int("rows to keep", n)
        if not 0 <= n <= len(self._rows):
            raise InvalidRequestError(f"cannot truncate to {n} rows: the context has {len(self._rows)}")
        if 0 < n < len(self._rows):
            a, b = self._rows[n - 1], self._rows[n]
            if a.span is not None and a.span is b.span:
                raise InvalidRequestError(f"row {n} is inside a media span; truncate before or after it")
        removed = len(self._rows) - n
        del self._rows[n:]
        self._hidden.truncate(n)
        self._cursor = self._rows[-1].next_pos if self._rows else 0
        if n < self._n:
            self._n = n
            self._table.truncate(n)
            self._last_logits = self._last_hidden = None
        self._chat.forget(removed)
        return self

    def rewind(self, k: int) -> Context:
        """Drop the last ``k`` rows."""
        k = check_int("rows to drop", k, min=0)
        return self.truncate(max(0, len(self._rows) - k))

    def close(self) -> None:
        """Release the pages (idempotent). Closing while a pass of this context runs
        releases them when the pass ends (its rows are being written)."""
        if self._closed:
            return
        self._closed = True
        if self._busy:
            return  # _Busy.__exit__ finishes the job
        self._release()

    def _adopt_table(self, table: PageTable) -> None:
        """Hold ``table`` instead of the (empty) one this context was built with."""
        self._finalizer.detach()
        self._table.release()
        self._table = table
        self._finalizer = weakref.finalize(self, PageTable.release, table)

    def _release(self) -> None:
        self._unstage()
        for submitted in self._overlap:  # never to run into pages someone else may get
            if not submitted.step.dispatched:
                submitted.future.cancel()
        self._table.release()
        self._finalizer.detach()
        self._rows = []
        self._n = 0
        self._hidden = HiddenRows()
        self._last_logits = self._last_hidden = None

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Context:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._n} committed + {self.pending} pending rows"
        return f"Context({self.model.name}, {state})"

    # -- internals: rows --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ContextClosedError("this context is closed")

    def _check_idle(self, what: str) -> None:
        self._check_open()
        self._unstage()
        if self._busy:
            raise InvalidRequestError(
                f"cannot {what} while a forward pass of this context runs; await it first"
            )

    def _guard(self) -> _Busy:
        if self._staged is not None:
            self._unstage()
        if self._busy:
            raise InvalidRequestError("this context is already running a forward pass; await it first")
        return _Busy(self)

    def reseed(self, seed: int) -> Context:
        """Sample from now on with a fresh generator seeded by ``seed`` (e.g. each fork of a
        prompt its own seed, so n choices are reproducible and different)."""
        self._seed = check_int("seed", seed)
        self._generator = sampling.generator(self._seed)
        return self

    def _rng(self) -> torch.Generator | None:
        if self._generator is None and self._seed is not None:
            self._generator = sampling.generator(self._seed)
        return self._generator

    def _append_text(self, ids: Sequence[int]) -> None:
        if self._staged is not None:
            self._unstage()
        axes = self.model.arch.position_axes
        c = self._cursor
        for t in ids:
            self._rows.append(Row(token=t, pos=(c,) * axes, next_pos=c + 1))
            c += 1
        self._cursor = c
        self._chat.record(ids)

    def _append_span(self, prepared: Prepared) -> None:
        arch = self.model.arch
        if prepared.family != arch.family:
            raise InvalidRequestError(
                f"media prepared for {prepared.family!r} cannot go into a {arch.family!r} model"
            )
        placeholder = arch.placeholder_ids().get(prepared.kind)
        if placeholder is None:
            raise InvalidRequestError(f"{arch.name} takes no {prepared.kind} input")
        if prepared.placeholder_id != placeholder:
            raise InvalidRequestError(
                f"prepared {prepared.kind} uses placeholder id {prepared.placeholder_id}, the model {placeholder}"
            )
        pos = prepared.positions
        if pos.dim() != 2 or pos.shape[0] != arch.position_axes or pos.shape[1] != prepared.num_rows:
            raise InvalidRequestError(
                f"prepared positions have shape {tuple(pos.shape)}, expected "
                f"({arch.position_axes}, {prepared.num_rows})"
            )
        if self._staged is not None:
            self._unstage()
        placeholder_id = prepared.placeholder_id
        ids = prepared.input_ids
        types = prepared.mm_token_type or [MM_TYPES[prepared.kind] if t == placeholder_id else 0 for t in ids]
        anchor = self._cursor
        after = anchor + prepared.position_span
        span = Span(prepared=prepared, start=len(self._rows))
        key = prepared.cache_key
        positions = [tuple(p) for p in (pos + anchor).t().tolist()]
        nexts = [max(p) + 1 for p in positions]
        if nexts:
            nexts[-1] = after
        emb = 0
        rows = []
        for offset, token in enumerate(ids):
            if token == placeholder_id:
                e, emb = emb, emb + 1
            else:
                e = -1
            rows.append(
                Row(
                    int(token),
                    positions[offset],
                    nexts[offset],
                    MediaRow(key, offset),
                    span,
                    e,
                    int(types[offset]),
                )
            )
        if emb != prepared.token_count:
            raise InvalidRequestError(
                f"prepared {prepared.kind} has {emb} placeholder rows but token_count {prepared.token_count}"
            )
        self._rows.extend(rows)  # only once every check passed: a refused item leaves no rows
        self._cursor = after

    def _append_media(self, kind: str, media: Any, params: dict[str, Any]) -> Prepared:
        self._check_open()
        prepared = self.model.prepare(media, **params)
        if prepared.kind != kind:
            raise InvalidRequestError(f"append_{kind} was given {prepared.kind} media")
        self._check_room(prepared.token_count)
        self._append_span(prepared)
        return prepared

    # -- internals: chat --------------------------------------------------------------------
    def _turn(self, role: str, content: Sequence[Any], extra: Mapping[str, Any] | None = None) -> Context:
        return self.turns([(role, content, extra)])

    def _fill_template(self, text: str, media: list[Prepared]) -> None:
        pieces = [
            self.model.tokenize(p) if isinstance(p, str) else p
            for p in template_pieces(text, media, self.model.arch)
        ]  # all tokenized first: a prompt over the context length builds no rows
        self._check_room(sum(len(p) if isinstance(p, list) else p.token_count for p in pieces))
        for piece in pieces:
            if isinstance(piece, list):
                self._append_text(piece)
            else:
                self._append_span(piece)

    def _check_room(self, more: int) -> None:
        """Refuse input that would take the context past ``model.max_model_len`` rows."""
        limit = self.model.max_model_len
        if limit is not None and len(self._rows) + more > limit:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {limit} tokens; the prompt makes at "
                f"least {len(self._rows) + more}. Shorten it",
                param="messages",
                limit=limit,
                prompt_tokens=len(self._rows) + more,
            )

    def _close_turn(self) -> None:
        """After a generation in an open assistant turn, complete the turn as the template
        renders it and record it in the history."""
        tail = self._chat.close_turn(self.model.chat, self.model.detokenize)
        if tail:
            self._append_text(self.model.tokenize(tail))

    def _stop_condition(
        self, stop: stopping.StopCondition | None, max_tokens: int | None
    ) -> stopping.StopCondition:
        if stop is None:
            cond: stopping.StopCondition = stopping.max_tokens(
                DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
            )
            if self.model.eos_token_ids:
                cond = cond | stopping.eos(self.model.eos_token_ids)
            return cond
        if max_tokens is not None:
            return stop | stopping.max_tokens(max_tokens)
        return stop

    # -- internals: prefill -----------------------------------------------------------------
    async def _ensure_logits(self) -> None:
        if self.pending:
            await self._prefill("last")
        if self._last_logits is None and self._last_hidden is not None:
            self._last_logits = await self.model.scheduler.logits_of(self._last_hidden)
            self._last_hidden = None
        if self._last_logits is None:
            if self._n == 0:
                raise InvalidRequestError("the context is empty: fill something before sampling")
            # Logits of the last committed row are gone (truncated, restored): recompute it.
            self._uncommit(1)
            await self._prefill("last")

    def _uncommit(self, k: int) -> None:
        self._n -= k
        self._table.forget_keys(self._n)

    async def _prefill(self, want: LogitsWanted) -> torch.Tensor | None:
        """Commit every pending row; ``want``: "last" keeps the last row's logits for
        sampling, "hidden" keeps its final hidden state instead (the head runs later, if
        ever: ``_ensure_logits``), "all" also returns every row's logits (and computes
        every row)."""
        total = len(self._rows)
        collected: list[torch.Tensor] = []
        every = want in ("all", "states")  # every row computed and returned: no prefix-cache reuse
        while self._n < total:
            self._check_open()  # closed while the previous chunk ran
            self._table.set_salt(self.adapters.identity(), self._n)
            if not every:
                # Published pages matching pending rows (the prefix cache); the last row is
                # always computed (its output is what this prefill is for).
                before = self._n
                self._n = self._table.reuse(self._rows, self._n, limit=total - 1)
                self.cached_rows += self._n - before
                if self._take_tail(total):
                    break  # the rest, and the last row's output, were kept by an earlier prefill
            start = self._n
            end = self._chunk_end(start, total)
            step_want: LogitsWanted = want if end == total or every else "none"
            if step_want == "last" and end - start > 1:
                step_want = "last+hidden"  # a prompt, not a decode step: keep its tail too
            t0 = _phase_start()
            step = self._build_step(start, end, step_want)
            future = self.model.scheduler.enqueue(step)
            _phase_stop("loop: build and submit the next step", t0)
            result = await future
            self._n = end
            self._table.publish(self._rows, end)
            if step_want == "last+hidden":
                result, kept = result
                self._put_tail(total, result, kept)
            elif end == total and want == "hidden":
                self._put_tail(total, None, result)
            if every and result is not None:
                collected.append(result)
            if end == total:
                if want == "states":
                    self._last_logits, self._last_hidden = None, result[-1]
                elif want == "hidden":
                    self._last_logits, self._last_hidden = None, result
                else:
                    self._last_logits = result[-1] if want == "all" else result
                    self._last_hidden = None
                    if step.argmax is not None and want == "last":
                        self._argmax_hint = (result, step.argmax)
                    if step.sampled is not None and step.sample is not None:
                        self._sample_hint = (self._last_logits, step.sample.sampler, step.sampled)
        if want == "all":
            return torch.cat(collected) if collected else torch.empty(0, self.model.arch.vocab_size)
        if want == "states":
            return torch.cat(collected) if collected else torch.empty(0, self.model.arch.hidden_size)
        return None

    def _tail_key(self, start: int, end: int) -> bytes | None:
        """Key of rows ``[start, end)``, the (partial) last page of a prefill, chained to the
        full pages before it; None when those pages are not all keyed."""
        ps = self.model.pool.page_size
        keys = self._table.keys
        if start % ps or not 0 < end - start <= ps or len(keys) < start // ps:
            return None
        parent = keys[start // ps - 1] if start else None
        key = rows_key(parent, self._rows[start:end], self._table._page_salt(start // ps))
        return hashlib.blake2b(b"tail" + key, digest_size=16).digest()

    def _take_tail(self, total: int) -> bool:
        """Commit the pending rows ``[committed, total)`` at once when they are the partial
        last page of an earlier prefill with this exact history (``KVPool.take_tail``):
        their K/V is copied into this context's page and the last row's kept output (logits,
        else final hidden state) stands in for its own. False (nothing changed) otherwise."""
        start, pool = self._n, self.model.pool
        key = self._tail_key(start, total)
        if key is None or not pool.has_tail(key):
            return False
        self._table.reserve(start, total)
        taken = pool.take_tail(key, self._table.pages[start // pool.page_size])
        if taken is None:
            return False
        self._n = total
        self.cached_rows += total - start
        self._table.publish(self._rows, total)
        logits, hidden = taken[1]
        self._last_logits, self._last_hidden = (logits, None) if logits is not None else (None, hidden)
        return True

    def _put_tail(self, total: int, logits: torch.Tensor | None, hidden: torch.Tensor | None) -> None:
        """Keep the last (partial) page of a finished prefill with its last row's output (its
        final hidden state, and its logits when the pass computed them), for a later
        context that fills exactly these rows (``_take_tail``)."""
        if hidden is None:
            return
        ps = self.model.pool.page_size
        start = (total - 1) // ps * ps
        key = self._tail_key(start, total)
        if key is not None and not self.model.pool.has_tail(key):
            kept = logits.clone() if logits is not None else None  # not a view of the pass's logits
            self.model.pool.put_tail(key, self._table.pages[start // ps], total - start, (kept, hidden))

    def _chunk_end(self, start: int, total: int) -> int:
        limit = self.model.max_prefill_rows
        end = min(total, start + limit)
        if end == total:
            return end
        # Never cut a media span, nor a run of vision rows (one bidirectional block).
        cut = end
        while cut > start and not self._can_cut(cut):
            cut -= 1
        if cut > start:
            return cut
        cut = end
        while cut < total and not self._can_cut(cut):
            cut += 1
        return cut

    def _can_cut(self, at: int) -> bool:
        a, b = self._rows[at - 1], self._rows[at]
        if a.span is not None and a.span is b.span:
            return False
        return not (a.mm_type in (1, 2) and b.mm_type in (1, 2))

    def _build_step(self, start: int, end: int, want: LogitsWanted) -> StepInput:
        step = self._plain_step(start, end, want)
        if self._hidden:  # rows masked out for good: every pass says so
            step.mask = self._default_mask(start, end)
        return step

    def _default_mask(self, start: int, end: int) -> torch.Tensor:
        """(end - start, end) causal mask of rows [start, end) without the hidden rows (the
        attention adds media blocks where a layer has them)."""
        return sequence_causal_mask(start, end) & self._hidden.visible(end)[None, :]

    def _plain_step(self, start: int, end: int, want: LogitsWanted) -> StepInput:
        self._table.reserve(start, end)
        if end - start == 1:
            row = self._rows[start]
            if row.span is None and row.mm_type not in (1, 2):  # a text row: a decode step
                return StepInput(
                    tokens=[row.token],
                    positions=None,
                    pos=row.pos,
                    kv_start=start,
                    pages=self._table.pages,
                    logits=want,
                    adapters=self.adapters.items,
                    sample=self._sample_request if want in ("last", "last+hidden") else None,
                )
        rows = self._rows[start:end]
        # numpy builds the (axes, rows) array in half the time torch.tensor takes (a decode
        # step builds one per context per token).
        positions = torch.from_numpy(np.array([r.pos for r in rows], dtype=np.int64).T.copy())
        media = self._media_rows(rows) if any(r.span is not None for r in rows) else []
        block_ids = None
        if self.model.runner.block_overlay_layers:
            ids, current, prev = [], -1, False
            for r in rows:
                vision = r.mm_type in (1, 2)
                if vision and not prev:
                    current += 1
                ids.append(current if vision else -1)
                prev = vision
            if current >= 0:
                block_ids = torch.tensor(ids, dtype=torch.long)
        return StepInput(
            tokens=[r.token for r in rows],
            positions=positions,
            kv_start=start,
            pages=self._table.pages,
            media=media,
            block_ids=block_ids,
            logits=want,
            adapters=self.adapters.items,
            sample=self._sample_request if want in ("last", "last+hidden") else None,
        )

    def _media_rows(self, rows: list[Row]) -> list[MediaRows]:
        spans: dict[int, tuple[Span, list[int], list[int]]] = {}
        for i, r in enumerate(rows):
            if r.span is not None and r.emb >= 0:
                entry = spans.setdefault(id(r.span), (r.span, [], []))
                entry[1].append(i)
                entry[2].append(r.emb)
        return [
            MediaRows(
                rows=torch.tensor(at, dtype=torch.long),
                prepared=span.prepared,
                index=torch.tensor(emb, dtype=torch.long),
            )
            for span, at, emb in spans.values()
        ]


class _Staged(NamedTuple):
    submitted: _Submitted
    pos: tuple[int, ...]
    adapters: tuple[tuple[Any, float], ...]


class _Submitted(NamedTuple):
    step: StepInput
    future: asyncio.Future


def accept_drafts(
    rows: Sequence[torch.Tensor],
    drafts: Sequence[int],
    pick: Callable[[torch.Tensor], int],
    emit: Callable[[int, torch.Tensor], bool] | None = None,
) -> tuple[list[int], int]:
    """The rule of speculative verification, for ``generate``'s drafts and jump-forward,
    ``verify_draft`` and a forward pass's speculative tokens alike: ``pick`` a token from
    each row in order (row i: the distribution after ``drafts[:i]``); a drafted token is
    kept while it is what was picked, and the first mismatch, the last row or ``emit``
    returning True (a stop) ends it. Returns the picked tokens and how many of them were
    the drafts' (the last token is a draft's only when a stop came on it)."""
    tokens: list[int] = []
    kept = 0
    for i, row in enumerate(rows):
        token = pick(row)
        tokens.append(token)
        stopped = emit is not None and emit(token, row)
        if i < len(drafts) and token == drafts[i]:
            kept += 1
        if stopped or i == len(drafts) or token != drafts[i]:
            break
    return tokens, kept


def _token_of(step: StepInput) -> int | None:
    """The token a step's pass drew for its row (what a step ``after`` it runs with)."""
    return step.sampled if step.sample is not None else step.argmax


def _token_budget(cond: stopping.StopCondition) -> int:
    """The most tokens ``cond`` lets a generation have (drafts never reach past it)."""
    parts = cond.conditions if isinstance(cond, stopping.AnyOf) else (cond,)
    return min((p.n for p in parts if isinstance(p, stopping.MaxTokens)), default=1 << 30)


class _Emission:
    """One generation's output side: generated ids, stop checks, the visible text (stop
    string holdback, open characters), logprobs and the latency counters."""

    def __init__(
        self,
        ctx: Context,
        cond: stopping.StopCondition,
        tracker: stopping.Tracker,
        matcher: GrammarMatcher | None,
        logprobs: int | None,
    ):
        self.ctx, self.cond, self.tracker, self.matcher, self.logprobs = ctx, cond, tracker, matcher, logprobs
        model = ctx.model
        self._text = IncrementalText(model.text_decoder, model.byte_fallback_ids, model.token_text)
        self.generated: list[int] = self._text.ids
        self.emitted = ""
        self.started = self.last = time.perf_counter()

    def emit(self, token: int, logits: torch.Tensor) -> TokenEvent:
        lp, top = (
            sampling.logprobs_of(logits, token, self.logprobs) if self.logprobs is not None else (None, ())
        )
        text = self._text.push(token)  # appends to self.generated
        reason = self.tracker.check(self.generated, text)
        if reason is None and self.matcher is not None and self.matcher.done:
            reason = stopping.StopReason("grammar", text, self.matcher.grammar.kind)
        if reason is not None:
            visible = reason.text
        else:
            visible = text[: len(text) - self.cond.holdback(text)]
        delta = ""
        settled = not visible.endswith("\ufffd") and token not in self.ctx.model.byte_fallback_ids
        if reason is not None or settled:
            # Held-back text keeps ``emitted`` a prefix of the whole decode; should a tokenizer
            # still rewrite earlier text, only what follows the common prefix goes out.
            emitted = self.emitted
            if visible.startswith(emitted):  # the usual case, in C: no per-character loop
                delta = visible[len(emitted) :]
            else:
                delta = visible[len(os.path.commonprefix((emitted, visible))) :]
            self.emitted = visible
        return TokenEvent(token=token, text=delta, done=reason, logprob=lp, top_logprobs=top)

    def observe(self, count: int) -> None:
        """``count`` tokens just came from one pass: the first token of a generation is its
        TTFT; the others share the time since the previous tokens."""
        counters = self.ctx.model.counters
        now = time.perf_counter()
        first = len(self.generated) == count
        if first:
            counters.ttft.observe(now - self.started)
        rest = count - first
        for _ in range(rest):
            counters.itl.observe((now - self.last) / rest)
        self.last = now
        counters.generated_tokens += count


class _Busy:
    def __init__(self, ctx: Context):
        self.ctx = ctx

    def __enter__(self) -> None:
        self.ctx._busy = True

    def __exit__(self, *exc: object) -> None:
        self.ctx._busy = False
        if self.ctx._closed:
            self.ctx._release()
