"""Which keyword a transformers module's ``forward`` takes its KV cache under.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns on every
call and goes away in 5.40); the versions this package allows before 5.24 know only the
old name. The CSM depth decoder is called with a cache once per codebook per frame, so the
name is looked up once, from the signature, not tried call by call.
"""

from __future__ import annotations

import inspect

import torch


def cache_keyword(module: torch.nn.Module) -> str:
    """``"cache"`` if ``module.forward`` takes it, else ``"past_key_values"``."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
