"""wasmtime-py's process-wide slabs stay consistent under concurrent links and frees
(inferlets/host/wasmtime_slab.py): every live index is unique and holds its own value."""

from __future__ import annotations

import random
import threading

from inferlets.host.wasmtime_slab import install


def test_slabs_hold_under_threads() -> None:
    install()
    from wasmtime._slab import Slab

    slab: Slab[object] = Slab()
    errors: list[BaseException] = []
    live: dict[int, object] = {}
    guard = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[tuple[int, object]] = []
        try:
            for _ in range(4000):
                if mine and rng.random() < 0.45:
                    idx, val = mine.pop(rng.randrange(len(mine)))
                    assert slab.get(idx) is val
                    with guard:
                        del live[idx]
                    slab.deallocate(idx)
                else:
                    val = object()
                    idx = slab.allocate(val)
                    with guard:
                        assert idx not in live, f"index {idx} handed out twice"
                        live[idx] = val
                    mine.append((idx, val))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:3]
    for idx, val in live.items():
        assert slab.get(idx) is val
