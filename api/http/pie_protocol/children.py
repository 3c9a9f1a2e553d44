"""Child inferlets (Pie's ``runtime.launch("name@version", input)``): the launcher the
server gives the inferlet host (``InferletRuntime.launch_child``). A child is a program
installed for the parent's tenant, run in the same run table under the parent's limits and
tenant (so it counts against them), with the parent's username; it is detached from the
parent's client session and MCP relay, as in Pie. The host caps children per run."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Callable
from typing import Any

from api.http.pie_protocol.programs import ProgramStore, split_ref
from inferlets.pie_project import PieManifest


def child_launcher(
    service: Any, programs: ProgramStore, loop: asyncio.AbstractEventLoop
) -> Callable[..., Any]:
    """``(program, input, parent_state) -> (pid, future of the result, cancel)``, callable
    from a run's worker thread."""

    def launch(
        program: str, input_text: str, parent: Any
    ) -> tuple[str, concurrent.futures.Future, Callable[[], None]]:
        parent_control = parent.control
        tenant = getattr(parent_control, "namespace", "") or ""
        name, version = split_ref(program)
        found = programs.get(tenant, name, version)
        path = None if found is None else service.inferlet_store.path(found.inferlet_id, scope=tenant)
        if found is None or path is None:
            raise LookupError(f"program {name}@{version} is not installed for this tenant")
        if found.manifest:
            try:
                PieManifest.parse(found.manifest).check_input(json.loads(input_text or "{}"))
            except ValueError as e:
                raise ValueError(f"the child's input does not fit {name}@{version}: {e}") from None

        async def start() -> Any:
            # on the loop, in the guest thread's context: the parent's cache scope
            rec = service.inferlet_runs.start(
                service.inferlets,
                found.inferlet_id,
                path,
                [input_text or "{}"],
                parent.limits,
                [],
                False,
                tenant,
                origin="pie",
            )
            rec.control.username = getattr(parent_control, "username", "") or ""
            return rec

        rec = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
        result: concurrent.futures.Future = concurrent.futures.Future()
        result.set_running_or_notify_cancel()

        def done(task: asyncio.Future) -> None:
            if rec.status == "succeeded":
                result.set_result(rec.result or "")
            else:
                err = rec.error or {"code": rec.status, "message": rec.status}
                result.set_exception(RuntimeError(f"{err.get('code')}: {err.get('message')}"))

        loop.call_soon_threadsafe(rec.task.add_done_callback, done)
        return rec.id, result, rec.control.cancel

    return launch
