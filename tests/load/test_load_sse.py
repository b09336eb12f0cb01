"""The SSE decoder on byte-level edge cases."""

from __future__ import annotations

import pytest

from tuner.load.sse import SseDecoder, SseError


def decode(parts: list[bytes]) -> list[bytes]:
    d = SseDecoder()
    out = [p for part in parts for p in d.feed(part)]
    return out + d.close()


def test_events_split_anywhere() -> None:
    raw = b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    for size in (1, 2, 5, len(raw)):
        assert decode([raw[i : i + size] for i in range(0, len(raw), size)]) == [b"one", b"two", b"[DONE]"]


def test_crlf_split_between_cr_and_lf() -> None:
    assert decode([b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n"]) == [b"a", b"b"]


def test_comments_fields_multiline_and_missing_final_blank_line() -> None:
    raw = b": keep-alive\n\nevent: message\nid: 3\ndata: x\ndata: y\n\ndata:z"
    assert decode([raw]) == [b"x\ny", b"z"]


def test_non_sse_line_raises() -> None:
    with pytest.raises(SseError, match="not an SSE line"):
        decode([b'{"object": "text_completion"}\n'])
