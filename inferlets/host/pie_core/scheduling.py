"""``pie:core/scheduling``: Pie's market, as pie-media runs it. pie-media schedules first
come first served with no prices, so the market values are all zero and consistent with
each other: ``price`` 0, ``rent`` (pages x price) 0, ``dividend`` 0, ``balance`` 0 (Pie's
SDK then bids 0, the truthful bid for a free resource). ``latency`` is real: the engine's
measured time between tokens (mean, seconds), 0 before any was measured."""

from __future__ import annotations

from inferlets.host.binding import Interface, wit
from inferlets.host.pie_core.context import ContextRes
from inferlets.host.pie_core.model import ModelRes


class Scheduling(Interface):
    NAME = "pie:core/scheduling"

    @wit("price")
    def price(self) -> float:
        return 0.0

    @wit("rent")
    def rent(self, c: ContextRes) -> float:
        return 0.0

    @wit("dividend")
    def dividend(self, m: ModelRes) -> float:
        return 0.0

    @wit("balance")
    def balance(self, m: ModelRes) -> float:
        return 0.0

    @wit("latency")
    def latency(self, c: ContextRes) -> float:
        itl = c.model_res.model.counters.itl
        return float(itl.total / itl.n) if itl.n else 0.0
