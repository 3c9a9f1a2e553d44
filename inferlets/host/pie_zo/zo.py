"""``pie:zo/zo``: evolution strategies over an adapter (engine/evolution.py): per-pass
seeds (the pass runs under the adapter perturbed by that seed's noise), initialize,
update from scores."""

from __future__ import annotations

from inferlets.host.binding import Interface


class Zo(Interface):
    NAME = "pie:zo/zo"
