"""``wasi:filesystem`` (``types`` and ``preopens``), wholly the host's: one directory per
run, the guest's ``/scratch`` (``host.sandbox_dir``: made on first use, removed with the
run), as Pie gives each process. The host's own files are never reachable.

* Confinement: every path is resolved here, one component at a time, below the
  descriptor it is relative to. An absolute path, a ``..`` above that descriptor, or a
  symbolic link whose target is absolute or climbs out is refused with ``not-permitted``
  (links are followed by reading them, never by the OS). Intermediate components are never
  links when the OS sees the path; a last component that is a link and is not to be
  followed is opened with ``O_NOFOLLOW``. ``symlink-at`` makes only links that stay inside,
  ``readlink-at`` refuses any other.
* Size: the files of the sandbox hold at most ``RunLimits.max_scratch_bytes`` bytes
  (default 4 x ``max_buffer_bytes``), counted by file size (a sparse file counts whole).
  Growth is counted as it happens; at the cap the sandbox is measured again (unlinked files
  still open included) before a write fails with ``insufficient-space``.
* Streams are ``wasi:io/streams`` streams of the host (``streams.py``) over the file; their
  failures carry a ``wasi:io/error`` that ``filesystem-error-code`` reads.
* ``sync``/``sync-data`` succeed without syncing (the sandbox does not outlive the run);
  ``advise`` is accepted and ignored.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat as st
import time
import weakref
from pathlib import Path
from typing import Any

from wasmtime import component as wc

from inferlets.host.binding import Interface, Resource, WitErr, wit
from inferlets.host.wasi.streams import InputStream, OutputStream, StreamError, StreamFailed

PREOPEN = "/scratch"
MAX_LINK_HOPS = 40
READ_CHUNK = 1 << 20

_ERRNO = {
    errno.EACCES: "access",
    errno.EAGAIN: "would-block",
    errno.EALREADY: "already",
    errno.EBADF: "bad-descriptor",
    errno.EBUSY: "busy",
    errno.EDEADLK: "deadlock",
    errno.EDQUOT: "quota",
    errno.EEXIST: "exist",
    errno.EFBIG: "file-too-large",
    errno.EILSEQ: "illegal-byte-sequence",
    errno.EINPROGRESS: "in-progress",
    errno.EINTR: "interrupted",
    errno.EINVAL: "invalid",
    errno.EIO: "io",
    errno.EISDIR: "is-directory",
    errno.ELOOP: "loop",
    errno.EMLINK: "too-many-links",
    errno.EMSGSIZE: "message-size",
    errno.ENAMETOOLONG: "name-too-long",
    errno.ENODEV: "no-device",
    errno.ENOENT: "no-entry",
    errno.ENOLCK: "no-lock",
    errno.ENOMEM: "insufficient-memory",
    errno.ENOSPC: "insufficient-space",
    errno.ENOTDIR: "not-directory",
    errno.ENOTEMPTY: "not-empty",
    errno.ENOTRECOVERABLE: "not-recoverable",
    errno.ENOTSUP: "unsupported",
    errno.EOPNOTSUPP: "unsupported",
    errno.ENOTTY: "no-tty",
    errno.ENXIO: "no-such-device",
    errno.EOVERFLOW: "overflow",
    errno.EPERM: "not-permitted",
    errno.EPIPE: "pipe",
    errno.EROFS: "read-only",
    errno.ESPIPE: "invalid-seek",
    errno.ETXTBSY: "text-file-busy",
    errno.EXDEV: "cross-device",
}


def _code(e: OSError) -> str:
    return _ERRNO.get(e.errno or 0, "io")


def _fail(code: str, message: str = "") -> WitErr:
    return WitErr(code, message or code)


def _os_call(fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args)``, an OSError answered as its ``error-code`` (never the host path)."""
    try:
        return fn(*args, **kw)
    except OSError as e:
        raise _fail(_code(e), e.strerror or "") from None


def _kind(mode: int) -> str:
    if st.S_ISREG(mode):
        return "regular-file"
    if st.S_ISDIR(mode):
        return "directory"
    if st.S_ISLNK(mode):
        return "symbolic-link"
    if st.S_ISFIFO(mode):
        return "fifo"
    if st.S_ISSOCK(mode):
        return "socket"
    if st.S_ISCHR(mode):
        return "character-device"
    if st.S_ISBLK(mode):
        return "block-device"
    return "unknown"


