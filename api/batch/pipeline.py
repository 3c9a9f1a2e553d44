"""Reading, decoding and preparation ahead of the engine.

With ``workers >= 1`` each worker is a process (spawned: no copy of the parent's torch
threads) holding a weightless encoder; it takes a shard at a time, reads it sample by
sample and puts each prepared ``WorkItem`` (pickled) on one bounded queue, then a
``ShardEnd``. The queue's bound (``depth`` items) is what keeps memory flat: a worker
that is ahead waits. With ``workers == 0`` one thread does the same in this process
with the model's own ``prepare`` (tests, tiny jobs).

``items()`` yields the work as it comes (shards interleave when there are several
workers)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from api.batch.ledger import DoneIndex
from api.batch.preparation import Preparer
from api.batch.samples import ShardEnd, WorkItem
from api.batch.sources import Shard
from api.batch.spec import CaptionSpec

_STOP = b"stop"


def default_workers() -> int:
    """Preparation processes for a job that does not say: one per core beyond the two the
    engine's forward thread and the job's own loop keep busy (at most 4), none on a
    machine with two cores or fewer. There a worker process has no core of its own and
    only adds the hand-over (pickling, shared-memory copies): measured on 2 shared cores,
    one worker made the job ~0.5x as fast as preparing in a thread, with the engine
    starved ~20% of the time (``bench/dataset_captions.py``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(0, min(4, cores - 2))


def _done_lookup(index: DoneIndex, shard: str, spec: CaptionSpec) -> Callable[[str, str | None], int | None]:
    """Skippable before the engine: every prompt recorded (segment jobs are filtered
    record by record later: their segment count is known only once prepared)."""

    def lookup(key: str, h: str | None) -> int | None:
        if spec.segments or spec.scene_cuts:
            return None
        got = index.lookup(shard, key, h)
        if got is None:
            return None
        ids, errors = got
        if spec.prompt_field is None and not all((p, None) in ids for p in spec.prompts):
            return None
        return errors

    return lookup


def _read_shard(
    prep: Preparer, shard: Shard, index: DoneIndex, spec: CaptionSpec, put: Callable[[Any], None]
) -> None:
    lookup = _done_lookup(index, shard.id, spec)
    n = 0
    for sample in shard.samples():
        put(prep(sample, lookup))
        n += 1
    put(ShardEnd(shard.id, n))


def _worker(model_dir: str, spec: CaptionSpec, tasks: Any, results: Any, done: Any, parent: int) -> None:
    """A preparation process. It leaves as soon as its parent is gone (a killed job must
    not leave workers behind): every wait on a queue is short and checks the parent.

    Prepared tensors travel through shared memory, as torch's DataLoader workers send
    them (``torch.multiprocessing``'s reductions: the pipe carries a file descriptor, not
    the float32 pixels, ~3 MB for a 640 px image on Qwen3-VL, which the pipe and torch's
    pickling made the job's bottleneck). A descriptor is handed over by this process, so
    it stays until the parent says it has read everything (``done``)."""
    import os
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # noqa: F401 - registers the shared-memory tensor reductions

    torch.set_num_threads(1)

    def orphaned() -> bool:
        return os.getppid() != parent

    def watchdog() -> None:  # also covers the exit's wait for the queue's feeder thread
        while not orphaned():
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watchdog, name="orphan-watchdog", daemon=True).start()

    def put(x: Any) -> None:
        data = x if isinstance(x, bytes) else bytes(ForkingPickler.dumps(x, protocol=5))
        while True:
            try:
                results.put(data, timeout=0.5)
                return
            except queue.Full:
                if orphaned():
                    os._exit(0)

    prep = Preparer.for_model_dir(model_dir, spec)
    while True:
        try:
            task = tasks.get(timeout=0.5)
        except queue.Empty:
            if orphaned():
                os._exit(0)
            continue
        if task is None:
            break
        shard, index = task
        try:
            _read_shard(prep, shard, index, spec, put)
        except BaseException as e:  # noqa: BLE001 - a reader bug must not hang the job
            put(("failed", shard.id, repr(e)))
    put(_STOP)
    while not done.wait(0.5):
        if orphaned():
            os._exit(0)


