"""Guest SDK: reads like engine.Context, calls the host through the WIT bindings."""

from componentize_py_types import Err
from wit_world.imports import host


class InferletError(Exception):
    """A host call failed; ``code`` is the stable PieMediaError code."""

    def __init__(self, text: str):
        self.code, _, self.message = text.partition(": ")
        super().__init__(text)


def _call(fn, *a):
    try:
        return fn(*a)
    except Err as e:
        raise InferletError(e.value) from None


def args() -> list[str]:
    return host.args()


def send(msg: str) -> None:
    host.send(msg)


class Context:
    """A context on the host's model; ``handle`` is this run's table index."""

    def __init__(self, model: str, _handle: int | None = None):
        self.model = model
        self.handle = _call(host.create_context, model) if _handle is None else _handle

    def fill(self, text: str) -> "Context":
        _call(host.fill, self.handle, text)
        return self

    def user(self, text: str) -> "Context":
        _call(host.user, self.handle, text)
        return self

    def cue(self) -> "Context":
        _call(host.cue, self.handle)
        return self

    def generate(self, max_tokens: int = 64) -> str:
        return _call(host.generate, self.handle, max_tokens)

    def fork(self) -> "Context":
        return Context(self.model, _call(host.fork, self.handle))

    def drop(self) -> None:
        _call(host.drop_context, self.handle)

    def __repr__(self) -> str:
        return f"Context(model={self.model!r}, handle={self.handle})"