def _datetime(ns: int) -> wc.Record:
    r = wc.Record()
    r.seconds = ns // 1_000_000_000
    r.nanoseconds = ns % 1_000_000_000
    return r


def _stat_record(s: os.stat_result) -> wc.Record:
    r = wc.Record()
    r.type = _kind(s.st_mode)
    setattr(r, "link-count", s.st_nlink)
    r.size = s.st_size
    setattr(r, "data-access-timestamp", _datetime(s.st_atime_ns))
    setattr(r, "data-modification-timestamp", _datetime(s.st_mtime_ns))
    setattr(r, "status-change-timestamp", _datetime(s.st_ctime_ns))
    return r


class Sandbox:
    """One run's ``/scratch``: its directory, its byte cap and what its files hold."""

    def __init__(self, root: Path, cap: int):
        self.root = root
        self.cap = cap
        self.used = 0  # an upper bound of what the files hold (growth is counted, frees are not)
        self.open: weakref.WeakSet[Descriptor] = weakref.WeakSet()
        self.key = secrets.token_bytes(16)  # metadata hashes say nothing of the host's inodes

    def path(self, rel: tuple[str, ...]) -> str:
        return os.path.join(self.root, *rel)

    # -- paths ----------------------------------------------------------------------------------
    def resolve(self, base: tuple[str, ...], path: str, follow: bool) -> tuple[str, ...]:
        """``path`` relative to the directory ``base``: the components below the sandbox's
        root of what it names, every link on the way read and followed here (the last
        component only when ``follow``). Never above ``base``."""
        if not isinstance(path, str) or "\0" in path:
            raise _fail("invalid", "bad path")
        if path.startswith("/"):
            raise _fail("not-permitted", "absolute paths are not allowed")
        if path == "":
            raise _fail("no-entry", "empty path")
        floor = len(base)
        parts = list(base)
        todo = path.split("/")
        if path.endswith("/"):
            follow = True  # "name/" names the directory a link points to
        hops = 0
        while todo:
            name = todo.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                if len(parts) <= floor:
                    raise _fail("not-permitted", "the path leaves its directory")
                parts.pop()
                continue
            last = not any(t not in ("", ".") for t in todo)
            cand = parts + [name]
            if (follow or not last) and os.path.islink(self.path(tuple(cand))):
                hops += 1
                if hops > MAX_LINK_HOPS:
                    raise _fail("loop", "too many links")
                target = _os_call(os.readlink, self.path(tuple(cand)))
                if target.startswith("/"):
                    raise _fail("not-permitted", "a link points out of the sandbox")
                todo = target.split("/") + todo
                continue
            parts = cand
        return tuple(parts)

    def check(self, rel: tuple[str, ...]) -> None:
        """``not-permitted`` if a component of ``rel`` is now a link (the OS would follow it)."""
        for i in range(1, len(rel) + 1):
            try:
                mode = os.lstat(self.path(rel[:i])).st_mode
            except OSError:
                return  # gone: the call on it fails as the OS says
            if st.S_ISLNK(mode):
                raise _fail("not-permitted", "the directory was replaced by a link")

    def parent_and_name(self, base: tuple[str, ...], path: str) -> tuple[str, ...]:
        """The path of an entry to create, remove or rename: its last component is never
        followed, and it is never the descriptor's own directory or one above it."""
        rel = self.resolve(base, path.rstrip("/") or path, follow=False)
        if len(rel) <= len(base):
            raise _fail("not-permitted", "the path names the directory itself")
        return rel

    def link_target_ok(self, link_dir: tuple[str, ...], target: str) -> bool:
        """Whether a link in ``link_dir`` to ``target`` stays inside the sandbox."""
        if not target or target.startswith("/") or "\0" in target:
            return False
        depth = len(link_dir)
        for name in target.split("/"):
            if name == "..":
                depth -= 1
                if depth < 0:
                    return False
            elif name not in ("", "."):
                depth += 1
        return True

    # -- size -----------------------------------------------------------------------------------
    def grow(self, need: int) -> None:
        """Count ``need`` more bytes; ``insufficient-space`` past the cap."""
        if need <= 0:
            return
        if self.used + need > self.cap:
            self.used = self.measure()
            if self.used + need > self.cap:
                raise StreamFailed(
                    "insufficient-space", f"the sandbox holds at most {self.cap} bytes ({self.used} used)"
                )
        self.used += need

    def measure(self) -> int:
        """What the sandbox's files hold now (each inode once; open files no longer linked
        included)."""
        seen: set[tuple[int, int]] = set()
        total = 0
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            for name in filenames + dirnames:
                try:
                    s = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                if st.S_ISREG(s.st_mode) and (s.st_dev, s.st_ino) not in seen:
                    seen.add((s.st_dev, s.st_ino))
                    total += s.st_size
        for d in list(self.open):
            if d.fd is None:
                continue
            try:
                s = os.fstat(d.fd)
            except OSError:
                continue
            if (s.st_dev, s.st_ino) not in seen:
                seen.add((s.st_dev, s.st_ino))
                total += s.st_size
        return total

    def hash(self, s: os.stat_result) -> wc.Record:
        h = hashlib.blake2b(f"{s.st_dev}:{s.st_ino}".encode(), digest_size=16, key=self.key).digest()
        r = wc.Record()
        r.lower = int.from_bytes(h[:8], "little")
        r.upper = int.from_bytes(h[8:], "little")
        return r


