"""Every store keeps each tenant's objects to itself, on both indexes (SQLite and the
shared PostgreSQL): a tenant's scope sees, lists and deletes only its own; no scope (an
admin) sees all; rows from before tenants belong to the legacy tenant ("")."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from api.http.stores.files import FileStore
from api.http.stores.index_open import open_index
from api.http.stores.inferlets import InferletStore
from api.http.stores.jobs import JobStore
from api.http.stores.responses import ResponseStore
from api.http.stores.uploads import MediaStore

pytestmark = pytest.mark.timeout(60)


def _put(store: MediaStore, data: bytes, tenant: str, name: str):
    spooled = store.spool_dir / f"{name}.part"
    spooled.write_bytes(data)
    return store.put(
        spooled,
        content_hash=hashlib.sha256(data).hexdigest(),
        kind="image",
        size=len(data),
        filename=name,
        tenant=tenant,
    )


def test_media_holders(tmp_path: Path, state_db: str | None) -> None:
    store = MediaStore(tmp_path, index=open_index(state_db, tmp_path / "media.sqlite3"))
    a, created = _put(store, b"same bytes" * 10, "alice", "a.png")
    assert created and a.tenant == "alice" and a.filename == "a.png"
    assert store.get(a.id, scope="bob") is None and store.path(a.id, scope="bob") is None
    b, created = _put(store, b"same bytes" * 10, "bob", "b.png")
    assert created and b.id == a.id and b.filename == "b.png"  # bob's own record of the bytes
    _, again = _put(store, b"same bytes" * 10, "bob", "b2.png")
    assert not again
    assert [r.id for r in store.list(scope="alice")] == [a.id] and store.list(scope="carol") == []
    assert store.stored_bytes("alice") == 100 and store.stored_bytes("carol") == 0
    assert not store.delete(a.id, scope="carol")
    assert store.delete(a.id, scope="alice")
    assert store.get(a.id, scope="alice") is None
    assert store.read_bytes(a.id, scope="bob") == b"same bytes" * 10  # still bob's
    assert store.delete(a.id, scope="bob")
    assert store.get(a.id) is None and not (store.files_dir / a.id).exists()  # gone with the last holder
    c, _ = _put(store, b"other", "alice", "c.png")
    assert store.get(c.id) is not None  # an admin sees every upload
    assert store.delete(c.id)  # and removes it for everyone
    assert store.get(c.id, scope="alice") is None
    store.close()


def test_uploads_from_before_tenants_are_the_admins(tmp_path: Path) -> None:
    store = MediaStore(tmp_path)
    rec, _ = _put(store, b"old upload", "", "old.png")
    store.close()
    with sqlite3.connect(tmp_path / "media.sqlite3") as db:  # as a store made before tenants left it
        db.execute("DROP TABLE media_holders")
    store = MediaStore(tmp_path)
    assert store.legacy_count() == 1
    assert store.get(rec.id) is not None and store.get(rec.id, scope="alice") is None
    _put(store, b"old upload", "alice", "mine.png")
    assert store.delete(rec.id, scope="alice")
    assert store.get(rec.id) is not None  # the legacy holder keeps the bytes
    store.close()


def test_files_jobs_and_responses(tmp_path: Path, state_db: str | None) -> None:
    files = FileStore(tmp_path, index=open_index(state_db, tmp_path / "files.sqlite3"))
    f = files.add(b"x" * 7, filename="in.jsonl", purpose="batch", tenant="alice")
    assert files.get(f.id, scope="bob") is None and files.get(f.id, scope="alice") == f
    assert files.list(scope="bob") == ([], False) and [r.id for r in files.list()[0]] == [f.id]
    assert files.stored_bytes("alice") == 7
    assert not files.delete(f.id, scope="bob") and files.delete(f.id, scope="alice")

    jobs = JobStore(tmp_path / "jobs.sqlite3", index=open_index(state_db, tmp_path / "jobs.sqlite3"))
    job = jobs.create(
        model="m", prompt="", max_tokens=1, concurrency=1, items=[("a", None, None, "{}")], tenant="alice"
    )
    assert job.tenant == "alice"
    assert jobs.get(job.id, scope="bob") is None and jobs.get(job.id, scope="alice").id == job.id
    assert jobs.list(scope="bob") == [] and [j.id for j in jobs.list(scope="alice")] == [job.id]
    assert [j.id for j in jobs.list()] == [job.id]

    responses = ResponseStore(tmp_path / "r.sqlite3", index=open_index(state_db, tmp_path / "r.sqlite3"))
    rid = "resp_" + "0" * 32
    responses.put(rid, {"id": rid}, [], tenant="alice")
    assert responses.get(rid, scope="bob") is None and responses.get(rid, scope="alice") == ({"id": rid}, [])
    assert not responses.delete(rid, scope="bob") and responses.get(rid) is not None
    assert responses.delete(rid, scope="alice")
    for s in (files, jobs, responses):
        s.close()


def test_inferlet_components(tmp_path: Path) -> None:
    store = InferletStore(tmp_path)
    (tmp_path / "a.part").write_bytes(b"\0asm component")
    rec, new = store.add(tmp_path / "a.part", tenant="alice")
    assert new and store.get(rec.id, scope="bob") is None and store.list(scope="bob") == []
    (tmp_path / "b.part").write_bytes(b"\0asm component")
    assert store.add(tmp_path / "b.part", tenant="bob") == (rec, False)
    assert store.delete(rec.id, scope="alice")
    assert store.get(rec.id, scope="alice") is None and store.get(rec.id, scope="bob") == rec
    assert store.delete(rec.id, scope="bob") and store.get(rec.id) is None


def test_file_listing_pages_by_cursor(tmp_path: Path, state_db: str | None) -> None:
    files = FileStore(tmp_path, index=open_index(state_db, tmp_path / "files.sqlite3"))
    ids = [files.add(b"x", filename=f"{i}.jsonl", purpose="batch", tenant="t").id for i in range(5)]
    whole = [r.id for r in files.list(10, scope="t")[0]]  # newest first (ties by id)
    assert sorted(whole) == sorted(ids)
    page, more = files.list(2, scope="t")
    assert [r.id for r in page] == whole[:2] and more
    seen = [r.id for r in page]
    while more:
        page, more = files.list(2, scope="t", after=seen[-1])
        seen += [r.id for r in page]
    assert seen == whole
    assert [r.id for r in files.list(10, scope="t", order="asc")[0]] == whole[::-1]
    assert files.list(10, scope="other", after=ids[0]) == ([], False)
    files.close()
