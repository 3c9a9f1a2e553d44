"""Inferlet runs launched over HTTP: each is an asyncio task around
``InferletRuntime.run_async`` with an ``InferletRun`` control (messages in, cancel), its
``send`` output collected and pushed to whoever streams it, and its end recorded.

Finished runs are kept (the newest ``keep`` of them) so a client can poll for the result
of a background run; what a run sends is capped (``max_send_bytes``): past it the run is
cancelled with ``inferlet_limit``, nothing the server holds grows without bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from api.http.errors import ServiceError, retry_after_estimate
from inferlets import InferletRun, InferletRuntime, RunLimits
from inferlets.host.errors import InferletLimitError
from media import cache_scope
from media.errors import PieMediaError

log = logging.getLogger("pie_media.http")

Status = Literal["running", "succeeded", "failed", "cancelled"]
END = object()
"""Put on a run's event queue after its last event."""
Listener = Callable[[str, "str | bytes | None"], None]
"""Called on the loop with each event of a run: ("send", text), ("stdout" / "stderr", text)
when the run captures its output, ("file", data) for each file the guest sends (Pie's
``session.send-file``), then ("end", None)."""


@dataclass
class RunRecord:
    id: str
    inferlet_id: str
    args: list[str]
    tenant: str = ""
    """Whose run it is (the key that launched it): only that tenant and admins see it."""
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: Status = "running"
    result: str | None = None
    error: dict[str, Any] | None = None
    sends: list[str] = field(default_factory=list)
    send_bytes: int = 0
    """What it sent, wrote (captured) and sent as files, against the table's ``max_send_bytes``."""
    files: int = 0
    """Files the guest sent (handed to the listeners only, not kept)."""
    finished_at: int | None = None
    control: InferletRun = field(default_factory=InferletRun, repr=False)
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue, repr=False)
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    origin: str = "http"
    """Who launched it: "http" (``/v1/inferlets``) or "pie" (Pie's protocol, api/http/pie_protocol)."""
    listeners: list[Listener] = field(default_factory=list, repr=False)
    """Beside ``events`` (which one HTTP stream consumes): every event, for each listener
    (a Pie session attached to the run). Added and removed on the loop."""

    @property
    def done(self) -> bool:
        return self.status != "running"


