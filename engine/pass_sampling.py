"""Every context's next token sampled in its own forward pass, in one batched call.

A context that samples right after a pass (``Context.stream``, before each decode step and
the prompt's last chunk) gives its step a ``SampleRequest``. When the pass has its logits,
``sample_pass`` (on the forward worker) applies each request's penalties and logit bias to
its row, samples all the rows in one ``engine.sampling.sample_or_mark`` call (one
compiled call on the CPU, one device-to-host copy on a GPU), counts each drawn token in its
penalties (so a step submitted ahead of its token, sampled in the next pass, sees it) and
sets ``StepInput.sampled``; the context takes that token instead of sampling its row itself.

Each row draws its one uniform from its context's own generator, exactly as the context
would have, so every token is what the context alone would draw (seeded ones included),
whatever else shares the pass. Custom samplers and grammar-constrained generations never
ask (their rows go through Python per context), and a row that cannot be sampled (no
finite logits) is left to its context, which raises its usual error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.sampling import Sampler, sample_or_mark

if TYPE_CHECKING:
    from engine.penalties import PenaltyState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleRequest:
    """What the runner needs to sample a step's last row as its context would."""

    sampler: Sampler
    generator: torch.Generator | None
    adjust: PenaltyState | None = None
    """The generation's penalties and logit bias (applied to a copy of the row)."""


class Step(Protocol):
    """What ``sample_pass`` reads and sets on ``engine.forward.StepInput`` (not imported:
    that file builds on this one)."""

    logits: str
    sample: SampleRequest | None
    sampled: int | None
    after: Any
    rng_state: tuple[torch.Tensor, torch.Tensor | None] | None


def sample_pass(steps: Sequence[Step], out: Sequence[Any]) -> None:
    """Set ``sampled`` on every step of the pass that asked (``out``: the runner's results,
    a "last" step's (V,) logits or a "last+hidden" step's (logits, hidden))."""
    asked = [i for i, s in enumerate(steps) if s.sample is not None and s.logits in ("last", "last+hidden")]
    if not asked:
        return
    rows: list[torch.Tensor] = []
    for i in asked:
        row = out[i] if steps[i].logits == "last" else out[i][0]
        request = steps[i].sample
        assert request is not None
        if steps[i].after is not None and request.generator is not None:
            steps[i].rng_state = (request.generator.get_state(), None)  # see StepInput.rng_state
        adjust = request.adjust
        rows.append(adjust.apply(row) if adjust is not None else row)
    try:
        tokens = sample_or_mark(
            _stacked(rows),
            [_request(steps[i]).sampler for i in asked],
            [_request(steps[i]).generator for i in asked],
        ).tolist()
    except Exception:  # never fail a pass for its sampling: each context samples itself then
        log.exception("batched sampling failed; the contexts sample their rows themselves")
        return
    for i, token in zip(asked, tokens, strict=True):
        steps[i].sampled = token if token >= 0 else None
        adjust = _request(steps[i]).adjust
        if adjust is not None and token >= 0:
            adjust.add(token)  # counted here, so the next pass's row sees it (see Context._pick)
        state = steps[i].rng_state
        if state is not None:
            steps[i].rng_state = (state[0], _request(steps[i]).generator.get_state())


def _request(step: Step) -> SampleRequest:
    assert step.sample is not None
    return step.sample


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """(n, V) of the rows: a view when they are consecutive rows of one tensor (a decode
    pass's logits), else a copy."""
    first = rows[0]
    vocab = first.shape[-1]
    if first.dim() == 1 and first.is_contiguous():
        step = first.element_size() * vocab
        base = first.data_ptr()
        dtype, device = first.dtype, first.device
        if all(
            r.data_ptr() == base + k * step
            and r.dtype == dtype
            and r.shape == first.shape
            and r.device == device
            for k, r in enumerate(rows)
        ):
            # Rows at consecutive addresses are consecutive rows of one tensor unless they
            # lie in separate allocations; then the view would reach past ``first``'s
            # storage, which as_strided refuses: stack them.
            try:
                return first.as_strided((len(rows), vocab), (vocab, 1))
            except RuntimeError:
                pass
    return torch.stack(rows)
