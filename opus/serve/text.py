"""Token ids to text as they arrive: whole characters only, and never past a stop string.

Decoding the new tokens alone breaks words a tokenizer splits mid-character (or merges with a
leading space), so the text is decoded from the first generated token on and only its new suffix
is handed out. A stop string may arrive split across tokens: the text that could still be the start
of one is held back until it is known not to be.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stops: list[str], skip: frozenset[int] = frozenset()) -> None:
        self.tokenizer, self.stops, self.skip = tokenizer, stops, skip
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text handed out
        self.stopped = False

    def push(self, token: int) -> str:
        """The text that can be handed out now that ``token`` arrived ('' while held back)."""
        if token not in self.skip:
            self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stops:
            at = text.find(stop, max(0, self.sent - len(stop) + 1))
            if at != -1:
                self.stopped = True
                return self._take(text[:at])
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the rest
            return ""
        hold = max((_partial(text, stop) for stop in self.stops), default=0)
        return self._take(text[: len(text) - hold])

    def finish(self) -> str:
        """What was held back, once no more tokens come (unless a stop string ended the text)."""
        if self.stopped:
            return ""
        return self._take(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _take(self, upto: str) -> str:
        out = upto[self.sent:]
        self.sent = max(self.sent, len(upto))
        return out


def _partial(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``stop``."""
    for size in range(min(len(stop) - 1, len(text)), 0, -1):
        if stop.startswith(text[-size:]):
            return size
    return 0
