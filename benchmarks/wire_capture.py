"""The wire's view of streamed OpenAI requests: a loopback packet capture read back into per-request timings.

Reads a pcap (tcpdump -i lo, nanosecond timestamps; dpkt decodes the file, Ethernet, IP and TCP), puts each TCP
direction's bytes back in order, and reads HTTP/1.1 off them: every request's first and last byte on the wire and its
prompt (the key a client's own records are matched by), and in its reply (chunked or not) the moment each SSE event
carrying content was complete on the wire (the segment holding the event's last byte). On loopback a packet is
stamped when the sender's kernel passes it on, so these are the moments a client's write and the server's write
left their processes: what neither client's clock can see.

Standalone (dpkt only): run by the agreement benchmark with the Python of its own venv.

    python benchmarks/wire_capture.py CAPTURE.pcap --port 8000 > requests.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

import dpkt

__all__ = ["WireRequest", "read_capture"]


@dataclass
class WireRequest:
    conn: str
    """The connection: the client's end, and a number (a port may come round again)."""
    sent_ns: int
    """The request's first byte on the wire."""
    sent_end_ns: int
    """Its last byte (the end of the body)."""
    prompt: str
    status: int = 0
    content_ns: list[int] = field(default_factory=list)
    """Each SSE event with content (a token): when its last byte was on the wire."""
    done_ns: int | None = None
    """When `data: [DONE]` was."""


class _Stream:
    """One direction of a TCP connection: payload bytes in sequence order, and when each segment was seen."""

    def __init__(self) -> None:
        self.isn: int | None = None
        self.segments: dict[int, tuple[int, bytes]] = {}  # relative seq -> (first time seen, payload)

    def add(self, ts_ns: int, tcp: dpkt.tcp.TCP) -> None:
        if tcp.flags & dpkt.tcp.TH_SYN:
            self.isn = tcp.seq
            return
        if not tcp.data or self.isn is None:
            return
        rel = (tcp.seq - self.isn - 1) % (1 << 32)
        self.segments.setdefault(rel, (ts_ns, bytes(tcp.data)))  # a retransmission keeps the first sighting

    def assemble(self) -> tuple[bytes, list[int], list[int]]:
        """The bytes, and per segment its start offset and timestamp (sorted by offset)."""
        data = bytearray()
        starts: list[int] = []
        times: list[int] = []
        for rel in sorted(self.segments):
            ts, payload = self.segments[rel]
            if rel > len(data):  # a hole: the capture dropped a segment; what follows cannot be placed
                break
            fresh = payload[len(data) - rel :]
            if fresh:
                starts.append(len(data))
                times.append(ts)
                data += fresh
        return bytes(data), starts, times


def _time_at(offset: int, starts: list[int], times: list[int]) -> int:
    return times[bisect.bisect_right(starts, offset) - 1]


def read_capture(path: str, port: int) -> list[WireRequest]:
    """Every complete request/reply on connections to `port`, in order of their first byte."""
    # A client port comes round again (a client that opens a connection a request, the server closing first):
    # a SYN on a 4-tuple already seen starts a new connection.
    conns: list[tuple[str, _Stream, _Stream]] = []
    current: dict[tuple[bytes, int, bytes, int], tuple[_Stream, _Stream]] = {}
    with open(path, "rb") as f:
        reader = dpkt.pcap.Reader(f)
        if reader.datalink() != dpkt.pcap.DLT_EN10MB:
            raise SystemExit(f"{path}: link type {reader.datalink()}, expected Ethernet (capture with -i lo)")
        for ts, buf in reader:
            ip = dpkt.ethernet.Ethernet(buf).data
            if not isinstance(ip, dpkt.ip.IP | dpkt.ip6.IP6) or not isinstance(ip.data, dpkt.tcp.TCP):
                continue
            tcp = ip.data
            if tcp.dport == port:
                key, upward = (ip.src, tcp.sport, ip.dst, tcp.dport), True
            elif tcp.sport == port:
                key, upward = (ip.dst, tcp.dport, ip.src, tcp.sport), False
            else:
                continue
            if (upward and tcp.flags & dpkt.tcp.TH_SYN and not tcp.flags & dpkt.tcp.TH_ACK) or key not in current:
                current[key] = (_Stream(), _Stream())
                conns.append((f"{_addr(key[0])}:{key[1]}#{len(conns)}", *current[key]))
            up, down = current[key]
            (up if upward else down).add(int(ts * 1_000_000_000), tcp)
    out: list[WireRequest] = []
    for conn, up, down in conns:
        out += _connection(conn, up.assemble(), down.assemble())
    out.sort(key=lambda r: r.sent_ns)
    return out


