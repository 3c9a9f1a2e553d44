"""``pie:core/session``: the run's client. ``send`` / ``send-file`` go to the launcher
(HTTP run events, Pie-protocol ``message`` / ``file`` messages); ``receive`` /
``receive-file`` are futures of what the launcher posts (``InferletRun.post`` /
``post_file``); with no launcher, or once its input is closed, they fail."""

from __future__ import annotations

from typing import Any

from inferlets.host.binding import Interface, wit
from inferlets.host.pie_core.types import FutureBlob, FutureString, done_future


class Session(Interface):
    NAME = "pie:core/session"

    @wit("send")
    def send(self, message: str) -> None:
        st = self.host.state
        st.flush_output()
        st.on_send(st.text(message, "a sent message"))

    @wit("send-file")
    def send_file(self, data: bytes) -> None:
        st = self.host.state
        st.buffer(data, "a sent file")
        st.flush_output()
        on_file = getattr(st, "on_file", None)
        if on_file is None:
            raise RuntimeError("this run has no client to send files to")
        on_file(bytes(data))

    def _closed(self, what: str) -> Any:
        raise EOFError(f"the client's input is closed: no more {what} will come")

    @wit("receive")
    def receive(self) -> FutureString:
        control = self.host.state.control
        fut = control.message_future() if control is not None else done_future(None)
        return FutureString(fut, self.host, lambda v: v if v is not None else self._closed("messages"))

    @wit("receive-file")
    def receive_file(self) -> FutureBlob:
        control = self.host.state.control
        fut = control.file_future() if control is not None else done_future(None)
        return FutureBlob(fut, self.host, lambda v: v if v is not None else self._closed("files"))
