"""Encoder-output cache: a repeated image skips preparation and the tower.

Keyed by ``Prepared.cache_key`` (model fingerprint, content hash, preparation
parameters), bounded by a byte budget with least-recently-used eviction.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from encoders.prepared import Encoded, Prepared


def prepared_nbytes(prepared: Prepared) -> int:
    """Bytes held by a Prepared's tensors (model inputs and positions)."""
    n = prepared.positions.numel() * prepared.positions.element_size()
    for t in prepared.inputs.values():
        n += t.numel() * t.element_size()
    return n


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0
    prepared_bytes: int = 0
    """Bytes of prepared model inputs held (their own budget, ``prepared_byte_budget``)."""
    prepared_entries: int = 0


class EncoderCache:
    def __init__(self, byte_budget: int = 512 * 1024 * 1024, prepared_byte_budget: int = 1024 * 1024 * 1024):
        if byte_budget < 0 or prepared_byte_budget < 0:
            raise ValueError(f"byte budgets must be >= 0, got {byte_budget}, {prepared_byte_budget}")
        self.byte_budget = byte_budget
        self.prepared_byte_budget = prepared_byte_budget
        self._prepared_bytes = 0
        self._encoded: OrderedDict[str, Encoded] = OrderedDict()
        self._prepared: OrderedDict[str, Prepared] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()

    # A Prepared holds its model inputs (a 12 MP photo makes ~290 MB of float32 patches), so
    # prepared entries get their own byte budget and LRU order, apart from embeddings.
    def get_prepared(self, key: str) -> Prepared | None:
        with self._lock:
            p = self._prepared.get(key)
            if p is not None:
                self._prepared.move_to_end(key)
            return p

    def put_prepared(self, key: str, prepared: Prepared) -> None:
        size = prepared_nbytes(prepared)
        with self._lock:
            if size > self.prepared_byte_budget:
                return
            old = self._prepared.pop(key, None)
            if old is not None:
                self._prepared_bytes -= prepared_nbytes(old)
            self._prepared[key] = prepared
            self._prepared_bytes += size
            while self._prepared_bytes > self.prepared_byte_budget:
                _, evicted = self._prepared.popitem(last=False)
                self._prepared_bytes -= prepared_nbytes(evicted)
            self.stats.prepared_bytes = self._prepared_bytes
            self.stats.prepared_entries = len(self._prepared)

    def get(self, key: str) -> Encoded | None:
        with self._lock:
            enc = self._encoded.get(key)
            if enc is None:
                self.stats.misses += 1
                return None
            self._encoded.move_to_end(key)
            self.stats.hits += 1
            return enc

    def put(self, key: str, encoded: Encoded) -> None:
        size = encoded.nbytes()
        with self._lock:
            if size > self.byte_budget:
                return  # larger than the whole budget: never cached
            old = self._encoded.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes()
            self._encoded[key] = encoded
            self._bytes += size
            while self._bytes > self.byte_budget:
                _, evicted = self._encoded.popitem(last=False)
                self._bytes -= evicted.nbytes()
                self.stats.evictions += 1
            self.stats.bytes = self._bytes
            self.stats.entries = len(self._encoded)

    def clear(self) -> None:
        with self._lock:
            self._encoded.clear()
            self._prepared.clear()
            self._bytes = 0
            self._prepared_bytes = 0
            self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._encoded)
