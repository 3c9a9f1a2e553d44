"""Programs of Pie's protocol: ``check_program`` and the chunked ``add_program``
(PROTOCOL.md §3, §5), installed per tenant.

A program is ``name@version`` (from its manifest's ``[package]``) naming a component
stored in the server's inferlet store (``api/http/stores/inferlets.py``, by content, held by
the tenant), so ``/v1/inferlets`` lists it and HTTP runs can launch it by its id. What the
protocol adds is kept beside it: ``<state>/pie_programs/<tenant mark>/<name>@<version>.json``
(the store id, the blake3 hashes of the bytes and of the manifest, the manifest text).

Uploads are keyed by the request's ``corr_id`` (one response per upload): chunk 0 first,
then in order, ``total_chunks`` and ``program_hash`` the same in every chunk, the bytes
under a cap; a stream that stops part-way is answered (ok:false) after an idle timeout.
``transfer_file`` uploads (keyed by process id and file hash) go through the same checks
(``Uploads(kind="transfer_file")``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import blake3

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
"""A program's name or version (a file name part: no '/', no '@', no leading dot)."""


class ProgramError(ValueError):
    """An install or look-up the client gets ok:false for; the message says why."""


@dataclass(frozen=True)
class Program:
    name: str
    version: str
    inferlet_id: str
    """The component's id in the inferlet store (``inferlet-...``)."""
    wasm_hash: str
    """blake3 hex of the component's bytes (the protocol's ``program_hash`` / ``wasm_hash``)."""
    manifest_hash: str
    manifest: str
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


def split_ref(ref: Any) -> tuple[str, str]:
    """``name@version`` -> (name, version), checked."""
    if not isinstance(ref, str) or "@" not in ref:
        raise ProgramError(f"inferlet must be 'name@version', got {ref!r}")
    name, version = ref.rsplit("@", 1)
    check_name(name, "name")
    check_name(version, "version")
    return name, version


def check_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise ProgramError(
            f"program {what} {value!r}: letters, digits and . _ + - (not starting with . _ + -), at most 128"
        )
    return value


def parse_manifest(text: Any) -> tuple[str, str]:
    """(name, version) of a Pie.toml manifest (``inferlets.pie_project.PieManifest``: TOML
    with ``[package] name`` and ``version``, ``[parameters]`` well formed)."""
    from inferlets.pie_project import PieManifest
    from media.errors import PieMediaError

    if not isinstance(text, str):
        raise ProgramError("manifest must be the Pie.toml text (a string)")
    try:
        m = PieManifest.parse(text)
    except PieMediaError as e:
        raise ProgramError(f"manifest: {e.message}") from None
    return check_name(m.name, "name"), check_name(m.version, "version")


