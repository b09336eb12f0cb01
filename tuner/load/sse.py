"""Incremental Server-Sent Events decoding of a byte stream into `data:` payloads (the subset OpenAI servers use)."""

from __future__ import annotations

__all__ = ["SseDecoder", "SseError"]

_FIELDS = (b"event:", b"id:", b"retry:")


class SseError(ValueError):
    """The bytes are not an event stream."""


class SseDecoder:
    """Feed bytes as they arrive; get the data payloads of the events completed by them.

    Events end at a blank line. Multi-line data is joined with newlines; comments (`:`) and the other fields
    (event, id, retry) are ignored, as the SSE spec allows; any other line is not SSE and raises SseError.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        hold = b""
        if b"\r" in buf:
            if buf.endswith(b"\r"):
                # Its \n may be in the next chunk: decide then, or a CRLF split in two would read as a blank line.
                buf, hold = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events = buf.split(b"\n\n")
        self._buf = events.pop() + hold
        out: list[bytes] = []
        for event in events:
            # The fast path is every event an OpenAI server sends: one `data: ...` line.
            if event.startswith(b"data: ") and b"\n" not in event:
                out.append(event[6:])
            elif event:
                data = _parse_event(event)
                if data is not None:
                    out.append(data)
        return out

    def close(self) -> list[bytes]:
        """At end of stream: an event whose blank line never came still counts (servers often omit it)."""
        rest, self._buf = self._buf.replace(b"\r", b"\n").strip(b"\n"), b""
        if not rest:
            return []
        return [p for event in rest.split(b"\n\n") if event and (p := _parse_event(event)) is not None]


def _parse_event(event: bytes) -> bytes | None:
    data: list[bytes] = []
    for line in event.strip(b"\n").split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        elif not line or line.startswith(b":") or line.startswith(_FIELDS):
            continue
        else:
            raise SseError(f"not an SSE line: {line[:80]!r}")
    return b"\n".join(data) if data else None