def _addr(raw: bytes) -> str:
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def _connection(
    conn: str, up: tuple[bytes, list[int], list[int]], down: tuple[bytes, list[int], list[int]]
) -> list[WireRequest]:
    """HTTP/1.1 without pipelining: the n-th reply on a connection answers its n-th request."""
    requests = list(_requests(conn, *up))
    replies = _replies(*down)
    for req, (status, content, done) in zip(requests, replies, strict=False):
        req.status, req.content_ns, req.done_ns = status, content, done
    return [r for r in requests[: len(replies)] if r.done_ns is not None]


def _requests(conn: str, data: bytes, starts: list[int], times: list[int]) -> Any:
    pos = 0
    while (head_end := data.find(b"\r\n\r\n", pos)) >= 0:
        headers = _headers(data[pos:head_end])
        end = head_end + 4 + int(headers.get("content-length", "0"))
        if end > len(data):
            return
        body = data[head_end + 4 : end]
        yield WireRequest(
            conn=conn,
            sent_ns=_time_at(pos, starts, times),
            sent_end_ns=_time_at(end - 1, starts, times),
            prompt=_prompt(body),
        )
        pos = end


def _headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _prompt(body: bytes) -> str:
    """The request's prompt text: `prompt`, or the first message's content (a string or a list of text parts)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return ""
    if "prompt" in obj:
        return str(obj["prompt"])
    content = (obj.get("messages") or [{}])[0].get("content", "")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _replies(data: bytes, starts: list[int], times: list[int]) -> list[tuple[int, list[int], int | None]]:
    """Per reply: status, the content events' times, [DONE]'s time."""
    out: list[tuple[int, list[int], int | None]] = []
    pos = 0
    while (head_end := data.find(b"\r\n\r\n", pos)) >= 0:
        head = data[pos:head_end]
        status = int(head.split(b" ", 2)[1])
        headers = _headers(head)
        pos = head_end + 4
        # Body bytes as pieces: (raw offset of the piece's first byte, bytes).
        pieces: list[tuple[int, bytes]] = []
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                line_end = data.find(b"\r\n", pos)
                if line_end < 0:
                    return out
                size = int(data[pos:line_end].split(b";")[0], 16)
                if size == 0:
                    pos = line_end + 4  # the last chunk and the blank line after it (no trailers here)
                    break
                pieces.append((line_end + 2, data[line_end + 2 : line_end + 2 + size]))
                pos = line_end + 2 + size + 2
                if pos > len(data):
                    return out
        else:
            length = int(headers.get("content-length", "0"))
            pieces.append((pos, data[pos : pos + length]))
            pos += length
        content, done = _events(pieces, starts, times)
        out.append((status, content, done))
    return out


def _events(pieces: list[tuple[int, bytes]], starts: list[int], times: list[int]) -> tuple[list[int], int | None]:
    """SSE events over a body given as pieces; each complete when its blank line's last byte was on the wire."""
    content: list[int] = []
    done: int | None = None
    buf = b""
    for raw_start, piece in pieces:
        base = len(buf)
        buf += piece
        search = max(0, base - 1)
        while (end := buf.find(b"\n\n", search)) >= 0:
            event, buf = buf[:end], buf[end + 2 :]
            last = end + 1 - base  # the terminator's last byte, in this piece
            ts = _time_at(raw_start + max(last, 0), starts, times)
            base -= end + 2
            search = 0
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = ts
                elif _has_content(data):
                    content.append(ts)
    return content, done


def _has_content(data: bytes) -> bool:
    try:
        obj = json.loads(data)
    except ValueError:
        return False
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not choices:
        return False
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
    return isinstance(text, str) and text != ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture")
    ap.add_argument("--port", type=int, required=True, help="the server's port")
    args = ap.parse_args()
    json.dump([r.__dict__ for r in read_capture(args.capture, args.port)], sys.stdout)


if __name__ == "__main__":
    main()
