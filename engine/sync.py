"""Blocking wrappers for code without an event loop (scripts, the CLI, notebooks' sync cells).

``SyncContext`` has the methods of ``Context`` with the forward-pass ones blocking. Each
call runs the coroutine on a private event loop of the calling thread; calling from
inside a running event loop is refused (await the ``Context`` methods there instead).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import torch

from engine import sampling, stopping
from engine.context import Context, Distribution, Generation, TokenEvent
from engine.drafting import Drafter
from engine.grammar import Grammar
from engine.model import Model
from engine.penalties import Penalties

T = TypeVar("T")
_local = threading.local()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on this thread's private loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        coro.close()
        raise RuntimeError("a blocking engine call was made inside a running event loop; await the async API")
    loop = getattr(_local, "loop", None)
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
        _local.loop = loop
    return loop.run_until_complete(coro)


class SyncContext:
    """A ``Context`` whose forward-pass methods block."""

    def __init__(self, model: Model | Context, *, seed: int | None = None):
        self.ctx = model if isinstance(model, Context) else Context(model, seed=seed)

    @classmethod
    def open(cls, model: Model, name: str) -> SyncContext:
        return cls(Context.open(model, name))

    # buffering: same as Context, returning self for chaining
    def fill(self, text: str) -> SyncContext:
        self.ctx.fill(text)
        return self

    def fill_tokens(self, ids: Any) -> SyncContext:
        self.ctx.fill_tokens(ids)
        return self

    def system(self, *content: Any) -> SyncContext:
        self.ctx.system(*content)
        return self

    def user(self, *content: Any) -> SyncContext:
        self.ctx.user(*content)
        return self

    def assistant(self, *content: Any, tool_calls: Any = None) -> SyncContext:
        self.ctx.assistant(*content, tool_calls=tool_calls)
        return self

    def tool(self, *content: Any, call_id: str | None = None) -> SyncContext:
        self.ctx.tool(*content, call_id=call_id)
        return self

    def use_tools(self, tools: Any) -> SyncContext:
        self.ctx.use_tools(tools)
        return self

    def template_options(self, **options: Any) -> SyncContext:
        self.ctx.template_options(**options)
        return self

    def turns(self, turns: Any) -> SyncContext:
        self.ctx.turns(turns)
        return self

    def cue(self) -> SyncContext:
        self.ctx.cue()
        return self

    def append_image(self, image: Any, **params: Any) -> Any:
        return self.ctx.append_image(image, **params)

    def append_audio(self, audio: Any, **params: Any) -> Any:
        return self.ctx.append_audio(audio, **params)

    def append_video(self, video: Any, **params: Any) -> Any:
        return self.ctx.append_video(video, **params)

    # forward passes
    def flush(self, *, return_logits: bool = False) -> Any:
        return run_sync(self.ctx.flush(return_logits=return_logits))

    def decode_step_dist(
        self, sampler: sampling.Sampler | None = None, *, top_n: int | None = None
    ) -> Distribution:
        return run_sync(self.ctx.decode_step_dist(sampler, top_n=top_n))

    def next_token_logits(self) -> torch.Tensor:
        return run_sync(self.ctx.next_token_logits())

    def beam_search(self, width: int, max_tokens: int, **kwargs: Any) -> list[Any]:
        """Blocking ``Context.beam_search``."""
        return run_sync(self.ctx.beam_search(width, max_tokens, **kwargs))

    def generate(
        self,
        sampler: sampling.Sampler | None = None,
        stop: stopping.StopCondition | None = None,
        *,
        max_tokens: int | None = None,
        grammar: Grammar | None = None,
        drafter: Drafter | None = None,
        penalties: Penalties | None = None,
    ) -> Generation:
        return run_sync(
            self.ctx.generate(
                sampler, stop, max_tokens=max_tokens, grammar=grammar, drafter=drafter, penalties=penalties
            )
        )

    def stream(
        self,
        sampler: sampling.Sampler | None = None,
        stop: stopping.StopCondition | None = None,
        *,
        max_tokens: int | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        drafter: Drafter | None = None,
        penalties: Penalties | None = None,
    ) -> Iterator[TokenEvent]:
        agen = self.ctx.stream(
            sampler,
            stop,
            max_tokens=max_tokens,
            logprobs=logprobs,
            grammar=grammar,
            drafter=drafter,
            penalties=penalties,
        )
        try:
            while True:
                try:
                    yield run_sync(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            run_sync(agen.aclose())

    # branching, persistence
    def fork(self) -> SyncContext:
        return SyncContext(self.ctx.fork())

    def save(self, name: str, *, overwrite: bool = False) -> None:
        self.ctx.save(name, overwrite=overwrite)

    def truncate(self, n: int) -> SyncContext:
        self.ctx.truncate(n)
        return self

    def rewind(self, k: int) -> SyncContext:
        self.ctx.rewind(k)
        return self

    def close(self) -> None:
        self.ctx.close()

    def __enter__(self) -> SyncContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:  # facts: token_ids, committed, pages, ...
        return getattr(self.ctx, name)

    def __len__(self) -> int:
        return len(self.ctx)