class Descriptor(Resource):
    """An open directory (``fd`` None: its path below the root) or regular file (an OS file
    descriptor, so it stays valid when renamed or unlinked)."""

    WIT = ("wasi:filesystem/types", "descriptor")

    def __init__(self, box: Sandbox, rel: tuple[str, ...], kind: str, flags: set[str], fd: int | None = None):
        self.box = box
        self.rel = rel
        self.kind = kind
        self.flags = set(flags)
        self.fd = fd
        if fd is not None:
            box.open.add(self)

    def __repr__(self) -> str:
        return f"Descriptor({'/'.join(self.rel) or '.'}, {self.kind})"

    @property
    def path(self) -> str:
        """The directory's path, checked again: it may have been renamed away and a link
        put in its place since it was opened."""
        self.box.check(self.rel)
        return self.box.path(self.rel)

    def file_fd(self) -> int:
        if self.fd is None:
            raise _fail("is-directory" if self.kind == "directory" else "bad-descriptor")
        return self.fd

    def dir(self) -> tuple[str, ...]:
        if self.kind != "directory":
            raise _fail("not-directory")
        self.box.check(self.rel)
        return self.rel

    def stat(self) -> os.stat_result:
        if self.fd is not None:
            return _os_call(os.fstat, self.fd)
        return _os_call(os.stat, self.path)

    # -- byte I/O (streams and read/write) ------------------------------------------------------
    def read_at(self, n: int, offset: int) -> bytes:
        if self.fd is None:
            raise StreamFailed("bad-descriptor", "the file is closed")
        try:
            return os.pread(self.fd, max(0, min(int(n), READ_CHUNK)), offset)
        except OSError as e:
            raise StreamFailed(_code(e), e.strerror or "") from None

    def write_at(self, data: bytes, offset: int | None) -> int:
        """Write at ``offset`` (None: at the end); the bytes written."""
        if self.fd is None:
            raise StreamFailed("bad-descriptor", "the file is closed")
        try:
            size = os.fstat(self.fd).st_size
            at = size if offset is None else int(offset)
            self.box.grow(at + len(data) - size)
            n = 0
            while n < len(data):
                n += os.pwrite(self.fd, data[n:], at + n)
            return n
        except OSError as e:
            raise StreamFailed(_code(e), e.strerror or "") from None

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            self.box.open.discard(self)
            try:
                os.close(fd)
            except OSError:
                pass


class DirectoryEntryStream(Resource):
    """The entries of a directory, as it was when the stream was made (names in order)."""

    WIT = ("wasi:filesystem/types", "directory-entry-stream")

    def __init__(self, entries: list[tuple[str, str]]):
        self.entries = entries
        self.at = 0

    def next(self) -> tuple[str, str] | None:
        if self.at >= len(self.entries):
            return None
        self.at += 1
        return self.entries[self.at - 1]


