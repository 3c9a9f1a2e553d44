"""freeze_startup_heap takes the loaded heap out of the garbage collector's walks, and
unfreeze_startup_heap gives it back (run in a fresh interpreter: freezing is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import gc, json, weakref
import engine
from api.model_ref import load_model
model = load_model("tiny")

class Node:
    pass

cycle = Node(); cycle.me = cycle; ref = weakref.ref(cycle)   # cyclic, alive at the freeze
tracked_before = len(gc.get_objects())
frozen = engine.freeze_startup_heap()
tracked_after = len(gc.get_objects())
text = engine.SyncContext(model).user("Hello").cue().generate(max_tokens=3).text   # on a frozen heap
del cycle; gc.collect()
kept_while_frozen = ref() is not None
engine.unfreeze_startup_heap(); gc.collect()
print(json.dumps(dict(tracked_before=tracked_before, frozen=frozen, tracked_after=tracked_after,
    text=text, kept_while_frozen=kept_while_frozen, freed_after_unfreeze=ref() is None,
    frozen_after=engine.frozen_objects())))
"""


def test_freeze_and_unfreeze_the_startup_heap():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tracked_before"] > 100_000  # torch + transformers + the model
    assert got["frozen"] >= 0.9 * got["tracked_before"]
    assert got["tracked_after"] < 0.01 * got["tracked_before"]  # what a collection still walks
    assert isinstance(got["text"], str) and got["text"]
    assert got["kept_while_frozen"] is True  # frozen cyclic garbage waits...
    assert got["freed_after_unfreeze"] is True  # ...until the heap is given back
    assert got["frozen_after"] == 0


def test_frozen_startup_heap_gives_the_heap_back_on_exit():
    import gc

    from engine import frozen_startup_heap

    assert gc.get_freeze_count() == 0
    with frozen_startup_heap() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    try:
        with frozen_startup_heap():
            raise KeyError("boom")
    except KeyError:
        pass
    assert gc.get_freeze_count() == 0
