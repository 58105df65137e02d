"""Streamed text: whole characters, and nothing at or past a stop string, however tokens split it."""

from __future__ import annotations

from opus.serve.text import TextStream


class CharTokenizer:
    """One token per character of a fixed alphabet; decode joins them (as a byte-level BPE would)."""

    def __init__(self, alphabet: str) -> None:
        self.alphabet = alphabet

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.alphabet[i] for i in ids)

    def ids(self, text: str) -> list[int]:
        return [self.alphabet.index(c) for c in text]


def _stream(text: str, stops: list[str]) -> tuple[list[str], TextStream]:
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz .\n")
    stream = TextStream(tok, stops)
    pieces = []
    for token in tok.ids(text):
        pieces.append(stream.push(token))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return pieces, stream


def test_text_before_a_stop_string_split_across_tokens() -> None:
    pieces, stream = _stream("hello world. more", ["d. m"])
    assert "".join(pieces) == "hello worl" and stream.stopped
    # "d", ". " were held back while they could still start the stop string.
    assert pieces[:5] == ["h", "e", "l", "l", "o"]


def test_held_back_text_is_released_when_it_stops_matching_and_at_the_end() -> None:
    pieces, stream = _stream("an and a", ["and then"])
    assert "".join(pieces) == "an and a" and not stream.stopped
    # "a", "an", "a", "an", "and", "and " could each begin "and then": held until they cannot.
    assert pieces == ["", "", "an ", "", "", "", "", "and ", "a"]


def test_the_earliest_of_several_stops_wins() -> None:
    pieces, _ = _stream("one two three", ["three", "two"])
    assert "".join(pieces) == "one "


def test_no_stops_streams_every_token() -> None:
    pieces, _ = _stream("abc", [])
    assert pieces == ["a", "b", "c", ""]
