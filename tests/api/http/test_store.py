"""``api.http.stores.uploads.MediaStore``: real files in a temp folder and a real index, each test on
both backends (SQLite, the default; PostgreSQL, the shared one: ``state_db`` in
tests/api/conftest.py)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from api.http.stores.index_open import open_index
from api.http.stores.uploads import MediaNotFoundError, MediaRecord, MediaStore, is_media_id
from media.errors import InvalidRequestError, PieMediaError

pytestmark = pytest.mark.timeout(30)


def spool(store: MediaStore, data: bytes, name: str | None = None) -> Path:
    p = store.spool_dir / (name or f"upload-{os.getpid()}-{os.urandom(16).hex()}.part")
    p.write_bytes(data)
    return p


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def put(store: MediaStore, data: bytes, **kw) -> tuple[MediaRecord, bool]:
    args = {
        "content_hash": digest(data),
        "kind": "image",
        "size": len(data),
        "filename": "cat.png",
        "content_type": "image/png",
        "metadata": {"width": 4, "height": 3, "token_counts": {"tiny": 12, "tiny-csm": None}},
    }
    args.update(kw)
    return store.put(spool(store, data), **args)


def open_store(root: Path, state_db: str | None, **kw) -> MediaStore:
    return MediaStore(root, index=open_index(state_db, root / "media.sqlite3"), **kw)


@pytest.fixture()
def store(tmp_path: Path, state_db: str | None):
    with open_store(tmp_path / "state", state_db) as s:
        yield s


def test_put_get_path_read(store: MediaStore) -> None:
    data = os.urandom(5000)
    src = spool(store, data)
    t0 = time.time()
    record, created = store.put(
        src,
        content_hash=digest(data),
        kind="image",
        size=len(data),
        filename="cat.png",
        content_type="image/png",
        metadata={"width": 4, "nested": {"a": [1, 2.5, None]}},
    )
    assert created
    assert record == store.get(record.id)
    assert record.id == "media-" + digest(data) and is_media_id(record.id)
    assert (record.kind, record.size, record.filename, record.content_type) == (
        "image",
        5000,
        "cat.png",
        "image/png",
    )
    assert record.metadata == {"width": 4, "nested": {"a": [1, 2.5, None]}}
    assert t0 - 1 <= record.created_at <= time.time() + 1
    assert not src.exists(), "the spool file is moved, not copied"
    assert store.path(record.id) == store.files_dir / record.id
    assert store.read_bytes(record.id) == data
    assert record.id in store and len(store) == 1
    assert record.to_dict()["metadata"] == record.metadata
    assert list(store.spool_dir.iterdir()) == []


def test_same_bytes_same_id_and_the_second_spool_file_is_discarded(store: MediaStore) -> None:
    data = b"same bytes" * 100
    first, created1 = put(store, data, filename="a.png")
    src = spool(store, data)
    second, created2 = store.put(
        src, content_hash=digest(data), kind="image", size=len(data), filename="b.png"
    )
    assert (created1, created2) == (True, False)
    assert second == first and second.filename == "a.png"
    assert not src.exists()
    assert len(store) == 1 and list(store.spool_dir.iterdir()) == []


def test_delete_removes_row_and_file(store: MediaStore) -> None:
    record, _ = put(store, b"bye")
    path = store.path(record.id)
    assert store.delete(record.id) is True
    assert store.delete(record.id) is False
    assert not path.exists()
    assert store.get(record.id) is None and store.path(record.id) is None and record.id not in store
    with pytest.raises(MediaNotFoundError) as e:
        store.read_bytes(record.id)
    assert isinstance(e.value, PieMediaError) and e.value.code == "media_not_found"
    # After a delete the same bytes can be stored again, as a new record.
    again, created = put(store, b"bye")
    assert created and again.id == record.id


def test_list_pages_in_insertion_order(store: MediaStore) -> None:
    ids = [put(store, f"item {i}".encode())[0].id for i in range(5)]
    assert [r.id for r in store.list()] == ids
    page1 = store.list(limit=2)
    page2 = store.list(limit=2, after=page1[-1].id)
    page3 = store.list(limit=2, after=page2[-1].id)
    assert [r.id for r in page1 + page2 + page3] == ids
    assert store.list(limit=2, after=ids[-1]) == []
    with pytest.raises(MediaNotFoundError):
        store.list(after="media-" + "0" * 32)
    with pytest.raises(MediaNotFoundError):
        store.list(after="../x")
    for bad in (0, -1, 10_001, True, 2.0):
        with pytest.raises(InvalidRequestError):
            store.list(limit=bad)


def test_records_survive_a_restart(tmp_path: Path, state_db: str | None) -> None:
    root = tmp_path / "state"
    payloads = [os.urandom(1000 + i) for i in range(3)]
    with open_store(root, state_db) as first:
        records = [put(first, p)[0] for p in payloads]
    with open_store(root, state_db) as second:
        assert len(second) == 3
        assert [r.id for r in second.list()] == [r.id for r in records]
        for r, p in zip(records, payloads, strict=True):
            assert second.get(r.id) == r
            assert second.read_bytes(r.id) == p
    if state_db is None:
        with sqlite3.connect(root / "media.sqlite3") as db:
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


TRAVERSAL = [
    "../x",
    "../media.sqlite3",
    "media-../../media.sqlite3",
    "media-" + "0" * 32 + "/../../media.sqlite3",
    "media-" + "A" * 32,
    "media-" + "0" * 32 + "\x00",
    "/etc/passwd",
    "files/media-" + "0" * 32,
    "",
    "media-",
]


@pytest.mark.parametrize("bad", TRAVERSAL)
def test_malformed_and_traversal_ids_are_simply_not_found(store: MediaStore, bad: str) -> None:
    put(store, b"real")
    assert store.get(bad) is None
    assert store.path(bad) is None
    assert bad not in store
    assert store.delete(bad) is False
    with pytest.raises(MediaNotFoundError):
        store.read_bytes(bad)
    assert len(store) == 1
    assert (store.root / "media.sqlite3").exists() or store._conn.dialect == "postgresql"


def test_non_str_ids_are_not_found(store: MediaStore) -> None:
    for bad in (None, 5, b"media-" + b"0" * 32):
        assert store.get(bad) is None and bad not in store and store.delete(bad) is False


def test_rows_whose_file_is_missing_are_dropped_on_open(tmp_path: Path, state_db: str | None) -> None:
    root = tmp_path / "state"
    with open_store(root, state_db) as s:
        keep, _ = put(s, b"keep")
        lost, _ = put(s, b"lost")
        (s.files_dir / lost.id).unlink()
    with open_store(root, state_db) as s:
        assert len(s) == 1
        assert s.get(lost.id) is None and s.get(keep.id) == keep


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_spool_and_orphan_files_are_cleaned_on_open(tmp_path: Path, state_db: str | None) -> None:
    root = tmp_path / "state"
    with open_store(root, state_db) as s:
        record, _ = put(s, b"kept")
        dead = spool(s, b"x", f"upload-{_dead_pid()}-{'a' * 32}.part")
        mine = spool(s, b"x", f"upload-{os.getpid()}-{'b' * 32}.part")
        old_other = spool(s, b"x", "something-else")
        os.utime(old_other, (time.time() - 7200, time.time() - 7200))
        fresh_other = spool(s, b"x", "fresh-else")
        old_orphan = s.files_dir / ("media-" + "c" * 32)
        old_orphan.write_bytes(b"orphan")
        os.utime(old_orphan, (time.time() - 7200, time.time() - 7200))
        fresh_orphan = s.files_dir / ("media-" + "d" * 32)
        fresh_orphan.write_bytes(b"orphan")
    with open_store(root, state_db) as s:
        assert not dead.exists() and not old_other.exists() and not old_orphan.exists()
        assert mine.exists() and fresh_other.exists() and fresh_orphan.exists()
        assert s.read_bytes(record.id) == b"kept"
    with open_store(root, state_db, stale_after_s=0) as s:
        assert not fresh_orphan.exists() and not fresh_other.exists() and not mine.exists()
        assert s.read_bytes(record.id) == b"kept"


def test_put_refuses_bad_arguments_before_touching_the_file(store: MediaStore) -> None:
    data = b"abc"
    src = spool(store, data)
    good = {"content_hash": digest(data), "kind": "image", "size": 3}
    bad_args = [
        {"content_hash": "../../etc"},
        {"content_hash": "ABCDEF" * 6},
        {"content_hash": "0" * 8},
        {"kind": "Image!"},
        {"kind": ""},
        {"size": 4},
        {"size": -1},
        {"size": True},
        {"filename": 5},
        {"metadata": {"x": object()}},
        {"metadata": ["not", "a", "dict"]},
    ]
    for bad in bad_args:
        with pytest.raises((ValueError, TypeError)) as e:
            store.put(src, **{**good, **bad})
        assert not isinstance(e.value, PieMediaError), "a caller's bug is not a client error"
        assert src.read_bytes() == data
    assert len(store) == 0
    record, created = store.put(src, **good)
    assert created and record.filename is None and record.metadata == {}


def test_put_from_another_filesystem_copies(store: MediaStore) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == store.root.stat().st_dev:
        pytest.skip("no second filesystem here")
    src = shm / f"pie-media-test-{os.getpid()}-{os.urandom(4).hex()}"
    src.write_bytes(b"elsewhere")
    try:
        record, created = store.put(src, content_hash=digest(b"elsewhere"), kind="audio", size=9)
        assert created and store.read_bytes(record.id) == b"elsewhere" and not src.exists()
        assert [p.name for p in store.files_dir.iterdir()] == [record.id]
    finally:
        src.unlink(missing_ok=True)


def test_concurrent_puts_from_threads(store: MediaStore) -> None:
    payloads = [
        f"payload {i % 10}".encode() * (i % 7 + 1) for i in range(10)
    ] * 6  # 10 distinct, 6 times each
    results: list[tuple[MediaRecord, bool]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(items: list[bytes]) -> None:
        try:
            barrier.wait(timeout=10)
            for data in items:
                got = put(store, data)
                with lock:
                    results.append(got)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(payloads[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors
    assert len(results) == len(payloads)
    created = [r for r, c in results if c]
    assert len(created) == 10 and len({r.id for r in created}) == 10
    assert len(store) == 10
    for data in set(payloads):
        assert store.read_bytes("media-" + digest(data)) == data
    assert list(store.spool_dir.iterdir()) == []
    assert len(list(store.files_dir.iterdir())) == 10


def test_repr_bool_and_close(tmp_path: Path, state_db: str | None) -> None:
    s = open_store(tmp_path / "state", state_db)
    assert bool(s) and len(s) == 0
    put(s, b"one")
    assert repr(s) == f"MediaStore({str(tmp_path / 'state')!r}, records=1)"
    s.close()
    s.close()
    assert "closed" in repr(s)
    with pytest.raises(RuntimeError):
        s.get("media-" + "0" * 32)
