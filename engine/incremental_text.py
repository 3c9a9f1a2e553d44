"""The decode of a generation's tokens, kept up to date one token at a time.

A streamed generation needs the whole decoded text after every token (stop strings,
hold-back, deltas). Decoding every id again each time costs O(n) per token, O(n^2) per
generation (a 1,000-token answer decoded 1,000 times). Here each token decodes two short
windows instead. Clean boundaries are places where the text so far did not end in an
unfinished character (U+FFFD) nor inside a run of byte-fallback tokens (SentencePiece's
``<0xHH>``, decoded as one group). With ``settled`` the newest and ``anchor`` the one before,
the text is the text up to ``settled`` plus what ``decode(ids[anchor:])`` adds to
``decode(ids[anchor:settled])``. Both windows start at the same token, so a decoder that
strips a leading space (a SentencePiece ``▁``) strips it from both, and the new tokens keep
theirs. Should a window not extend its head (a decoder that rewrites earlier text), the
whole list is decoded, as before. vLLM and text-generation-
inference stream the same way (prefix and read offsets); this is our own small version.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence


class IncrementalText:
    """``push(token)`` returns the decode of every token pushed so far."""

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        byte_tokens: Collection[int] = (),
        decode_one: Callable[[int], str] | None = None,
    ):
        """``decode_one(t)``: ``decode([t])``, memoised by the caller (a settled head is
        most often one token, decoded on its own once per step)."""
        self._decode = decode
        self._decode_one = decode_one
        self._byte_tokens = byte_tokens
        self.ids: list[int] = []
        self._settled = 0  # the newest clean boundary
        self._settled_text = ""  # the text of ids[:settled]
        self._anchor = 0  # the clean boundary before it
        self._head = ""  # decode(ids[anchor:settled]), decoded on its own as the windows are
        self.full_decodes = 0
        """How often a window did not extend its head and the whole list was decoded."""

    def push(self, token: int) -> str:
        ids = self.ids
        ids.append(token)
        window = self._decode(ids[self._anchor :])
        if window.startswith(self._head):
            text = self._settled_text + window[len(self._head) :]
        else:  # the decoder changed text before the new tokens: decode it all
            self.full_decodes += 1
            text = self._decode(ids)
        if not text.endswith("\ufffd") and token not in self._byte_tokens:
            self._anchor, self._settled, self._settled_text = self._settled, len(ids), text
            one = self._decode_one
            if one is not None and self._anchor == len(ids) - 1:
                self._head = one(token)
            else:
                self._head = self._decode(ids[self._anchor :])
        return text

    def __repr__(self) -> str:
        return f"IncrementalText({len(self.ids)} ids, settled at {self._settled})"
