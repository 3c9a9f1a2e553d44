"""How torch's OpenMP workers wait between parallel regions: set before torch loads.

torch's CPU kernels run on GNU OpenMP (libgomp) thread teams. Between two parallel
regions a team's workers wait: they spin a while, then sleep on a futex, and waking a
sleeping worker costs tens of microseconds. Every thread that ran a parallel op keeps a
team (the loader, the forward worker, encoder and Mimi threads), so a serving process
holds more OpenMP threads than CPUs, and libgomp then spins only 100 times (its
"throttled" count; libgomp's env.c) unless ``OMP_WAIT_POLICY=ACTIVE`` raises it to 1000.
A decode step of a quantized model runs ~200 small parallel matmuls, so with the default
nearly every one waits for a wake-up: measured on this 2-core machine (int4, 2B shape,
a short text context) 15.0 tok/s with libgomp's defaults, 15.5 with one thread, 19.1
with the settings below; float32 decode (fewer, larger regions) is unchanged (2.8 tok/s
both ways, alternating runs).

``OMP_WAIT_POLICY=ACTIVE`` alone would spin for minutes when the process is *not*
oversubscribed (a 16-core GPU host), so ``GOMP_SPINCOUNT=100000`` bounds the spin to
about a millisecond there; oversubscribed, libgomp takes the smaller of it and 1000.
Either way an idle server sleeps (measured: 0.1 ms of CPU over 3 idle seconds).

libgomp reads its environment once, when torch loads it, so this module sets both when
it is imported, unless the environment names either (then the user's choice stands
whole: a lone ``OMP_WAIT_POLICY=PASSIVE`` must not get a spin count), and
``engine/__init__`` imports it before anything that imports torch. A program that
imports torch before engine keeps libgomp's defaults; ``applied_before_torch`` says so.
"""

from __future__ import annotations

import os
import sys

OPENMP_DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "100000"}

applied_before_torch: bool = "torch" not in sys.modules
"""Whether torch (and so libgomp) was not loaded yet when these defaults were set."""

if not any(name in os.environ for name in OPENMP_DEFAULTS):
    os.environ.update(OPENMP_DEFAULTS)


def openmp_settings() -> dict[str, str | bool]:
    """The wait settings this process runs with, and whether they reached libgomp."""
    return {
        **{name: os.environ.get(name, "") for name in OPENMP_DEFAULTS},
        "applied_before_torch": applied_before_torch,
    }
