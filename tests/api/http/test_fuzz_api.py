"""Every operation in the served OpenAPI document, fuzzed by schemathesis against the real
server: no input makes it answer 5xx, every status it answers is one the document lists,
and every documented body (success or error) matches its schema.

Random strings rarely name a served model or an existing resource, and then the fuzzer
never gets past the 404. So the test first makes one of each (an upload, a batch input
file, a batch, a caption job, an inferlet and a run of it) and, for a share of the
generated cases, puts a real model name or id where the case has one. Cases are derived
deterministically (``derandomize``), so a failure reproduces; ``PIE_MEDIA_FUZZ_EXAMPLES``
raises the number of cases per operation for a longer hunt.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS

from tests.api.http.conftest import Server, start_server, stop_server

EXAMPLES = int(os.environ.get("PIE_MEDIA_FUZZ_EXAMPLES", "5"))
ONLY = os.environ.get("PIE_MEDIA_FUZZ_ONLY", "")
"""A path fragment: fuzz only the operations whose label holds it (to chase one failure)."""
INFERLETS = Path(__file__).resolve().parents[3] / "inferlets" / "examples"
CHECKED = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
)


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own: the fuzzer creates and deletes things other tests must not see."""
    s = start_server(
        tmp_path_factory.mktemp("fuzz"),
        models=("tiny", "tiny-csm"),
        env={"PIE_MEDIA_MAX_TOKENS_LIMIT": "64", "PIE_MEDIA_DEFAULT_MAX_TOKENS": "8"},
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def known(fuzzed_server: Server, samples: Path) -> dict[str, list[str]]:
    """Real values by parameter name: served models and one resource of each kind."""
    v1 = fuzzed_server.v1
    # A generous timeout: on 2 shared cores beside another test worker the first upload
    # (the server's first image preparation) once took longer than httpx's 5 s default.
    client = httpx.Client(timeout=60)
    png = (samples / "images" / "rgba.png").read_bytes()
    media = client.post(f"{v1}/media", files=[("file", ("a.png", png, "image/png"))]).json()
    media_id = media["data"][0]["media"]["id"]
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny-qwen3-vl", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    }
    file = client.post(
        f"{v1}/files",
        files=[("file", ("in.jsonl", json.dumps(line).encode() + b"\n", "application/jsonl"))],
        data={"purpose": "batch"},
    ).json()
    batch = client.post(
        f"{v1}/batches",
        json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    job = client.post(f"{v1}/jobs/captions", json={"media_ids": [media_id], "max_tokens": 2}).json()
    from fixtures.paths import cache_root
    from inferlets import build_component

    wasm = build_component(INFERLETS, cache_root() / "inferlets-build").read_bytes()
    inferlet = client.post(
        f"{v1}/inferlets", content=wasm, headers={"content-type": "application/wasm"}, timeout=300
    ).json()
    models = [m["id"] for m in client.get(f"{v1}/models").json()["data"]]
    client.close()
    return {
        "model": models,
        "name": models,
        "media_id": [media_id],
        "file_id": [file["id"], batch["output_file_id"] or file["id"]],
        "input_file_id": [file["id"]],
        "batch_id": [batch["id"]],
        "job_id": [job["id"]],
        "inferlet_id": [inferlet["id"]],
        "voice": ["0", "1"],
    }


def _pick(options: list[str], salt: str) -> str | None:
    """A known value for two cases in three (chosen from the case's own content, so the
    choice is as reproducible as the case), else None: keep what the fuzzer generated."""
    h = zlib.crc32(salt.encode())
    return None if h % 3 == 0 else options[h % len(options)]


def _ground(case, known: dict[str, list[str]]) -> None:
    salt = repr((case.path_parameters, case.query, case.body))
    for name in list(case.path_parameters or {}):
        if name in known and (value := _pick(known[name], salt + name)) is not None:
            case.path_parameters[name] = value
    if isinstance(case.body, dict):
        for name in ("model", "input_file_id", "voice"):
            if name in case.body and (value := _pick(known[name], salt + name)) is not None:
                case.body[name] = value


@pytest.fixture(scope="module")
def fuzzed_schema(fuzzed_server: Server):
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")


def _checks() -> list:
    # the registry holds the OpenAPI checks once a schema has loaded
    checks = [c for c in CHECKS.get_all() if c.__name__ in CHECKED]
    assert len(checks) == len(CHECKED), [c.__name__ for c in checks]
    return checks


def _fuzz(operation, known: dict[str, list[str]], checks: list) -> None:
    """``EXAMPLES`` valid and ``EXAMPLES`` invalid cases of one operation (schemathesis's
    own pytest plugin reads a pytest internal that pytest 9 no longer has, so hypothesis
    drives the operation's strategies directly)."""
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case) -> None:
            _ground(case, known)
            case.call_and_validate(checks=checks, timeout=120)

        try:
            run()
        except Unsatisfiable:
            # nothing to break: no parameter or body that can be invalid (a route without
            # any, or only path segments, which any string satisfies)
            if mode is not GenerationMode.NEGATIVE:
                raise


def test_no_input_breaks_the_server(
    fuzzed_schema, known: dict[str, list[str]], fuzzed_server: Server
) -> None:
    checks = _checks()
    failures, tested = [], 0
    for result in fuzzed_schema.get_all_operations():
        operation = result.ok()
        if ONLY and ONLY not in operation.label:
            continue
        tested += 1
        try:
            _fuzz(operation, known, checks)
        except Exception as e:  # every operation is fuzzed; all failures are reported together
            causes = "".join(f"\n  {c!r}" for c in getattr(e, "exceptions", ()))
            failures.append(f"{operation.label}: {e}{causes}")
    assert tested >= (1 if ONLY else 30), f"only {tested} operations in the served document"
    assert not failures, "\n\n".join(failures) + "\n\nserver log tail:\n" + fuzzed_server.log_text()[-3000:]
