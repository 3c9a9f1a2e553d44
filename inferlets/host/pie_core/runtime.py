"""``pie:core/runtime``: version, instance id, the caller's key name, the served models,
and child inferlets: ``launch("name@version", input)`` runs a program installed for the
run's tenant (through ``InferletRuntime.launch_child``, which the server wires to its
program store) under the parent's limits and namespace; children per run are capped."""

from __future__ import annotations

from typing import Any

from inferlets.host.binding import Err, Interface, Ok, wit
from inferlets.host.errors import InferletLimitError
from inferlets.host.pie_core.types import HostFuture
from inferlets.host.wasi.poll import Pollable

VERSION = "0.4.0"


class Child(HostFuture):
    WIT = ("pie:core/runtime", "child")

    def __init__(self, fut: Any, host: Any, pid: str, cancel: Any):
        super().__init__(fut, host)
        self.pid = pid
        self._cancel = cancel

    def outcome(self) -> Any:
        if not self.fut.done():
            return None
        if self.fut.cancelled():
            return Err("cancelled")
        e = self.fut.exception()
        if e is not None:
            return Err(f"{getattr(e, 'code', type(e).__name__)}: {getattr(e, 'message', None) or e}")
        return Ok(str(self.fut.result()))

    def close(self) -> None:
        pass  # dropping the handle detaches: the child runs on


class Runtime(Interface):
    NAME = "pie:core/runtime"
    RESOURCES = (Child,)

    @wit("version")
    def version(self) -> str:
        return VERSION

    @wit("instance-id")
    def instance_id(self) -> str:
        return self.host.instance_id

    @wit("username")
    def username(self) -> str:
        control = self.host.state.control
        return getattr(control, "username", "") or ""

    @wit("models")
    def models(self) -> list[str]:
        """Text models first, then the others (speech), each sorted: Pie's examples take
        ``models()[0]`` as the model to chat with."""
        from engine import Model

        models = self.host.state.models
        return sorted(models, key=lambda n: (not isinstance(models[n], Model), n))

    @wit("launch")
    def launch(self, program: str, input: str) -> Child:
        host = self.host
        st = host.state
        if host.children >= st.limits.max_children:
            raise InferletLimitError(
                f"a run may launch at most {st.limits.max_children} children", limit=st.limits.max_children
            )
        launcher = host.launch_child
        if launcher is None:
            raise RuntimeError("launching children needs a server's program store (pie-media serve)")
        host.children += 1
        pid, fut, cancel = launcher(
            st.text(program, "a program name"), st.text(input, "the child's input"), st
        )
        return Child(fut, host, pid, cancel)

    @wit("[method]child.pollable")
    def child_pollable(self, c: Child) -> Pollable:
        return c.pollable()

    @wit("[method]child.get")
    def child_get(self, c: Child) -> Any:
        return c.outcome()

    @wit("[method]child.pid")
    def child_pid(self, c: Child) -> str:
        return c.pid

    @wit("[method]child.cancel")
    def child_cancel(self, c: Child) -> None:
        c._cancel()
