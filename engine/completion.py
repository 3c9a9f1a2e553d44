"""A chat completion with ``n`` choices, as serving APIs ask for it.

The conversation is prefilled once in one context; each choice is a ``fork`` of it, so
the prompt and its media are computed and stored once whatever ``n`` is (forks share
the committed pages and copy only the partly filled last page). The choices then
generate concurrently (their decode steps share forward passes) and their tokens come
out interleaved, each tagged with its choice index.

Media preparation (decode-side CPU work) runs on a worker thread, not on the event
loop; encoding and the forward passes run on the model's scheduler as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import stopping
from engine.chat import ROLES
from engine.context import Context
from engine.drafting import DraftSpec
from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.grammar import Grammar
from engine.lora import Adapter
from engine.model import Model
from engine.penalties import Penalties
from engine.sampling import Sampler

LONG_TEXT_CHARS = 64 * 1024
"""Prompt text past which a completion tokenizes on a worker thread (a thread hop costs
less than the tokenizer's work there; below it, the other way round)."""


@dataclass(frozen=True)
class Turn:
    """One message: a role and its parts (strings and media objects, in order), and the
    message's other keys the chat template reads (an assistant's ``tool_calls``, a tool
    result's ``tool_call_id``)."""

    role: str
    parts: tuple[Any, ...]
    extra: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class CompletionParams:
    sampler: Sampler = field(default_factory=Sampler.greedy)
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    """Choice ``i`` samples from seed ``seed + i``: reproducible, and the choices differ."""
    logprobs: int | None = None
    """None: no log-probabilities; k >= 0: the chosen token's and the top ``k`` alternatives'."""
    ignore_eos: bool = False
    """Generate through EOS until ``max_tokens`` or a stop string (benchmarks, load tests)."""
    grammar: Grammar | None = None
    """Every choice's output must match it (``response_format``: JSON schema, regex)."""
    adapters: tuple[tuple[Adapter, float], ...] = ()
    """LoRA adapters (with scales) every choice runs under, bottom of the stack first."""
    speculative: DraftSpec | None = None
    """Speculative decoding: each choice drafts with its own ``speculative.make()``."""
    penalties: Penalties | None = None
    """Logit bias and repetition / frequency / presence penalties (each choice counts its
    own output)."""
    prompt_logprobs: int | None = None
    """A raw prompt's own tokens' log-probabilities (``Completion.from_prompt``): None:
    none; k >= 0: each token's under the model given the ones before it (raw log-softmax,
    as vLLM reports prompt logprobs) and the top ``k`` alternatives."""
    max_tokens_is_default: bool = False
    """``max_tokens`` is a default the caller did not choose: where the prompt leaves less
    room in ``Model.max_model_len``, generate up to that room instead of refusing (OpenAI's
    and vLLM's behaviour when ``max_tokens`` is left out)."""


@dataclass(frozen=True)
class ChoiceEvent:
    """One generated token of one choice."""

    index: int
    token: int
    text: str
    """The text this token completed (may be empty while a character is open)."""
    finish_reason: str | None = None
    """"stop" (EOS or a stop string) or "length" on the choice's last token."""
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


_FINISH = {"eos": "stop", "stop_string": "stop", "grammar": "stop", "length": "length"}


class Completion:
    """A running completion. ``async for event in completion`` yields ``ChoiceEvent``s of
    all choices as they are produced; ``prompt_tokens`` is known once ``start`` returned.
    Closing it (or leaving ``async with``) cancels unfinished choices and frees their pages."""

    def __init__(
        self,
        model: Model,
        turns: Sequence[Turn],
        params: CompletionParams,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_options: Mapping[str, Any] | None = None,
    ):
        """``tools``: function definitions the chat template renders into the prompt
        (``Context.use_tools``); parse the output with ``engine.tool_calls``.
        ``template_options``: keywords for the chat template (``Context.template_options``,
        e.g. ``enable_thinking``)."""
        for t in turns:
            if t.role not in ROLES:
                raise InvalidRequestError(f"unknown role {t.role!r}; expected one of {', '.join(ROLES)}")
        if not turns:
            raise InvalidRequestError("a completion needs at least one message")
        self._init(model, tuple(turns), None, params)
        self.tools = list(tools) if tools else None
        self.template_options = dict(template_options or {})

    @classmethod
    def from_prompt(cls, model: Model, prompt: str | Sequence[int], params: CompletionParams) -> Completion:
        """A completion of a raw prompt (OpenAI's legacy ``/v1/completions``): no chat
        template. Text is tokenized as the model's tokenizer does by default, with its BOS
        where it has one (Gemma's), as ``tokenizer(prompt)`` gives the reference; token ids
        are taken as they are."""
        if not isinstance(prompt, str):
            prompt = [int(i) for i in prompt]
        self = cls.__new__(cls)
        self._init(model, (), prompt, params)
        return self

    def _init(
        self, model: Model, turns: tuple[Turn, ...], prompt: str | list[int] | None, params: CompletionParams
    ) -> None:
        if params.n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {params.n}")
        if params.prompt_logprobs is not None and prompt is None:
            raise InvalidRequestError("prompt_logprobs needs a raw prompt (Completion.from_prompt)")
        self.model = model
        self.turns = turns
        self.tools: list[Mapping[str, Any]] | None = None
        self.template_options: dict[str, Any] = {}
        self.prompt = prompt
        """The raw prompt of ``from_prompt`` (text or ids); None for a chat."""
        self.prompt_ids: list[int] = []
        """A raw prompt's tokens, known once ``start`` returned (a chat's are the context's)."""
        self.prompt_logprobs: list[PromptLogprob] = []
        """With ``params.prompt_logprobs``: one per prompt token (known once ``start`` returned)."""
        self.params = params
        self.prompt_tokens = 0
        self.cached_tokens = 0
        """Prompt tokens taken from the prefix cache rather than computed (known once
        ``start`` returned)."""
        self.max_tokens = params.max_tokens
        """Tokens each choice may generate: ``params.max_tokens``, or less for a default
        that the context length cuts (known once ``start`` returned)."""
        self.completion_tokens = [0] * params.n
        self._contexts: list[Context] = []
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue[ChoiceEvent | BaseException | None] = asyncio.Queue()
        self._started = False
        self._remaining = 0

    def __repr__(self) -> str:
        what = f"turns={len(self.turns)}" if self.prompt is None else f"prompt={_short(self.prompt)}"
        return (
            f"Completion(model={self.model.name!r}, {what}, n={self.params.n}, "
            f"prompt_tokens={self.prompt_tokens}, completion_tokens={sum(self.completion_tokens)})"
        )

    async def prompt_token_ids(self, *, cue: bool = True) -> list[int]:
        """The prompt's token ids (media rows as their placeholder ids) as ``start`` would
        build them, without computing anything or holding pages: the count a request will
        cost (``/tokenize``). ``cue=False`` leaves out the generation prompt."""
        async with Context(self.model) as ctx:
            await self._fill(ctx, cue=cue)
            return ctx.token_ids

    async def _fill(self, root: Context, *, cue: bool = True) -> None:
        """The prompt's rows in ``root`` (media prepared, the template rendered), none computed."""
        prepared = await self._prepare_turns()
        if self.prompt is not None:
            await self._fill_prompt(root)
            return
        if self.template_options:
            root.template_options(**self.template_options)
        if self.tools:
            root.use_tools(self.tools)
        pairs = [(turn.role, parts, turn.extra) for turn, parts in zip(self.turns, prepared, strict=True)]
        if sum(len(p) for _, parts, _ in pairs for p in parts if isinstance(p, str)) > LONG_TEXT_CHARS:
            # tokenizing ~1 MB of text takes ~0.4 s: off the event loop, which the tokenizer
            # lets run meanwhile (the context is this completion's own until it is flushed)
            await asyncio.to_thread(root.turns, pairs)
        else:
            root.turns(pairs)
        if cue:
            root.cue()

    async def start(self) -> Completion:
        """Prepare the media, prefill the conversation once and fork the choices."""
        if self._started:
            return self
        self._started = True
        root = Context(self.model, seed=self.params.seed)
        self._contexts.append(root)
        for adapter, scale in self.params.adapters:
            root.adapters.push(adapter, scale)
        await self._fill(root)
        self._fit(len(root))  # before any row is computed
        if self.params.prompt_logprobs is not None:
            logits = await root.flush(return_logits=True)
            assert logits is not None
            self.prompt_logprobs = prompt_logprobs(self.prompt_ids, logits, self.params.prompt_logprobs)
        else:
            await root.flush()
        if self.params.n > 1:
            # The head runs on the prompt's last row once, before forking: each fork would
            # otherwise run it again on the shared hidden state, and the choices would start
            # a pass apart instead of sharing every decode pass from the first.
            await root._ensure_logits()
        self.prompt_tokens = len(root)
        self.cached_tokens = root.cached_rows
        choices = [root] + [root.fork() for _ in range(self.params.n - 1)]
        self._contexts.extend(choices[1:])
        if self.params.seed is not None:
            for i, ctx in enumerate(choices):
                ctx.reseed(self.params.seed + i)
        if self.max_tokens == 0:  # the prompt alone (scored with prompt_logprobs): nothing to run
            return self
        self._remaining = len(choices)
        self._tasks = [asyncio.create_task(self._run(i, ctx)) for i, ctx in enumerate(choices)]
        return self

    async def _fill_prompt(self, root: Context) -> None:
        prompt = self.prompt
        if isinstance(prompt, str):
            encode = functools.partial(self.model.tokenizer.encode, prompt, add_special_tokens=True)
            ids = await asyncio.to_thread(encode) if len(prompt) > LONG_TEXT_CHARS else encode()
        else:
            ids = prompt or []
        if not ids:
            raise InvalidRequestError("the prompt is empty: give some text or token ids", param="prompt")
        root.fill_tokens(ids)
        self.prompt_ids = list(ids)

    async def _prepare_turns(self) -> list[list[Any]]:
        """Every media part of every turn prepared at once, each on a worker thread: Pillow
        and torch release the GIL, so a request with several images uses several cores.
        On a failure the first error (in request order) is raised once the rest are done."""
        jobs = [
            asyncio.to_thread(self.model.prepare, p)
            for t in self.turns
            for p in t.parts
            if not isinstance(p, str)
        ]
        results = iter(await asyncio.gather(*jobs, return_exceptions=True))
        out: list[list[Any]] = []
        for t in self.turns:
            out.append([p if isinstance(p, str) else next(results) for p in t.parts])
        for parts in out:
            for p in parts:
                if isinstance(p, BaseException):
                    raise p
        return out

    def _fit(self, prompt: int) -> None:
        """Refuse a prompt that, with the tokens asked for, does not fit the context length."""
        limit = self.model.max_model_len
        if limit is None:
            return
        room = limit - prompt
        if self.params.max_tokens_is_default and room >= 1:
            self.max_tokens = min(self.params.max_tokens, room)
        if prompt + self.max_tokens > limit:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {limit} tokens; the messages make "
                f"{prompt} and {self.max_tokens} more were asked for (max_tokens). Shorten the "
                "messages or lower max_tokens",
                param="messages",
                limit=limit,
                prompt_tokens=prompt,
                max_tokens=self.max_tokens,
            )

    def _stop(self) -> stopping.StopCondition:
        cond: stopping.StopCondition = stopping.max_tokens(self.max_tokens)
        if self.model.eos_token_ids and not self.params.ignore_eos:
            cond = cond | stopping.eos(self.model.eos_token_ids)
        if self.params.stop:
            cond = cond | stopping.stop_strings(*self.params.stop)
        return cond

    async def _run(self, index: int, ctx: Context) -> None:
        try:
            spec = self.params.speculative
            async for ev in ctx.stream(
                self.params.sampler,
                self._stop(),
                logprobs=self.params.logprobs,
                grammar=self.params.grammar,
                drafter=spec.make() if spec is not None else None,
                penalties=self.params.penalties,
            ):
                self.completion_tokens[index] += 1
                self._queue.put_nowait(
                    ChoiceEvent(
                        index=index,
                        token=ev.token,
                        text=ev.text,
                        finish_reason=_FINISH[ev.done.kind] if ev.done is not None else None,
                        logprob=ev.logprob,
                        top_logprobs=ev.top_logprobs,
                    )
                )
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, re-raised there
            self._queue.put_nowait(e)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self._queue.put_nowait(None)

    @property
    def finished(self) -> bool:
        """Every choice has ended (its last event has been handed out, or it failed)."""
        return self._started and self._remaining == 0

    def _take(self, item: ChoiceEvent | BaseException | None) -> ChoiceEvent | None:
        """The event in a queue item; an ended choice counts down, a failure is raised."""
        if item is None:
            self._remaining -= 1
            return None
        if isinstance(item, BaseException):
            if isinstance(item, asyncio.CancelledError):
                return None
            raise item
        return item

    async def __aiter__(self) -> AsyncIterator[ChoiceEvent]:
        async for group in self.batches():
            for ev in group:
                yield ev

    async def batches(self) -> AsyncIterator[list[ChoiceEvent]]:
        """The events in groups: each group is every event produced by the time the consumer
        asked (at least one), in order. A server writes a group at once: the ``n`` choices'
        tokens of one pass, or a drafted step's accepted tokens, leave in one write, not one
        each. ``finished`` is already true when the last group is handed out (a choice's end
        is queued right behind its last token), so the consumer can close its stream in the
        same write."""
        await self.start()
        while self._remaining:
            group: list[ChoiceEvent] = []
            failure: BaseException | None = None
            item = await self._queue.get()
            try:
                while True:
                    ev = self._take(item)
                    if ev is not None:
                        group.append(ev)
                    if not self._remaining or self._queue.empty():
                        break
                    item = self._queue.get_nowait()
            except BaseException as e:  # noqa: BLE001 - a choice failed: raised after what came before it
                failure = e
            if group:
                yield group
            if failure is not None:
                raise failure

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        for ctx in self._contexts:
            ctx.close()

    async def __aenter__(self) -> Completion:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's log-probability given the tokens before it (None for the first,
    which has no context) and the ``k`` most probable tokens there, most probable first."""

    token: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def prompt_logprobs(ids: Sequence[int], logits: torch.Tensor, k: int) -> list[PromptLogprob]:
    """Each of ``ids``' log-probabilities under the logits of the row before it (raw
    log-softmax), with the top ``k`` there; ``logits``: (len(ids), vocab)."""
    if not ids:
        return []
    lsm = torch.log_softmax(logits[:-1].float(), dim=-1)
    nxt = torch.tensor(list(ids[1:]), dtype=torch.long)
    chosen = lsm.gather(1, nxt.unsqueeze(1)).squeeze(1).tolist() if len(nxt) else []
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
    if k > 0 and len(nxt):
        vals, idx = lsm.topk(min(k, lsm.shape[1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
    first = PromptLogprob(int(ids[0]), None)
    return [first] + [
        PromptLogprob(int(t), lp, top) for t, lp, top in zip(ids[1:], chosen, tops, strict=True)
    ]


def _short(prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return repr(prompt if len(prompt) <= 40 else prompt[:37] + "...")
    return f"<{len(prompt)} token ids>"


@dataclass
class ChoiceResult:
    index: int
    text: str
    tokens: list[int]
    finish_reason: str | None
    logprobs: list[ChoiceEvent]


async def complete(
    model: Model, turns: Sequence[Turn], params: CompletionParams
) -> tuple[list[ChoiceResult], int]:
    """Run a completion to the end: (choices in index order, prompt token count)."""
    async with Completion(model, turns, params) as c:
        results = [ChoiceResult(i, "", [], None, []) for i in range(params.n)]
        async for ev in c:
            r = results[ev.index]
            r.text += ev.text
            r.tokens.append(ev.token)
            r.finish_reason = ev.finish_reason or r.finish_reason
            if params.logprobs is not None:
                r.logprobs.append(ev)
        return results, c.prompt_tokens
