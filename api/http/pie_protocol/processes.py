"""Processes of Pie's protocol over the server's one run table (``api/http/runs/inferlets.py``):
a process is an inferlet run, so one launched over the WebSocket is listed, read and
cancelled under ``/v1/inferlets/.../runs`` too, and a run launched over HTTP can be listed,
attached to and terminated over the WebSocket. Process ids are the runs' ids.

Events (PROTOCOL.md §6), from the run's listener: ``message`` (the guest's ``send``),
``stdout`` / ``stderr`` (its WASI output), ``file`` (bytes the guest sends with Pie's
``session.send-file``; the session sends them as ``file`` chunks), then ``return`` (its
result) or ``error`` (the error's ``code: message``; ``Signal`` once terminated or
cancelled). A process with no
session attached keeps its events (up to the run table's byte cap) for the first session
that attaches. A session attached to a process gets its events as they come; a process
launched with ``capture_outputs`` ends when the session that launched it goes away, one
launched without it runs on (attach to it later, from any session of its tenant).

The launch ``input`` (JSON text; ``"{}"`` when the client gives none) becomes the run's
arguments (this host's guests take a list of strings, ``pie:media/runtime.args``):

* a JSON array -> its items (strings as they are, other values as JSON text: ``8`` -> "8");
* an object with an ``args`` array, or with ``_positional`` (what ``pie-client submit ...
  -- a b c`` sends) -> those items, the same way;
* ``{}`` -> no arguments;
* anything else (another object, non-JSON text) -> one argument, the input text itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from api.http.runs.inferlets import RunRecord, RunTable

Sink = Callable[[str, str, "str | bytes"], None]
"""(process id, event, value): how a session takes a process's events (a ``file``'s value
is its bytes, every other event's a string)."""


class LaunchError(ValueError):
    """A launch the client gets ok:false for."""


def args_of(input_text: Any) -> list[str]:
    """The run's arguments for a launch ``input`` (see the module's docstring)."""
    if input_text is None:
        return []
    if not isinstance(input_text, str):
        raise LaunchError(f"input must be JSON text (a string), got {type(input_text).__name__}")
    try:
        value = json.loads(input_text)
    except ValueError:
        return [input_text]
    if isinstance(value, dict):
        if value == {}:
            return []
        for key in ("args", "_positional"):
            if isinstance(value.get(key), list) and len(value) == 1:
                value = value[key]
                break
    if isinstance(value, list):
        return [v if isinstance(v, str) else json.dumps(v) for v in value]
    return [input_text]


def launch_args(program: Any, pie_world: bool, input_text: Any) -> list[str]:
    """The run's arguments for a launch's ``input`` (JSON text): a Pie-world component takes
    the text itself, checked against the program's Pie.toml ``[parameters]`` (a typed
    ``invalid_inferlet_input`` naming the field); a ``pie:media`` one the list ``args_of``
    reads from it. ``LaunchError`` for input that is not JSON text."""
    from inferlets.pie_project import PieManifest

    if not pie_world:
        return args_of(input_text)
    if input_text is not None and not isinstance(input_text, str):
        raise LaunchError(f"input must be JSON text (a string), got {type(input_text).__name__}")
    text = input_text if input_text and input_text.strip() else "{}"
    try:
        value = json.loads(text)
    except ValueError as e:
        raise LaunchError(f"input is not JSON: {e}") from None
    if getattr(program, "manifest", ""):
        PieManifest.parse(program.manifest).check_input(value)
    return [text]


