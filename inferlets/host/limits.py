"""Per-run budgets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunLimits:
    """What one run may use. Every budget ends the run (or the host call) with a typed
    error: guest linear memory (``memory_bytes``, a trap), fuel (CPU, a trap), wall clock
    (``wall_s``: epoch interruption in the guest, a deadline on every blocking host call),
    live handles (contexts + media + speech streams), the size of any text or buffer the
    guest passes in, the size of its ``/scratch`` files, and how many names one run may
    save."""

    memory_bytes: int = 256 << 20
    fuel: int = 2_000_000_000
    wall_s: float = 60.0
    max_handles: int = 64
    max_text_bytes: int = 1 << 20
    max_buffer_bytes: int = 64 << 20
    max_scratch_bytes: int | None = None
    """Bytes the run's ``/scratch`` sandbox may hold in all (file contents, by size; None:
    4 x ``max_buffer_bytes``). A write past it fails with WASI's ``insufficient-space``."""
    max_tokens: int = 4096
    """Most tokens one generate call may ask for."""
    max_speech_s: float = 30.0
    """Longest clip one speak call may ask for (speech runs uninterrupted on the run's
    thread, so its length is bounded up front)."""
    max_saves: int = 16
    """Names one run may save (saved contexts outlive the run and keep their pages)."""
    max_children: int = 16
    """Child inferlets one run may launch (Pie's ``runtime.launch``): a launch loop ends at
    this cap with a typed error; children count against the parent's tenant."""
    token_budget: int | None = None
    """Tokens the whole run may generate (None: no budget; Pie's ``token_budget``). A
    generation is cut to what is left (its finish reason then "length"); a generation,
    decode step or draft verification asked for once it is spent ends the run with
    ``inferlet_limit``. Counted: each generated token, each context of a decode step, each
    accepted draft token."""
