"""``runtime`` and ``models``: arguments, send/receive, time, model facts, tokens; send,
receive and the tokenizer calls are Pie's (``pie_core/session.py``, ``pie_core/model.py``)."""

from __future__ import annotations

import time
from typing import Any

from inferlets.host.pie_core.model import ModelIface, TokenizerRes
from inferlets.host.pie_core.session import Session
from inferlets.host.state import RunState
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
        Session(self.run.pie).send(text)

    def receive(self) -> Any:
        run = self.run
        if run.control is None:
            return record(closed=True, text="")
        msg = run.pie.wait_future(run.control.message_future())
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
        self._model = ModelIface(run.pie)

    def list_models(self) -> list[Any]:
        return [model_info(n, m) for n, m in sorted(self.run.models.items())]

    def get(self, name: str) -> Any:
        return model_info(name, self.run.model(name))

    def tokenize(self, model: str, text: str) -> list[int]:
        return self._model.encode(self._tokenizer(model), text)

    def detokenize(self, model: str, ids: list[int]) -> str:
        return self._model.decode(self._tokenizer(model), ids)

    def _tokenizer(self, model: str) -> TokenizerRes:
        host = self.run.pie
        m = host.model_res(model)
        host.text_model(m)
        return TokenizerRes(m)
