"""``pie:core/context``: an engine ``Context`` as Pie's resource: create / open / take /
delete / fork / save / snapshot / destroy over the model's saved contexts (names live
under the run's namespace, its caller's tenant), and the working-page calls of
``engine.working_pages``. Every call runs on the server's event loop.

``suspend``: pie-media does not preempt contexts, so it refuses with an error that says
so. ``bid``: the value is kept (``scheduling.rent`` reports it); pie-media schedules
first come first served, so a bid never reorders passes."""

from __future__ import annotations

import uuid
from typing import Any

from inferlets.host.binding import Interface, Resource, wit
from inferlets.host.errors import InferletLimitError
from inferlets.host.pie_core.model import ModelRes
from media import InvalidRequestError


class ContextRes(Resource):
    WIT = ("pie:core/context", "context")

    def __init__(self, host: Any, model: ModelRes, ctx: Any):
        self.host = host
        self.model_res = model
        self.ctx = ctx
        self.bid = 0.0
        self.running: Any = None
        """The future of this context's last forward pass (``inference.execute``)."""

    def quiet(self) -> bool:
        """No forward pass of this context is running or waiting for the loop, so its
        state holds still for a check made off the loop."""
        running = self.running
        return (running is None or running.done()) and not self.ctx.busy

    def close(self) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx is not None and not ctx.closed:
            self.host.state.close_context(ctx)

    def live(self) -> Any:
        if self.ctx is None or self.ctx.closed:
            raise InvalidRequestError("this context was destroyed; create or fork a new one")
        return self.ctx

    def __repr__(self) -> str:
        return f"ContextRes({self.ctx!r})"


class ContextIface(Interface):
    NAME = "pie:core/context"
    RESOURCES = (ContextRes,)

    def saved_name(self, name: str) -> str:
        """A saved context's name in the engine: under the run's namespace (its caller's
        tenant), so runs of different tenants never meet each other's saved contexts."""
        text = self.host.state.text(name, "a name")
        if not text:
            raise InvalidRequestError("a saved context needs a non-empty name")
        ns = self.host.namespace
        return f"{ns}/{text}" if ns else text

    def _wrap(self, m: ModelRes, ctx: Any) -> ContextRes:
        return ContextRes(self.host, m, ctx)

    @wit("[static]context.create")
    def create(self, m: ModelRes) -> ContextRes:
        from engine import Context

        model = self.host.text_model(m)
        return self._wrap(m, self.host.on_loop(Context, model))

    @wit("[static]context.open")
    def open(self, m: ModelRes, name: str) -> ContextRes:
        from engine import Context

        model = self.host.text_model(m)
        return self._wrap(m, self.host.on_loop(Context.open, model, self.saved_name(name)))

    @wit("[static]context.take")
    def take(self, m: ModelRes, name: str) -> ContextRes:
        from engine import Context

        model = self.host.text_model(m)
        saved = self.saved_name(name)

        def take() -> Any:
            ctx = Context.open(model, saved)
            model.delete_saved(saved)
            return ctx

        return self._wrap(m, self.host.on_loop(take))

    @wit("[static]context.delete")
    def delete(self, m: ModelRes, name: str) -> None:
        model = self.host.text_model(m)
        self.host.on_loop(model.delete_saved, self.saved_name(name))

    @wit("[method]context.fork")
    def fork(self, c: ContextRes) -> ContextRes:
        return self._wrap(c.model_res, self.host.on_loop(c.live().fork))

    def save_as(self, c: ContextRes, saved: str, *, overwrite: bool = False) -> None:
        """Save ``c`` as the engine name ``saved`` (``saved_name``), within the run's cap."""
        st = self.host.state
        if st.saves >= st.limits.max_saves:
            raise InferletLimitError(
                f"a run may save at most {st.limits.max_saves} contexts", limit=st.limits.max_saves
            )
        ctx = c.live()
        self.host.on_loop(lambda: ctx.save(saved, overwrite=overwrite))
        st.saves += 1

    @wit("[method]context.save")
    def save(self, c: ContextRes, name: str) -> None:
        self.save_as(c, self.saved_name(name))

    @wit("[method]context.snapshot")
    def snapshot(self, c: ContextRes) -> str:
        name = f"snapshot-{uuid.uuid4().hex[:16]}"
        self.save_as(c, self.saved_name(name))
        return name

    @wit("[method]context.destroy")
    def destroy(self, c: ContextRes) -> None:
        c.close()

    @wit("[method]context.tokens-per-page")
    def tokens_per_page(self, c: ContextRes) -> int:
        return c.live().tokens_per_page

    @wit("[method]context.model")
    def model(self, c: ContextRes) -> ModelRes:
        return ModelRes(c.model_res.name, c.model_res.model)

    @wit("[method]context.committed-page-count")
    def committed_page_count(self, c: ContextRes) -> int:
        return c.live().committed_page_count

    @wit("[method]context.working-page-count")
    def working_page_count(self, c: ContextRes) -> int:
        return c.live().working_page_count

    @wit("[method]context.working-page-token-count")
    def working_page_token_count(self, c: ContextRes) -> int:
        return c.live().working_page_token_count

    @wit("[method]context.commit-working-pages")
    def commit_working_pages(self, c: ContextRes, n: int) -> None:
        self.host.on_loop(c.live().commit_working_pages, n)

    @wit("[method]context.reserve-working-pages")
    def reserve_working_pages(self, c: ContextRes, n: int) -> None:
        self.host.on_loop(c.live().reserve_working_pages, n)

    @wit("[method]context.release-working-pages")
    def release_working_pages(self, c: ContextRes, n: int) -> None:
        self.host.on_loop(c.live().release_working_pages, n)

    @wit("[method]context.truncate-working-page-tokens")
    def truncate_working_page_tokens(self, c: ContextRes, n: int) -> None:
        self.host.on_loop(c.live().truncate_working_page_tokens, n)

    @wit("[method]context.suspend")
    def suspend(self, c: ContextRes) -> None:
        raise InvalidRequestError(
            "suspend is not supported: pie-media never preempts a context; release its working "
            "pages (release-working-pages) or save and destroy it to free memory"
        )

    @wit("[method]context.bid")
    def bid(self, c: ContextRes, value: float) -> None:
        c.bid = max(0.0, float(value))