class RunTable:
    """The runs of one server (in memory: a run is a live task; it does not outlive it)."""

    def __init__(self, *, keep: int = 256, max_send_bytes: int = 16 << 20, max_running: int = 64):
        self.keep = keep
        self.max_send_bytes = max_send_bytes
        self.max_running = max_running
        """Runs at once; past it a launch is refused (429), never queued without bound."""
        self._runs: OrderedDict[str, RunRecord] = OrderedDict()

    def __repr__(self) -> str:
        return f"RunTable({len(self._runs)} runs, {self.running} running)"

    @property
    def running(self) -> int:
        """Runs not finished yet."""
        return sum(1 for r in self._runs.values() if not r.done)

    def list(self, *, scope: str | None = None) -> list[RunRecord]:
        """The runs kept (running and the newest finished), oldest first; ``scope``: a
        tenant's only."""
        return [r for r in self._runs.values() if scope is None or r.tenant == scope]

    def get(self, run_id: str, *, scope: str | None = None) -> RunRecord | None:
        """The run, or None (also when ``scope``, a tenant, did not launch it)."""
        rec = self._runs.get(run_id)
        return rec if rec is not None and (scope is None or rec.tenant == scope) else None

    def start(
        self,
        runtime: InferletRuntime,
        inferlet_id: str,
        wasm: Path,
        args: list[str],
        limits: RunLimits,
        messages: list[str],
        close_input: bool,
        tenant: str = "",
        *,
        origin: str = "http",
        capture_output: bool = False,
        listeners: list[Listener] | None = None,
    ) -> RunRecord:
        """Launch the run now (on the running loop); its events go to ``record.events`` and
        to its ``listeners`` (given here, so none misses the first event).
        ``capture_output``: the guest's WASI stdout / stderr too, to the listeners only
        (counted with the sends against ``max_send_bytes``). ``queue_full`` (429) when
        ``max_running`` runs are going."""
        running = sum(1 for r in self._runs.values() if not r.done)
        if running >= self.max_running:
            retry = self.retry_after()
            raise ServiceError(
                "queue_full",
                f"{running} inferlet runs are going, this server's maximum; retry after {retry} s",
                retry_after=retry,
                limit=self.max_running,
            )
        rec = RunRecord(
            id=f"run-{uuid.uuid4().hex[:24]}",
            inferlet_id=inferlet_id,
            args=list(args),
            tenant=tenant,
            origin=origin,
            listeners=list(listeners or ()),
        )
        rec.control.namespace = tenant
        rec.control.cache_scope = cache_scope()  # the request's (its tenant's) cache scope
        for m in messages:
            rec.control.post(m)
        if close_input:
            rec.control.close_input()
        loop = asyncio.get_running_loop()

        def on_send(text: str) -> None:  # the run's worker thread
            loop.call_soon_threadsafe(self._on_send, rec, text)

        def on_output(stream: str, text: str) -> None:  # the run's worker thread
            loop.call_soon_threadsafe(self._on_send, rec, text, stream)

        def on_file(data: bytes) -> None:  # the run's worker thread
            loop.call_soon_threadsafe(self.deliver_file, rec, bytes(data))

        rec.task = asyncio.create_task(
            self._drive(runtime, rec, wasm, limits, on_send, on_output if capture_output else None, on_file)
        )
        self._runs[rec.id] = rec
        self._trim()
        return rec

    def retry_after(self) -> int:
        """Seconds until a run likely ends: the median length of the finished runs kept, less
        each running one's age (1 before any run has finished)."""
        now = time.time()
        started = [r.created_at for r in self._runs.values() if not r.done]
        durations = [
            r.finished_at - r.created_at for r in self._runs.values() if r.done and r.finished_at is not None
        ]
        return retry_after_estimate(started, durations, now)

    def _over_cap(self, rec: RunRecord, n: int) -> bool:
        """Count ``n`` more bytes sent; past the cap the run is cancelled (True)."""
        rec.send_bytes += n
        if rec.send_bytes <= self.max_send_bytes:
            return False
        rec.control.cancel()
        rec.error = InferletLimitError(
            f"the run sent more than {self.max_send_bytes} bytes", limit=self.max_send_bytes
        ).to_dict()
        return True

    def _on_send(self, rec: RunRecord, text: str, kind: str = "send") -> None:
        if rec.done or self._over_cap(rec, len(text.encode())):
            return
        if kind == "send":
            rec.sends.append(text)
            rec.events.put_nowait(("send", text))
        self._tell(rec, kind, text)

    def deliver_file(self, rec: RunRecord, data: bytes) -> None:
        """A file from the guest (what its ``on_file`` hands on, on the loop): to the
        listeners (a Pie session sends it as ``file`` messages), counted against the send cap."""
        if rec.done or self._over_cap(rec, len(data)):
            return
        rec.files += 1
        self._tell(rec, "file", data)

    @staticmethod
    def _tell(rec: RunRecord, kind: str, value: str | bytes | None) -> None:
        for listener in list(rec.listeners):
            try:
                listener(kind, value)
            except Exception:  # noqa: BLE001 - one listener's fault is not the run's
                log.exception("inferlet run %s: a listener failed", rec.id)

    async def _drive(
        self,
        runtime: InferletRuntime,
        rec: RunRecord,
        wasm: Path,
        limits: RunLimits,
        on_send: Any,
        on_output: Any = None,
        on_file: Any = None,
    ) -> None:
        try:
            kw = {k: v for k, v in (("on_output", on_output), ("on_file", on_file)) if v is not None}
            rec.result = await runtime.run_async(
                wasm, rec.args, on_send=on_send, limits=limits, control=rec.control, **kw
            )
            rec.status = "succeeded"
        except PieMediaError as e:
            if rec.error is None:  # else the send cap stopped it (already recorded)
                rec.error = e.to_dict()
            rec.status = (
                "cancelled" if e.code == "inferlet_cancelled" and rec.error["code"] == e.code else "failed"
            )
        except asyncio.CancelledError:
            rec.control.cancel()
            rec.status = "cancelled"
            rec.error = {"code": "inferlet_cancelled", "message": "the run was cancelled"}
            raise
        finally:
            rec.finished_at = int(time.time())
            rec.events.put_nowait(("end", None))
            self._tell(rec, "end", None)

    def cancel(self, rec: RunRecord) -> None:
        """Stop the run (it ends at the guest's next host call, or at once if it waits in
        one); idempotent."""
        rec.control.cancel()

    def _trim(self) -> None:
        finished = [k for k, r in self._runs.items() if r.done]
        for k in finished[: max(0, len(finished) - self.keep)]:
            del self._runs[k]

    async def shutdown(self) -> None:
        for rec in self._runs.values():
            rec.control.cancel()
        tasks = [r.task for r in self._runs.values() if r.task is not None and not r.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=10)
