"""Tokens to text as they arrive: incremental detokenisation and stop strings.

A token may end inside a multi-byte character, so text is released only once its decoding no longer ends in
U+FFFD; and text that could be the start of a stop string is held back until the next tokens settle it. The
stop string itself is never sent (OpenAI's behaviour), and the request ends there.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    """The text of one request's generated tokens, released chunk by chunk.

    Detokenisation is incremental, as vLLM's detokenizer does it: each feed decodes only the tokens from
    `prefix` on (those already settled and the new ones) and keeps what the new ones add, so a stream of n
    tokens decodes O(n) tokens in all, not O(n^2). Decoding from a settled token boundary gives the same text
    as the tail of a whole decode for the byte-level and SentencePiece tokenizers we serve, since the prefix
    window is decoded both with and without the new tokens and only the difference is kept."""

    def __init__(self, tokenizer, stop: list[str], eos: set[int]) -> None:
        self.tokenizer, self.stop, self.eos = tokenizer, stop, eos
        self.tokens: list[int] = []  # generated tokens, EOS ids left out
        self.prefix = 0  # tokens[prefix:settled] is the window decoded again for context
        self.settled = 0  # tokens before this index are in `text`
        self.text = ""  # the decoded text of tokens[:settled]
        self.sent = 0  # characters of `text` already released
        self.stopped = False

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _settle(self, final: bool) -> None:
        """Append the text that tokens[settled:] add, unless it still ends inside a multi-byte character and
        more tokens may follow."""
        if self.settled == len(self.tokens):
            return
        before = self._decode(self.tokens[self.prefix:self.settled])
        after = self._decode(self.tokens[self.prefix:])
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return
        self.text += after[len(before):]
        self.prefix, self.settled = self.settled, len(self.tokens)

    def feed(self, tokens: list[int], final: bool) -> str:
        """Add tokens; returns the text now safe to release (all of it when `final`). Once a stop string
        appears, `stopped` is set, the text before it is the last released, and later calls release nothing."""
        if self.stopped:
            return ""
        self.tokens.extend(t for t in tokens if t not in self.eos)
        self._settle(final)
        text = self.text
        end = self._stop_at(text)
        if end is not None:
            self.stopped = True
        else:
            end = len(text)
            if not final:
                end = self._held(text, len(text.rstrip(REPLACEMENT)))
        chunk = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return chunk

    def _stop_at(self, text: str) -> int | None:
        """Where the earliest stop string begins in text not yet released (held-back text included)."""
        found = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held(self, text: str, end: int) -> int:
        """Where released text must end so that no stop string can still begin in what follows."""
        for k in range(min(end, max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            tail = text[end - k:end]
            if any(s.startswith(tail) for s in self.stop):
                return end - k
        return end