def _check_stream_ok(d: Descriptor, need: str) -> int:
    fd = d.file_fd()
    if need not in d.flags:
        raise _fail("bad-descriptor", f"the file is not open for {need}")
    return fd


def _new_timestamp(v: Any, current_ns: int) -> int:
    tag = v.tag if isinstance(v, wc.Variant) else v
    if tag == "no-change":
        return current_ns
    if tag == "now":
        return time.time_ns()
    if tag == "timestamp":
        dt = v.payload
        return int(dt.seconds) * 1_000_000_000 + int(dt.nanoseconds)
    raise _fail("invalid", f"bad timestamp {v!r}")


def _times(s: os.stat_result, atime: Any, mtime: Any) -> tuple[int, int]:
    return _new_timestamp(atime, s.st_atime_ns), _new_timestamp(mtime, s.st_mtime_ns)


def _sandbox(host: Any) -> Sandbox:
    box = _SANDBOXES.get(host)
    if box is None:
        limits = host.state.limits
        cap = limits.max_scratch_bytes
        if cap is None:
            cap = limits.max_buffer_bytes * 4
        box = Sandbox(Path(os.path.realpath(host.sandbox_dir)), int(cap))
        _SANDBOXES[host] = box
    return box


_SANDBOXES: weakref.WeakKeyDictionary[Any, Sandbox] = weakref.WeakKeyDictionary()