class Pipeline:
    def __init__(
        self,
        shards: list[Shard],
        index: DoneIndex,
        spec: CaptionSpec,
        *,
        workers: int,
        depth: int,
        model_dir: str | None = None,
        inline_prepare: Preparer | None = None,
    ):
        self.shards, self.index, self.spec = shards, index, spec
        self.workers, self.depth = workers, max(1, depth)
        self.model_dir, self.inline_prepare = model_dir, inline_prepare
        self.waited_s = 0.0
        """Time the consumer spent waiting on an empty queue."""

    async def items(self) -> AsyncIterator[WorkItem | ShardEnd]:
        if not self.shards:
            return
        if self.workers == 0:
            async for x in self._inline():
                yield x
        else:
            async for x in self._processes():
                yield x

    async def _inline(self) -> AsyncIterator[WorkItem | ShardEnd]:
        assert self.inline_prepare is not None
        q: queue.Queue[Any] = queue.Queue(self.depth)
        stop = threading.Event()

        def put(x: Any) -> None:
            while not stop.is_set():
                try:
                    q.put(x, timeout=0.2)
                    return
                except queue.Full:
                    continue
            raise SystemExit

        def run() -> None:
            try:
                for shard in self.shards:
                    _read_shard(self.inline_prepare, shard, self.index.for_shard(shard.id), self.spec, put)
            except SystemExit:
                return
            except BaseException as e:  # noqa: BLE001
                with contextlib.suppress(SystemExit):
                    put(("failed", "", repr(e)))
            with contextlib.suppress(SystemExit):
                put(_STOP)

        t = threading.Thread(target=run, name="batch-prepare", daemon=True)
        t.start()
        try:
            while True:
                x = await self._get(q.get_nowait, q.get)
                if x is _STOP:
                    return
                if isinstance(x, tuple):
                    raise RuntimeError(f"reading shard {x[1]} failed: {x[2]}")
                yield x
        finally:
            stop.set()
            t.join(timeout=10)

    async def _get(
        self, nowait: Callable[[], Any], blocking: Callable[..., Any], alive: Callable[[], None] | None = None
    ) -> Any:
        """The next item; the time spent waiting for it counts in ``waited_s``. ``alive``
        (process mode) raises when a worker died: the wait is in short steps that call it,
        so a worker killed mid-shard fails the job (a rerun resumes) instead of hanging it."""
        try:
            return nowait()
        except queue.Empty:
            pass
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            if alive is None:
                return await asyncio.to_thread(blocking)
            while True:
                try:
                    return await asyncio.to_thread(blocking, True, 0.5)
                except queue.Empty:
                    alive()
        finally:
            self.waited_s += loop.time() - t0

    async def _processes(self) -> AsyncIterator[WorkItem | ShardEnd]:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        tasks = ctx.Queue()
        results = ctx.Queue(self.depth)
        done = ctx.Event()
        n = min(self.workers, len(self.shards))
        for shard in self.shards:
            tasks.put((shard, self.index.for_shard(shard.id)))
        for _ in range(n):
            tasks.put(None)
        procs = [
            ctx.Process(
                target=_worker,
                args=(self.model_dir, self.spec, tasks, results, done, os.getpid()),
                daemon=True,
            )
            for _ in range(n)
        ]
        for p in procs:
            p.start()
        stopped = 0

        quiet_after_exit = 0

        def alive() -> None:
            """Raises when a worker died. A worker that exits 0 has sent its stop (the pipe
            is flushed before it exits): every worker gone and the queue still empty a
            second time means a stop was lost."""
            nonlocal quiet_after_exit
            codes = [p.exitcode for p in procs]
            if any(code not in (None, 0) for code in codes):
                raise RuntimeError(
                    f"a preparation worker died (exit codes {codes}); the shards it was reading "
                    "are left unfinished: run the job again to resume"
                )
            if all(code == 0 for code in codes):
                quiet_after_exit += 1
                if quiet_after_exit > 1:
                    raise RuntimeError("the preparation workers ended without finishing their shards")

        try:
            while stopped < n:
                raw = await self._get(results.get_nowait, results.get, alive)
                if raw == _STOP:
                    stopped += 1
                    continue
                x = pickle.loads(raw)
                if isinstance(x, tuple):
                    raise RuntimeError(f"reading shard {x[1]} failed: {x[2]}")
                yield x
        finally:
            done.set()
            for p in procs:
                p.join(timeout=2)
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
            results.cancel_join_thread()
            tasks.cancel_join_thread()
