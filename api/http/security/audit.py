"""The audit trail: one structured log line per create, delete and cancel of a stored
object, naming the key (by name, never the key), the object and the time.

Lines go to the ``pie_media.audit`` logger as JSON, whatever the server's log level:
to standard error by default, or appended to ``--audit-log FILE``."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Literal

from api.http.security.tenancy import current_caller

log = logging.getLogger("pie_media.audit")

Action = Literal["create", "delete", "cancel"]


def configure_audit_log(path: Path | None = None) -> None:
    """Send audit lines to ``path`` (appended) or standard error, at INFO whatever the
    root level, and not again through the root logger. Idempotent per destination."""
    target = str(path) if path is not None else "<stderr>"
    if getattr(log, "_pie_media_target", None) == target:
        return
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    handler: logging.Handler = (
        logging.FileHandler(path, encoding="utf-8") if path is not None else logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(logging.Formatter("%(asctime)s pie_media.audit %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    log._pie_media_target = target  # type: ignore[attr-defined]


def audit(action: Action, kind: str, object_id: str, **extra: object) -> None:
    """Log one audit line for ``action`` on the ``kind`` object ``object_id`` by the
    current caller."""
    caller = current_caller()
    line = {
        "time": round(time.time(), 3),
        "action": action,
        "object": kind,
        "id": object_id,
        "key": caller.name,
        "tenant": caller.tenant,
        **extra,
    }
    log.info(json.dumps(line, separators=(",", ":"), default=str))
