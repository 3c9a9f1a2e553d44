"""``JobStore`` (caption jobs, Batch API lines) and ``FileStore`` on both indexes: SQLite (the
default) and PostgreSQL (shared by replicas; a real server, tests/api/conftest.py). Two
store instances on one index stand for two replicas."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from api.http.stores.files import FileStore
from api.http.stores.index_open import open_index
from api.http.stores.jobs import JobStore

pytestmark = pytest.mark.timeout(60)


def open_jobs(tmp_path: Path, state_db: str | None) -> JobStore:
    path = tmp_path / "jobs.sqlite3"
    return JobStore(path, index=open_index(state_db, path))


def lines(n: int) -> list[tuple[str, str | None, dict | None, str | None]]:
    return [(f"req-{i}", None, None, f'{{"i": {i}}}') for i in range(n)]


def test_create_get_finish_results_and_restart(tmp_path: Path, state_db: str | None) -> None:
    items = [*lines(3), ("bad", None, {"error": "malformed"}, None)]
    with_error = open_jobs(tmp_path, state_db)
    job = with_error.create(model="tiny", prompt="", max_tokens=0, concurrency=2, items=items, kind="batch")
    assert (job.status, job.total, job.done, job.failed) == ("queued", 4, 0, 1)
    assert [i for i, *_ in with_error.pending_items(job.id)] == [0, 1, 2]
    with_error.set_status(job.id, "running")
    assert with_error.finish_item(job.id, 1, {"line": 1}, failed=False)
    assert not with_error.finish_item(job.id, 1, {"line": "again"}, failed=False)
    with_error.update_meta(job.id, output_file_id="file-x")
    with_error.close()

    again = open_jobs(tmp_path, state_db)  # a restart: the same rows, nothing lost
    job = again.get(job.id)
    assert job is not None and (job.status, job.done, job.failed) == ("running", 1, 1)
    assert job.meta == {"output_file_id": "file-x"} and isinstance(job.created_at, float)
    assert [i for i, *_ in again.pending_items(job.id)] == [0, 2]
    assert [r for _, r in again.results(job.id)] == [{"error": "malformed"}, {"line": 1}]
    seqs = [s for s, _ in again.results(job.id)]
    assert seqs == sorted(seqs) and [s for s, _ in again.results(job.id, after=seqs[0])] == seqs[1:]
    assert [j.id for j in again.unfinished()] == [job.id]
    assert [j.id for j in again.list(kind="batch")] == [job.id] and again.list() == []
    again.set_status(job.id, "completed")
    again.set_status(job.id, "running")  # a final status stays
    assert again.get(job.id).status == "completed" and again.unfinished() == []  # type: ignore[union-attr]
    assert again.get("job-nope") is None
    again.close()


def test_claims_are_exclusive_and_a_cancelled_job_gives_none(tmp_path: Path, state_db: str | None) -> None:
    a, b = open_jobs(tmp_path, state_db), open_jobs(tmp_path, state_db)
    job = a.create(model="tiny", prompt="", max_tokens=0, concurrency=2, items=lines(5))
    first = a.claim_items(job.id, "A", 3, lease_s=60)
    second = b.claim_items(job.id, "B", 3, lease_s=60)
    assert [i for i, *_ in first] == [0, 1, 2] and [i for i, *_ in second] == [3, 4]
    assert b.claim_items(job.id, "B", 3, lease_s=60) == []
    assert a.release("A") == 3
    assert [i for i, *_ in b.claim_items(job.id, "B", 9, lease_s=60)] == [0, 1, 2]
    assert not b.claim_finalize(job.id, "B", lease_s=60)  # items still pending
    for i in range(5):
        assert b.finish_item(job.id, i, {"i": i}, failed=False)
    assert b.claim_finalize(job.id, "B", lease_s=60) and not a.claim_finalize(job.id, "A", lease_s=60)

    other = a.create(model="tiny", prompt="", max_tokens=0, concurrency=2, items=lines(2))
    a.set_status(other.id, "cancelled")
    assert b.claim_items(other.id, "B", 9, lease_s=60) == []
    a.close()
    b.close()


def test_two_replicas_one_dies_every_line_done_exactly_once(tmp_path: Path, state_db: str | None) -> None:
    """Two stores claim one 40-line batch at once; replica A "dies" after 10 lines, holding
    3 claims it never finishes (and stops renewing). B takes them once A's lease runs out:
    every line ends with exactly one result, and no line was held by both while a lease lived."""
    lease = 0.6
    a, b = open_jobs(tmp_path, state_db), open_jobs(tmp_path, state_db)
    job = a.create(model="tiny", prompt="", max_tokens=0, concurrency=4, items=lines(40), kind="batch")
    claims: list[tuple[str, int, float]] = []
    finished: Counter[int] = Counter()
    abandoned: list[int] = []
    guard = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def replica(store: JobStore, owner: str, die_after: int | None) -> None:
        try:
            start.wait(timeout=10)
            done = 0
            while True:
                got = store.claim_items(job.id, owner, 1, lease_s=lease)
                if not got:
                    if store.pending_count(job.id) == 0:
                        return
                    store.renew(owner)
                    time.sleep(0.05)  # others hold the rest: wait for them or their lease
                    continue
                (idx, name, _media, payload), now = got[0], time.time()
                with guard:
                    claims.append((owner, idx, now))
                if die_after is not None and done >= die_after:
                    abandoned.append(idx)
                    if len(abandoned) == 3:
                        return  # dies: holds 3 claims, never finishes or renews them
                    continue
                time.sleep(random.uniform(0.001, 0.01))  # the work
                if store.finish_item(job.id, idx, {"custom_id": name, "body": payload}, failed=False):
                    with guard:
                        finished[idx] += 1
                done += 1
                store.renew(owner)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [
        threading.Thread(target=replica, args=(a, "A", 10)),
        threading.Thread(target=replica, args=(b, "B", None)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    assert not errors, errors
    assert sorted(finished) == list(range(40)) and set(finished.values()) == {1}
    results = [r for _, r in b.results(job.id)]
    assert sorted(int(r["custom_id"][4:]) for r in results) == list(range(40))
    by_idx: dict[int, list[tuple[str, float]]] = {}
    for owner, idx, at in claims:
        by_idx.setdefault(idx, []).append((owner, at))
    assert len(abandoned) == 3
    for idx, held in by_idx.items():
        if idx in abandoned:  # claimed by A, then by B only once A's lease had run out
            assert [o for o, _ in held] == ["A", "B"] and held[1][1] - held[0][1] >= lease * 0.9
        else:
            assert len(held) == 1, (idx, held)
    assert sum(1 for o, _, _ in claims if o == "A") >= 10 and b.claim_finalize(job.id, "B", lease)
    a.close()
    b.close()


def test_files_add_get_list_delete(tmp_path: Path, state_db: str | None) -> None:
    root = tmp_path / "state"
    files = FileStore(root, index=open_index(state_db, root / "files.sqlite3"))
    rec = files.add(b'{"a": 1}\n', filename="in.jsonl", purpose="batch")
    spooled = root / "spooled"
    spooled.write_bytes(b"xyz")
    rec2 = files.add(spooled, filename="two.jsonl", purpose="batch_output")
    assert files.get(rec.id) == rec and rec.bytes == 9 and rec2.bytes == 3 and not spooled.exists()
    assert [r.id for r in files.list()[0]] == [rec2.id, rec.id]
    assert files.get("file-" + "0" * 32) is None and files.get("../x") is None
    files.close()
    files = FileStore(root, index=open_index(state_db, root / "files.sqlite3"))  # restart
    assert files.get(rec.id) == rec and files.path(rec.id).read_bytes() == b'{"a": 1}\n'  # type: ignore[union-attr]
    assert files.delete(rec.id) and not files.delete(rec.id) and files.path(rec.id).exists() is False  # type: ignore[union-attr]
    files.close()
