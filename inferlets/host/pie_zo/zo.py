"""``pie:zo/zo``: evolution strategies over an adapter (engine/evolution.py, Pie 0.2/0.3's
diagonal CMA-ES): ``adapter-seed`` makes a pass run under the adapter perturbed by that
seed's noise (seed 0: unperturbed), ``initialize`` sets up the search, ``update`` moves the
weights from the population's scores."""

from __future__ import annotations

from inferlets.host.binding import Interface, wit
from inferlets.host.pie_core.adapter import AdapterRes
from inferlets.host.pie_core.inference import ForwardPassRes


class Zo(Interface):
    NAME = "pie:zo/zo"

    @wit("adapter-seed")
    def adapter_seed(self, p: ForwardPassRes, seed: int) -> None:
        p.open()
        p.zo_seed = int(seed)

    @wit("initialize")
    def initialize(
        self,
        a: AdapterRes,
        rank: int,
        alpha: float,
        population_size: int,
        mu_fraction: float,
        initial_sigma: float,
    ) -> None:
        from engine import evolution

        evolution.initialize(a.handle, rank, alpha, population_size, mu_fraction, initial_sigma)

    @wit("update")
    def update(self, a: AdapterRes, scores: list[float], seeds: list[int], max_sigma: float) -> None:
        from engine import evolution

        evolution.update(a.handle, list(scores), list(seeds), max_sigma)