def blake3_hex(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _mark(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


class ProgramStore:
    """name@version -> ``Program``, per tenant, as small JSON files (replicas sharing the
    state folder agree)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"ProgramStore({str(self.root)!r})"

    def _file(self, tenant: str, name: str, version: str) -> Path:
        return self.root / _mark(tenant) / f"{check_name(name, 'name')}@{check_name(version, 'version')}.json"

    def get(self, tenant: str, name: str, version: str) -> Program | None:
        try:
            raw = json.loads(self._file(tenant, name, version).read_text(encoding="utf-8"))
            return Program(**raw)
        except (OSError, ValueError, TypeError):
            return None

    def list(self, tenant: str) -> list[tuple[str, str]]:
        """(name, version) of every program stored for ``tenant``, sorted."""
        folder = self._file(tenant, "x", "x").parent  # the tenant's folder (its name is a hash)
        found = []
        for path in folder.glob("*@*.json"):
            name, _, version = path.stem.rpartition("@")
            if name and version:
                found.append((name, version))
        return sorted(found)

    def delete(self, tenant: str, name: str, version: str) -> bool:
        """Forget ``name@version`` for ``tenant`` (its component stays in the inferlet store,
        where other names or uploads may hold it); False when it was not there."""
        try:
            self._file(tenant, name, version).unlink()
            return True
        except FileNotFoundError:
            return False

    def put(self, tenant: str, program: Program) -> None:
        path = self._file(tenant, program.name, program.version)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(asdict(program)), encoding="utf-8")
        os.replace(tmp, path)


@dataclass
class Upload:
    """One chunked upload in progress: an ``add_program`` (keyed by its ``corr_id``) or a
    ``transfer_file`` (keyed by ``(process_id, file_hash)``)."""

    key: Any
    hash: str
    """blake3 hex the whole upload must hash to (``program_hash`` / ``file_hash``)."""
    total_chunks: int
    manifest: str = ""
    force_overwrite: bool = False
    next_index: int = 0
    data: bytearray = field(default_factory=bytearray)
    last_chunk_at: float = field(default_factory=time.monotonic)

    @property
    def corr_id(self) -> Any:
        return self.key

    @property
    def program_hash(self) -> str:
        return self.hash


KINDS = {"add_program": "program_hash", "transfer_file": "file_hash"}
"""The chunked message types and the field holding each one's blake3 hash."""


def _int(msg: dict[str, Any], key: str, kind: str) -> int:
    v = msg.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProgramError(f"{kind}: {key} must be an integer, got {v!r}")
    return v


class Uploads:
    """One connection's chunked uploads in progress (PROTOCOL.md §5), fed chunk by chunk in
    the order they came: ``add_program`` (the default ``kind``) or ``transfer_file``. Both
    are checked alike: chunk 0 first, then in order, ``total_chunks`` and the hash the same
    in every chunk, the bytes under ``max_bytes``, their blake3 equal to the hash."""

    def __init__(self, max_bytes: int, *, max_open: int = 8, kind: str = "add_program"):
        self.max_bytes = max_bytes
        self.max_open = max_open
        self.kind = kind
        self.hash_field = KINDS[kind]
        self.open: dict[Any, Upload] = {}
        self._failed: dict[Any, None] = {}  # keys answered with an error: their later chunks are dropped

    def key_of(self, msg: dict[str, Any]) -> Any:
        """What an upload's chunks share: the ``corr_id`` of an ``add_program``, the
        ``(process_id, file_hash)`` of a ``transfer_file``."""
        if self.kind == "add_program":
            return msg.get("corr_id")
        pid, digest = msg.get("process_id"), msg.get("file_hash")
        return (
            pid if isinstance(pid, str) else repr(pid),
            digest.lower() if isinstance(digest, str) else repr(digest),
        )

    def failed(self, key: Any) -> bool:
        return key in self._failed

    def forgive(self, key: Any) -> None:
        """Take chunks of ``key`` again (a ``transfer_file`` of the same file sent anew)."""
        self._failed.pop(key, None)

    def fail(self, key: Any) -> None:
        self.open.pop(key, None)
        self._failed[key] = None
        while len(self._failed) > 64:
            self._failed.pop(next(iter(self._failed)))

    def chunk(self, msg: dict[str, Any]) -> Upload | None:
        """Take one chunk; the finished upload after its last chunk, else None.
        ``ProgramError`` (the upload is then dropped) for a chunk that breaks the rules."""
        kind, hash_field = self.kind, self.hash_field
        key = self.key_of(msg)
        index, total = _int(msg, "chunk_index", kind), _int(msg, "total_chunks", kind)
        data = msg.get("chunk_data", b"")
        if not isinstance(data, bytes | bytearray):
            raise ProgramError(f"{kind}: chunk_data must be binary, got {type(data).__name__}")
        digest = msg.get(hash_field)
        if not isinstance(digest, str) or not digest:
            what = ".wasm" if kind == "add_program" else "file"
            raise ProgramError(f"{kind}: {hash_field} (blake3 hex of the whole {what}) is required")
        up = self.open.get(key)
        if up is None:
            if index != 0:
                raise ProgramError(
                    f"{kind}: chunk {index} came first; an upload starts with chunk 0 and goes in order"
                )
            if total < 1 or total > -(-self.max_bytes // (64 * 1024)) + 1:
                raise ProgramError(f"{kind}: total_chunks {total} is out of range for this server")
            if len(self.open) >= self.max_open:
                raise ProgramError(f"{kind}: {self.max_open} uploads are open on this connection already")
            manifest = msg.get("manifest")
            if kind == "add_program" and not isinstance(manifest, str):
                raise ProgramError("add_program: manifest (the Pie.toml text) is required")
            up = Upload(
                key,
                digest.lower(),
                total,
                manifest=manifest if isinstance(manifest, str) else "",
                force_overwrite=bool(msg.get("force_overwrite")),
            )
            self.open[key] = up
        elif index != up.next_index:
            raise ProgramError(
                f"{kind}: chunk {index} out of order (expected chunk {up.next_index} of {up.total_chunks})"
            )
        if total != up.total_chunks:
            raise ProgramError(
                f"{kind}: total_chunks changed from {up.total_chunks} to {total} in chunk {index}"
            )
        if digest.lower() != up.hash:
            raise ProgramError(f"{kind}: {hash_field} changed in chunk {index}")
        if len(up.data) + len(data) > self.max_bytes:
            raise ProgramError(f"{kind}: the upload is over this server's {self.max_bytes} bytes")
        up.data += data
        up.next_index += 1
        up.last_chunk_at = time.monotonic()
        if up.next_index < up.total_chunks:
            return None
        del self.open[key]
        got = blake3_hex(bytes(up.data))
        if got != up.hash:
            raise ProgramError(
                f"{kind}: {hash_field} mismatch: the {len(up.data)} bytes received hash to {got}, "
                f"the upload says {up.hash}"
            )
        return up

    def stale(self, idle_s: float) -> list[Upload]:
        """Uploads with no chunk for ``idle_s`` seconds, removed (to be answered ok:false)."""
        now = time.monotonic()
        gone = [u for u in self.open.values() if now - u.last_chunk_at > idle_s]
        for u in gone:
            self.fail(u.key)
        return gone


def check_component(runtime: Any, path: Path) -> None:
    """Compile the component (cached on disk by the runtime) and check it is one this host
    runs: Pie 0.4.0's world or pie-media's own (``InferletRuntime.check_component``)."""
    from media.errors import PieMediaError

    try:
        runtime.check_component(path)
    except PieMediaError as e:
        detail = e.to_dict().get("detail")
        raise ProgramError(f"{e.message}" + (f": {detail}" if detail else "")) from None


def install(
    upload: Upload,
    *,
    tenant: str,
    store: Any,
    programs: ProgramStore,
    runtime: Any,
    spool: Path,
) -> tuple[str, Program | None]:
    """Install a finished upload for ``tenant`` (blocking: run it off the loop) ->
    (the response's text, the program stored now or None when one was kept).
    ``ProgramError`` for a manifest or component this server refuses."""
    name, version = parse_manifest(upload.manifest)
    existing = programs.get(tenant, name, version)
    if existing is not None and store.path(existing.inferlet_id, scope=tenant) is None:
        existing = None  # its component was deleted over HTTP: install again
    if existing is not None and not upload.force_overwrite:
        if existing.wasm_hash == upload.program_hash:
            return f"Program {existing.ref} is installed already (same bytes)", None
        raise ProgramError(
            f"{name}@{version} is installed already with other bytes; set force_overwrite to replace it"
        )
    data = bytes(upload.data)
    inferlet_id = "inferlet-" + hashlib.sha256(data).hexdigest()[:32]
    held_before = store.path(inferlet_id, scope=tenant) is not None
    spooled = Path(spool) / f"pie-program-{uuid.uuid4().hex}.part"
    spooled.write_bytes(data)
    try:
        record, _ = store.add(spooled, tenant=tenant)
    finally:
        spooled.unlink(missing_ok=True)
    path = store.path(record.id)
    try:
        check_component(runtime, path)
    except BaseException:
        if not held_before:
            store.delete(record.id, scope=tenant)
        raise
    program = Program(
        name=name,
        version=version,
        inferlet_id=record.id,
        wasm_hash=upload.program_hash,
        manifest_hash=blake3_hex(upload.manifest.encode()),
        manifest=upload.manifest,
    )
    programs.put(tenant, program)
    return "Program installed successfully", program
