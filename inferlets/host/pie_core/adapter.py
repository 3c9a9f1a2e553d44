"""``pie:core/adapter``: named LoRA adapters of a model, per tenant (engine/adapter_store.py:
one store per process, names never cross tenants): create / open / fork / destroy, and
load / save of PEFT files in the run's sandbox (``/scratch/...`` or a relative path; a path
out of it is an error). An adapter applies to a pass with ``forward-pass.adapter``; with
``zo.adapter-seed`` the pass runs under its perturbation for that seed."""

from __future__ import annotations

import functools
from typing import Any

from inferlets.host.binding import Interface, Resource, wit
from inferlets.host.pie_core.model import ModelRes


@functools.lru_cache(maxsize=1)
def adapter_store() -> Any:
    from engine.adapter_store import AdapterStore

    return AdapterStore()


class AdapterRes(Resource):
    WIT = ("pie:core/adapter", "adapter")

    def __init__(self, model: ModelRes, handle: Any):
        self.model_res = model
        self.handle = handle  # engine.adapter_store.NamedAdapter

    def __repr__(self) -> str:
        return f"AdapterRes({self.handle!r})"


class AdapterIface(Interface):
    NAME = "pie:core/adapter"
    RESOURCES = (AdapterRes,)

    @wit("[static]adapter.create")
    def create(self, m: ModelRes, name: str) -> AdapterRes:
        model = self.host.text_model(m)
        named = adapter_store().create(
            model, self.host.state.text(name, "a name"), namespace=self.host.namespace
        )
        return AdapterRes(m, named)

    @wit("[static]adapter.open")
    def open(self, m: ModelRes, name: str) -> AdapterRes | None:
        model = self.host.text_model(m)
        named = adapter_store().open(model, name, namespace=self.host.namespace)
        return None if named is None else AdapterRes(m, named)

    @wit("[method]adapter.destroy")
    def destroy(self, a: AdapterRes) -> None:
        adapter_store().destroy(a.handle)

    @wit("[method]adapter.fork")
    def fork(self, a: AdapterRes, name: str) -> AdapterRes:
        return AdapterRes(a.model_res, adapter_store().fork(a.handle, self.host.state.text(name, "a name")))

    @wit("[method]adapter.load")
    def load(self, a: AdapterRes, path: str) -> None:
        a.handle.load(self.host.state.text(path, "a path"), sandbox=self.host.sandbox_dir)

    @wit("[method]adapter.save")
    def save(self, a: AdapterRes, path: str) -> None:
        a.handle.save(self.host.state.text(path, "a path"), sandbox=self.host.sandbox_dir)
