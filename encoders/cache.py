"""Encoder-output cache: a repeated image skips preparation and the tower.

Keyed by ``Prepared.cache_key`` (model fingerprint, content hash, preparation
parameters), bounded by a byte budget with least-recently-used eviction.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from encoders.prepared import Encoded, Prepared


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


class EncoderCache:
    def __init__(self, byte_budget: int = 512 * 1024 * 1024):
        if byte_budget < 0:
            raise ValueError(f"byte_budget must be >= 0, got {byte_budget}")
        self.byte_budget = byte_budget
        self._encoded: OrderedDict[str, Encoded] = OrderedDict()
        self._prepared: OrderedDict[str, Prepared] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()

    # Prepared objects are small next to embeddings (pixel tensors aside); they are kept
    # under the key of the media + parameters that made them so a hit skips prepare().
    def get_prepared(self, key: str) -> Prepared | None:
        with self._lock:
            p = self._prepared.get(key)
            if p is not None:
                self._prepared.move_to_end(key)
            return p

    def put_prepared(self, key: str, prepared: Prepared, max_entries: int = 4096) -> None:
        with self._lock:
            self._prepared[key] = prepared
            self._prepared.move_to_end(key)
            while len(self._prepared) > max_entries:
                self._prepared.popitem(last=False)

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
            self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._encoded)
