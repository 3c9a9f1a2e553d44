"""``pie:core/adapter``: named LoRA adapters of a model, per tenant (engine/adapter_store.py):
create / open / fork / destroy, and load / save from files in the run's sandbox."""

from __future__ import annotations

from typing import Any

from inferlets.host.binding import Interface, Resource
from inferlets.host.pie_core.model import ModelRes


class AdapterRes(Resource):
    WIT = ("pie:core/adapter", "adapter")

    def __init__(self, model: ModelRes, handle: Any):
        self.model_res = model
        self.handle = handle


class AdapterIface(Interface):
    NAME = "pie:core/adapter"
    RESOURCES = (AdapterRes,)