def budget_of(value: Any) -> int | None:
    """A launch's ``token_budget`` (None: none)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LaunchError(f"token_budget must be a whole number of tokens (>= 0), got {value!r}")
    return value


def end_event(rec: RunRecord) -> tuple[str, str]:
    """The terminal event of a finished run."""
    if rec.status == "succeeded":
        return "return", rec.result or ""
    if rec.status == "cancelled":
        return "error", "Signal"
    error = rec.error or {"code": "inferlet_failed", "message": "the run failed"}
    return "error", f"{error.get('code', 'inferlet_failed')}: {error.get('message', '')}"


_EVENTS = {"send": "message", "stdout": "stdout", "stderr": "stderr", "file": "file"}
MAX_BACKLOG_BYTES = 4 << 20
"""What a process keeps for a session yet to attach; past it the oldest events go (its end stays)."""


class Process:
    """The protocol's view of one run: the sessions attached, the events kept for later."""

    def __init__(self, rec: RunRecord | None = None, *, keep: bool = True):
        self.rec = rec
        self.sinks: list[Sink] = []
        self.keep = keep
        """Keep events while nobody is attached (not for ``run_processes``: only results count)."""
        self.backlog: list[tuple[str, str | bytes]] = []
        self.backlog_bytes = 0
        self.launcher: Sink | None = None
        """The session that launched it with ``capture_outputs`` (it ends with that session)."""
        self.ended = False
        self.delivered = False

    def on_event(self, kind: str, value: str | bytes | None) -> None:  # the run table's listener, on the loop
        event: tuple[str, str | bytes]
        if kind == "end":
            assert self.rec is not None
            self.ended = True
            event = end_event(self.rec)
        elif kind == "file":
            event = ("file", value if isinstance(value, bytes) else b"")
        elif kind in _EVENTS:
            event = (_EVENTS[kind], value or "")
        else:
            return
        self._emit(event)

    def _emit(self, event: tuple[str, str | bytes]) -> None:
        assert self.rec is not None
        if not self.sinks:
            if self.keep or event[0] in ("return", "error"):
                self.backlog.append(event)
                self.backlog_bytes += len(event[1])
                while self.backlog_bytes > MAX_BACKLOG_BYTES and len(self.backlog) > 1:
                    self.backlog_bytes -= len(self.backlog.pop(0)[1])
            return
        for sink in list(self.sinks):
            sink(self.rec.id, *event)
        if self.ended:
            self.delivered = True

    def attach(self, sink: Sink) -> None:
        if sink not in self.sinks:
            self.sinks.append(sink)
        backlog, self.backlog, self.backlog_bytes = self.backlog, [], 0
        for event in backlog:
            self._emit(event)


class ProcessHub:
    """The protocol's processes of one server, over its ``RunTable``."""

    def __init__(self, runs: RunTable):
        self.runs = runs
        self._procs: dict[str, Process] = {}

    def __repr__(self) -> str:
        return f"ProcessHub({len(self._procs)} processes, {self.runs!r})"

    def launch(
        self,
        runtime: Any,
        inferlet_id: str,
        wasm: Any,
        args: list[str],
        *,
        tenant: str,
        token_budget: int | None,
        sink: Sink | None,
        keep: bool = True,
    ) -> RunRecord:
        """Start a run of the component (``queue_full`` from the run table past its limit).
        ``sink``: the launching session, attached from the start (``capture_outputs``);
        ``keep``: keep its events for a later attach while nobody is attached."""
        self._prune()
        limits = runtime.limits
        if token_budget is not None:
            limits = dataclasses.replace(limits, token_budget=token_budget)
        total = sum(len(a.encode()) for a in args)
        if total > runtime.limits.max_text_bytes:
            raise LaunchError(f"input is over {runtime.limits.max_text_bytes} bytes ({total})")
        proc = Process(keep=keep)
        rec = self.runs.start(
            runtime,
            inferlet_id,
            wasm,
            args,
            limits,
            [],
            False,
            tenant,
            origin="pie",
            capture_output=True,
            listeners=[proc.on_event],
        )
        proc.rec = rec
        self._procs[rec.id] = proc
        if sink is not None:
            proc.launcher = sink
            proc.attach(sink)
        return rec

    def attach(self, rec: RunRecord, sink: Sink) -> None:
        """Send ``sink`` the process's events from now on (first those it kept: for a run
        this hub did not launch or no longer holds, what the run sent so far and its end)."""
        proc = self._procs.get(rec.id)
        if proc is None or proc.delivered:
            proc = Process(rec)
            proc.backlog = [("message", s) for s in rec.sends]  # (files not kept: gone)
            if rec.done:
                proc.ended = True
                proc.backlog.append(end_event(rec))
            else:
                rec.listeners.append(proc.on_event)
            self._procs[rec.id] = proc
        proc.attach(sink)

    def detach(self, sink: Sink) -> list[RunRecord]:
        """``sink``'s session has gone: it leaves every process; the running ones it launched
        with ``capture_outputs`` are returned (to be cancelled)."""
        ended: list[RunRecord] = []
        for proc in list(self._procs.values()):
            if sink in proc.sinks:
                proc.sinks.remove(sink)
            if proc.launcher == sink:
                proc.launcher = None
                if proc.rec is not None and not proc.rec.done:
                    ended.append(proc.rec)
                    proc.delivered = True  # nobody waits for its end
        self._prune()
        return ended

    def running(self, scope: str | None) -> list[str]:
        """Ids of the runs going now (``scope``: one tenant's; None: all)."""
        return [r.id for r in self.runs.list(scope=scope) if not r.done]

    def _prune(self) -> None:
        for run_id, proc in list(self._procs.items()):
            gone = self.runs.get(run_id) is None
            if (proc.ended and proc.delivered) or (gone and proc.rec is not None and proc.rec.done):
                if proc.rec is not None and proc.on_event in proc.rec.listeners:
                    proc.rec.listeners.remove(proc.on_event)
                del self._procs[run_id]