class FilesystemTypes(Interface):
    NAME = "wasi:filesystem/types"
    RESOURCES = (Descriptor, DirectoryEntryStream)

    # -- streams ------------------------------------------------------------------------------
    @wit("[method]descriptor.read-via-stream")
    def read_via_stream(self, d: Descriptor, offset: int) -> InputStream:
        _check_stream_ok(d, "read")
        pos = [int(offset)]

        def read(n: int) -> bytes:
            data = d.read_at(n, pos[0])
            pos[0] += len(data)
            return data

        return InputStream(read)

    @wit("[method]descriptor.write-via-stream")
    def write_via_stream(self, d: Descriptor, offset: int) -> OutputStream:
        _check_stream_ok(d, "write")
        pos = [int(offset)]

        def write(data: bytes) -> None:
            pos[0] += d.write_at(data, pos[0])

        return OutputStream(write)

    @wit("[method]descriptor.append-via-stream")
    def append_via_stream(self, d: Descriptor) -> OutputStream:
        _check_stream_ok(d, "write")
        return OutputStream(lambda data: d.write_at(data, None))

    # -- the descriptor itself ------------------------------------------------------------------
    @wit("[method]descriptor.advise")
    def advise(self, d: Descriptor, offset: int, length: int, advice: str) -> None:
        d.file_fd()

    @wit("[method]descriptor.sync-data")
    def sync_data(self, d: Descriptor) -> None:
        d.stat()

    @wit("[method]descriptor.sync")
    def sync(self, d: Descriptor) -> None:
        d.stat()

    @wit("[method]descriptor.get-flags")
    def get_flags(self, d: Descriptor) -> set[str]:
        return set(d.flags)

    @wit("[method]descriptor.get-type")
    def get_type(self, d: Descriptor) -> str:
        return d.kind

    @wit("[method]descriptor.set-size")
    def set_size(self, d: Descriptor, size: int) -> None:
        fd = _check_stream_ok(d, "write")
        cur = _os_call(os.fstat, fd).st_size
        try:
            d.box.grow(int(size) - cur)
        except StreamFailed as e:
            raise _fail(e.code, str(e)) from None
        _os_call(os.ftruncate, fd, int(size))

    @wit("[method]descriptor.set-times")
    def set_times(self, d: Descriptor, atime: Any, mtime: Any) -> None:
        ns = _times(d.stat(), atime, mtime)
        _os_call(os.utime, d.fd if d.fd is not None else d.path, ns=ns)

    @wit("[method]descriptor.read")
    def read(self, d: Descriptor, length: int, offset: int) -> tuple[bytes, bool]:
        _check_stream_ok(d, "read")
        try:
            data = d.read_at(int(length), int(offset))
        except StreamFailed as e:
            raise _fail(e.code, str(e)) from None
        end = int(offset) + len(data) >= d.stat().st_size
        return data, end

    @wit("[method]descriptor.write")
    def write(self, d: Descriptor, buffer: bytes, offset: int) -> int:
        _check_stream_ok(d, "write")
        try:
            return d.write_at(bytes(buffer), int(offset))
        except StreamFailed as e:
            raise _fail(e.code, str(e)) from None

    @wit("[method]descriptor.read-directory")
    def read_directory(self, d: Descriptor) -> DirectoryEntryStream:
        d.dir()
        entries: list[tuple[str, str]] = []
        with _os_call(os.scandir, d.path) as it:
            for e in it:
                try:
                    kind = _kind(e.stat(follow_symlinks=False).st_mode)
                except OSError:
                    kind = "unknown"
                entries.append((kind, e.name))
        entries.sort(key=lambda x: x[1])
        return DirectoryEntryStream(entries)

    @wit("[method]descriptor.stat")
    def stat(self, d: Descriptor) -> wc.Record:
        return _stat_record(d.stat())

    @wit("[method]descriptor.metadata-hash")
    def metadata_hash(self, d: Descriptor) -> wc.Record:
        return d.box.hash(d.stat())

    @wit("[method]descriptor.is-same-object")
    def is_same_object(self, d: Descriptor, other: Descriptor) -> bool:
        try:
            a, b = d.stat(), other.stat()
        except WitErr:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    # -- paths below a directory ----------------------------------------------------------------
    def _at(self, d: Descriptor, path_flags: set[str], path: str) -> str:
        rel = d.box.resolve(d.dir(), path, "symlink-follow" in path_flags)
        return d.box.path(rel)

    @wit("[method]descriptor.stat-at")
    def stat_at(self, d: Descriptor, path_flags: set[str], path: str) -> wc.Record:
        return _stat_record(_os_call(os.lstat, self._at(d, path_flags, path)))

    @wit("[method]descriptor.metadata-hash-at")
    def metadata_hash_at(self, d: Descriptor, path_flags: set[str], path: str) -> wc.Record:
        return d.box.hash(_os_call(os.lstat, self._at(d, path_flags, path)))

    @wit("[method]descriptor.set-times-at")
    def set_times_at(self, d: Descriptor, path_flags: set[str], path: str, atime: Any, mtime: Any) -> None:
        p = self._at(d, path_flags, path)
        ns = _times(_os_call(os.lstat, p), atime, mtime)
        _os_call(os.utime, p, ns=ns, follow_symlinks=False)

    @wit("[method]descriptor.create-directory-at")
    def create_directory_at(self, d: Descriptor, path: str) -> None:
        rel = d.box.parent_and_name(d.dir(), path)
        _os_call(os.mkdir, d.box.path(rel), 0o700)

    @wit("[method]descriptor.open-at")
    def open_at(
        self, d: Descriptor, path_flags: set[str], path: str, open_flags: set[str], flags: set[str]
    ) -> Descriptor:
        box = d.box
        rel = box.resolve(d.dir(), path, "symlink-follow" in path_flags)
        p = box.path(rel)
        want_dir = "directory" in open_flags
        try:
            s: os.stat_result | None = os.lstat(p)
        except FileNotFoundError:
            s = None
        except OSError as e:
            raise _fail(_code(e)) from None
        if s is not None and "create" in open_flags and "exclusive" in open_flags:
            raise _fail("exist")
        if s is not None and st.S_ISDIR(s.st_mode):
            if "write" in flags or "truncate" in open_flags:
                raise _fail("is-directory")
            return Descriptor(box, rel, "directory", (flags & {"read"}) | {"mutate-directory"})
        if want_dir:
            raise _fail("not-directory" if s is not None else "no-entry")
        if s is not None and st.S_ISLNK(s.st_mode):
            raise _fail("loop", "the path is a link and is not followed")
        if s is not None and not st.S_ISREG(s.st_mode):
            raise _fail("unsupported")
        if s is None and "create" in open_flags and not rel:
            raise _fail("not-permitted")
        mode = (
            os.O_RDWR
            if "write" in flags and "read" in flags
            else os.O_WRONLY
            if "write" in flags
            else os.O_RDONLY
        )
        mode |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        if "create" in open_flags:
            mode |= os.O_CREAT
        if "exclusive" in open_flags:
            mode |= os.O_EXCL
        if "truncate" in open_flags:
            if "write" not in flags:
                raise _fail("invalid", "truncate needs write")
            mode |= os.O_TRUNC
        fd = _os_call(os.open, p, mode, 0o600)
        try:
            if not st.S_ISREG(os.fstat(fd).st_mode):
                raise _fail("unsupported")
            keep = flags & {
                "read",
                "write",
                "file-integrity-sync",
                "data-integrity-sync",
                "requested-write-sync",
            }
            return Descriptor(box, rel, "regular-file", keep, fd)
        except BaseException:
            os.close(fd)
            raise

    @wit("[method]descriptor.readlink-at")
    def readlink_at(self, d: Descriptor, path: str) -> str:
        box = d.box
        rel = box.resolve(d.dir(), path, follow=False)
        target = _os_call(os.readlink, box.path(rel))
        if not box.link_target_ok(rel[:-1], target):
            raise _fail("not-permitted", "the link points out of the sandbox")
        return target

    @wit("[method]descriptor.remove-directory-at")
    def remove_directory_at(self, d: Descriptor, path: str) -> None:
        rel = d.box.parent_and_name(d.dir(), path)
        _os_call(os.rmdir, d.box.path(rel))

    @wit("[method]descriptor.unlink-file-at")
    def unlink_file_at(self, d: Descriptor, path: str) -> None:
        box = d.box
        rel = box.parent_and_name(d.dir(), path)
        p = box.path(rel)
        s = _os_call(os.lstat, p)
        if st.S_ISDIR(s.st_mode):
            raise _fail("is-directory")
        if path.endswith("/"):
            raise _fail("not-directory")
        _os_call(os.unlink, p)

    @wit("[method]descriptor.rename-at")
    def rename_at(self, d: Descriptor, old_path: str, new_d: Descriptor, new_path: str) -> None:
        self._same_sandbox(d, new_d)
        old = d.box.parent_and_name(d.dir(), old_path)
        new = new_d.box.parent_and_name(new_d.dir(), new_path)
        _os_call(os.rename, d.box.path(old), new_d.box.path(new))

    @wit("[method]descriptor.link-at")
    def link_at(
        self, d: Descriptor, old_flags: set[str], old_path: str, new_d: Descriptor, new_path: str
    ) -> None:
        self._same_sandbox(d, new_d)
        old = d.box.resolve(d.dir(), old_path, "symlink-follow" in old_flags)
        new = new_d.box.parent_and_name(new_d.dir(), new_path)
        _os_call(os.link, d.box.path(old), new_d.box.path(new), follow_symlinks=False)

    @wit("[method]descriptor.symlink-at")
    def symlink_at(self, d: Descriptor, old_path: str, new_path: str) -> None:
        box = d.box
        new = box.parent_and_name(d.dir(), new_path)
        if not box.link_target_ok(new[:-1], old_path):
            raise _fail("not-permitted", "a link must stay inside the sandbox")
        _os_call(os.symlink, old_path, box.path(new))

    @staticmethod
    def _same_sandbox(a: Descriptor, b: Descriptor) -> None:
        if a.box is not b.box:
            raise _fail("cross-device")

    # -- the rest ----------------------------------------------------------------------------------
    @wit("[method]directory-entry-stream.read-directory-entry")
    def read_directory_entry(self, s: DirectoryEntryStream) -> wc.Record | None:
        e = s.next()
        if e is None:
            return None
        r = wc.Record()
        r.type = e[0]
        r.name = e[1]
        return r

    @wit("filesystem-error-code")
    def filesystem_error_code(self, err: Any) -> str | None:
        return err.code if isinstance(err, StreamError) else None


class FilesystemPreopens(Interface):
    NAME = "wasi:filesystem/preopens"
    RESOURCES = (Descriptor,)

    @wit("get-directories")
    def get_directories(self) -> list[tuple[Descriptor, str]]:
        box = _sandbox(self.host)
        return [(Descriptor(box, (), "directory", {"read", "mutate-directory"}), PREOPEN)]
