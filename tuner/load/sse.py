"""Incremental Server-Sent Events decoding of a byte stream into `data:` payloads (the subset OpenAI servers use)."""

from __future__ import annotations

__all__ = ["SseDecoder", "SseError"]


class SseError(ValueError):
    """The bytes are not an event stream."""


class SseDecoder:
    """Feed bytes as they arrive; get the data payloads of the events completed by them.

    Events end at a blank line. Multi-line data is joined with newlines; comments (`:`) and other fields
    (event, id, retry) are ignored, as the SSE spec allows.
    """

    __slots__ = ("_buf", "_data")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        hold = b""
        if b"\r" in buf:
            if buf.endswith(b"\r"):
                # Its \n may be in the next chunk: decide then, or a CRLF split in two would read as a blank line.
                buf, hold = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        out: list[bytes] = []
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            elif line.startswith(b":") or line.startswith((b"event:", b"id:", b"retry:")):
                continue
            else:
                raise SseError(f"not an SSE line: {line[:80]!r}")
        self._buf = buf[start:] + hold
        return out

    def close(self) -> list[bytes]:
        """Flush at end of stream: an event whose blank line never came still counts (servers often omit it)."""
        out = self.feed(b"\n\n") if self._buf else []
        if self._data:
            out.append(b"\n".join(self._data))
            self._data = []
        return out

    @property
    def pending(self) -> bool:
        return bool(self._buf.strip()) or bool(self._data)
