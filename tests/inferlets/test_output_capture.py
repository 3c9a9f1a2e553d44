"""A pie:media-world guest's stdout and stderr (inferlets/host/output_capture.py): wasmtime
writes them natively to in-memory files that the host reads back, in order with the run's
messages, live, without losing a character split across writes, and without keeping what
was read in memory."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from inferlets.host import output_capture
from inferlets.host.output_capture import OutputCapture

pytestmark = pytest.mark.skipif(not output_capture.available(), reason="needs memfd and /proc/self/fd")


class Seen:
    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def __call__(self, stream: str, text: str) -> None:
        with self.lock:
            self.items.append((stream, text))

    def text(self, stream: str) -> str:
        with self.lock:
            return "".join(t for s, t in self.items if s == stream)


def _writer(c: OutputCapture, stream: str):
    # what wasmtime does with the path: File::create, then plain writes
    return open(c.paths[stream], "wb", buffering=0)  # noqa: SIM115 - closed by the test


def test_echo_output_comes_whole_and_before_the_messages(rt, wasm) -> None:
    words = [f"w{i}" for i in range(255)]
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def add(kind: str, text: str) -> None:
        with lock:
            events.append((kind, text))

    async def main() -> str:
        return await rt.run_async(wasm, ["echo", *words], on_send=lambda m: add("message", m), on_output=add)

    assert asyncio.run(main()) == "255 words, 0 messages"
    kinds = [k for k, _ in events]
    first_message = kinds.index("message")
    assert set(kinds[:first_message]) == {"stdout", "stderr"} and "stdout" not in kinds[first_message:]
    assert "".join(t for k, t in events if k == "stdout") == "out: " + " ".join(words) + "\n"
    assert "".join(t for k, t in events if k == "stderr") == "err: " + " ".join(words) + "\n"
    assert [t for k, t in events if k == "message"] == words


def test_a_character_split_across_writes_stays_whole() -> None:
    seen = Seen()
    c = OutputCapture(seen)
    with _writer(c, "stdout") as out:
        data = "héllo ✓\n".encode()
        cut = data.index("✓".encode()) + 1
        out.write(data[:cut])
        c.drain()
        out.write(data[cut:])
        c.drain()
    c.close()
    assert seen.text("stdout") == "héllo ✓\n"
    assert "\ufffd" not in seen.text("stdout")


def test_output_is_seen_without_a_send_and_read_parts_leave_memory() -> None:
    seen = Seen()
    c = OutputCapture(seen)
    c.start()
    try:
        with _writer(c, "stderr") as err:
            err.write(b"working\n")
            deadline = time.monotonic() + 5
            while seen.text("stderr") != "working\n" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert seen.text("stderr") == "working\n"  # the shared thread drained it

            block = b"x" * 65535 + b"\n"
            for _ in range(64):  # 4 MiB
                err.write(block)
            c.drain()
            fd = int(c.paths["stderr"].rsplit("/", 1)[1])
            st = os.fstat(fd)
            assert st.st_size == 8 + 64 * len(block)  # wasmtime's offset still holds
            assert st.st_blocks * 512 < 1 << 20  # but what was read is no longer kept
    finally:
        c.close()
    assert len(seen.text("stderr")) == 8 + 64 * len(block)


def test_close_hands_on_the_rest_and_frees_the_files() -> None:
    seen = Seen()
    c = OutputCapture(seen)
    fds = [int(p.rsplit("/", 1)[1]) for p in c.paths.values()]
    with _writer(c, "stdout") as out:
        out.write(b"no newline, half a char: " + "✓".encode()[:2])
    c.close()
    c.close()  # twice is harmless
    c.drain()  # and a drain after close does nothing
    assert seen.text("stdout") == "no newline, half a char: \ufffd"
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert "closed" in repr(c)


def test_a_failing_listener_loses_nothing_after_it(caplog) -> None:
    got: list[str] = []

    def listener(stream: str, text: str) -> None:
        got.append(text)
        if len(got) == 1:
            raise RuntimeError("listener broke")

    c = OutputCapture(listener)
    with _writer(c, "stdout") as out:
        out.write(b"one\n")
        c.drain()
        out.write(b"two\n")
        c.drain()
    c.close()
    assert got == ["one\n", "two\n"]
    assert "listener failed" in caplog.text
