"""``runtime`` and ``models``: arguments, send/receive, time, model facts, tokens."""

from __future__ import annotations

import queue
import time
from typing import Any

from inferlets.host.state import POLL_S, RunState
from inferlets.host.wit_values import record


class RuntimeCalls:
    # WIT name -> (method, ok is a record: needs a tagged result, returns a result at all)
    FUNCS = {
        "args": ("args", False, False),
        "send": ("send", False, True),
        "receive": ("receive", True, True),
        "now": ("now", False, False),
    }

    def __init__(self, run: RunState):
        self.run = run

    def args(self) -> list[str]:
        return list(self.run.args)

    def send(self, text: str) -> None:
        self.run.flush_output()  # a partial line printed before it goes first
        self.run.on_send(self.run.text(text, "a sent message"))

    def receive(self) -> Any:
        run = self.run
        if run.control is None:
            return record(closed=True, text="")
        while True:
            run.check()
            try:
                msg = run.control.next_message(min(POLL_S, run.deadline - time.monotonic()))
            except queue.Empty:
                continue
            return record(closed=msg is None, text=msg or "")

    def now(self) -> int:
        return time.monotonic_ns()


def model_info(name: str, model: Any) -> Any:
    from engine import Model

    text = isinstance(model, Model)
    return record(
        name=name,
        kind="text" if text else "speech",
        media_kinds=sorted(model.media_kinds),
        eos_tokens=sorted(model.eos_token_ids) if text else [],
    )


class ModelCalls:
    FUNCS = {
        "list-models": ("list_models", True, False),
        "get": ("get", True, True),
        "tokenize": ("tokenize", False, True),
        "detokenize": ("detokenize", False, True),
    }

    def __init__(self, run: RunState):
        self.run = run

    def list_models(self) -> list[Any]:
        return [model_info(n, m) for n, m in sorted(self.run.models.items())]

    def get(self, name: str) -> Any:
        return model_info(name, self.run.model(name))

    def tokenize(self, model: str, text: str) -> list[int]:
        from engine import Model

        return self.run.model(model, Model).tokenize(self.run.text(text))

    def detokenize(self, model: str, ids: list[int]) -> str:
        from engine import Model
        from media import InvalidRequestError

        m = self.run.model(model, Model)
        self.run.buffer(ids, "token ids", 4)
        vocab = m.arch.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise InvalidRequestError(f"token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}")
        return m.detokenize(ids)
