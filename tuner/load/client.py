"""One streamed request, measured: TTFT, every inter-token gap, e2e, token counts — or the class of its failure.

Nothing the server does raises out of `send_request`: a failure is a record with `error_class` set. A reply with
fewer tokens than the request pinned (vLLM 0.32 shortens the output to fit max_model_len and answers 200 with
finish_reason "length") is a failure too, `short_output`: its tokens are not the work that was asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from tuner.clock import Clock
from tuner.load.connections import on_wire
from tuner.load.results import FailureClass, RequestRecord
from tuner.load.sse import SseDecoder, SseError

__all__ = ["send_request"]

_MAX_ERROR_BODY = 4096
_SLICE = 32
_decode = json.JSONDecoder().decode
_MAX_MESSAGE = 300
_DRAIN_WALL_S = 0.5


class _Failure(Exception):
    def __init__(self, cls: FailureClass, message: str) -> None:
        super().__init__(message)
        self.cls: FailureClass = cls
        self.message = message


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    clock: Clock,
    timeout_s: float,
    index: int,
    origin: float,
    warmup: bool = False,
    chat: bool = False,
    expect_output: int | None = None,
    reply: list[str] | None = None,
) -> RequestRecord:
    """POST `body` to `url` as a stream; times in the clock's (emulated) seconds, `start_s` relative to `origin`.

    `timeout_s` bounds the whole request (emulated seconds: converted to wall seconds for the transport).
    `expect_output`: the output length the body pinned; a reply the server counts shorter is `short_output`.
    `reply`, when given, receives the streamed text piece by piece (a conversation's next turn carries it).
    """
    wall_timeout = clock.to_wall(timeout_s)
    state = _StreamState(chat, reply)
    try:
        # Built before the clock starts: encoding the body is the client's work, not the server's latency.
        request = client.build_request("POST", url, json=body, timeout=httpx.Timeout(wall_timeout))
    except Exception as e:
        now = clock.now()
        return _record(index, now, origin, now, state, warmup, "other", f"{type(e).__name__}: {e}")
    start = clock.now()

    def sent() -> None:
        state.sent = clock.now()

    try:
        async with asyncio.timeout(wall_timeout):
            with on_wire(sent):
                await _stream(client, request, clock, state)
    except _Failure as f:
        return _record(index, start, origin, clock.now(), state, warmup, f.cls, f.message)
    except (TimeoutError, httpx.TimeoutException):
        where = "before the first token" if state.first is None else f"after {state.events} tokens"
        msg = f"no complete reply within {timeout_s:g}s ({where})"
        return _record(index, start, origin, clock.now(), state, warmup, "timeout", msg)
    except httpx.ConnectError as e:
        return _record(index, start, origin, clock.now(), state, warmup, "connection_refused", _text(e, url))
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.CloseError) as e:
        if state.headers:
            msg = f"stream cut after {state.events} tokens: {_text(e, url)}"
            return _record(index, start, origin, clock.now(), state, warmup, "stream_cut", msg)
        return _record(index, start, origin, clock.now(), state, warmup, "connection_reset", _text(e, url))
    except Exception as e:  # a bad server must never crash the generator
        return _record(index, start, origin, clock.now(), state, warmup, "other", f"{type(e).__name__}: {e}")
    end = state.end if state.end is not None else clock.now()
    short = _short(state, expect_output)
    if short is not None:
        return _record(index, start, origin, end, state, warmup, "short_output", short)
    return _record(index, start, origin, end, state, warmup, None, None)


def _short(state: _StreamState, expect_output: int | None) -> str | None:
    """Why the reply is shorter than pinned, or None. Only the server's own count is trusted (chunks may batch)."""
    got = (state.usage or {}).get("completion_tokens")
    if expect_output is None or not isinstance(got, int) or got >= expect_output:
        return None
    return f"asked {expect_output} output tokens, got {got} (finish_reason {state.finish_reason or 'not given'})"


class _StreamState:
    __slots__ = (
        "chat", "done", "end", "events", "finish_reason", "first", "gaps", "headers", "last", "reply", "sent",
        "usage",
    )  # fmt: skip

    def __init__(self, chat: bool, reply: list[str] | None = None) -> None:
        self.chat = chat
        self.reply = reply
        self.headers = False
        self.first: float | None = None
        self.last = 0.0
        self.gaps: list[float] = []
        self.events = 0
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.end: float | None = None  # when [DONE] was read: the drain after it is not the server's latency
        self.finish_reason: str | None = None
        self.sent: float | None = None  # when the request was on the wire, where the transport says (on_wire)


async def _stream(client: httpx.AsyncClient, request: httpx.Request, clock: Clock, state: _StreamState) -> None:
    response = await client.send(request, stream=True)
    try:
        state.headers = True
        if response.status_code >= 400:
            raw = b""
            async for part in response.aiter_bytes():
                raw += part
                if len(raw) >= _MAX_ERROR_BODY:
                    break
            cls: FailureClass = "http_5xx" if response.status_code >= 500 else "http_4xx"
            raise _Failure(cls, f"HTTP {response.status_code}: {_server_message(raw)}")
        decoder = SseDecoder()
        chunks = response.aiter_bytes()
        async for chunk in chunks:
            now = clock.now()
            try:
                payloads = decoder.feed(chunk)
            except SseError as e:
                raise _Failure("malformed_sse", str(e)) from None
            # A large read (a server that writes a whole reply at once) is handled in slices, yielding between
            # them, so other requests' first tokens are not timestamped late behind it.
            for i in range(0, len(payloads), _SLICE):
                if i:
                    await asyncio.sleep(0)
                if _handle(payloads[i : i + _SLICE], now, state):
                    state.end = now
                    await _drain(chunks)
                    return
        try:
            payloads = decoder.close()
        except SseError as e:
            raise _Failure("malformed_sse", str(e)) from None
        now = clock.now()
        if _handle(payloads, now, state):
            state.end = now
            return
        raise _Failure("stream_cut", f"stream ended after {state.events} tokens without data: [DONE]")
    finally:
        await response.aclose()


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """Read what follows [DONE] (a chunked reply's terminator) so httpx returns the connection to its pool.

    Closing a reply before its end closes the connection: every next request would pay a TCP connect (about a
    millisecond here) inside its TTFT. A server that keeps the stream open after [DONE] costs only that connection.
    """
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_DRAIN_WALL_S):
            async for _ in chunks:
                pass


def _handle(payloads: list[bytes], now: float, state: _StreamState) -> bool:
    """Account the events of one read (they arrived together, so they share its time); True at [DONE]."""
    for data in payloads:
        if data == b"[DONE]":
            state.done = True
            return True
        try:
            # str decoding + the decoder directly: json.loads(bytes) would sniff the encoding of every chunk.
            obj = _decode(data.decode("utf-8", "replace"))
        except ValueError:
            raise _Failure("malformed_sse", f"event data is not JSON: {data[:80]!r}") from None
        if not isinstance(obj, dict):
            raise _Failure("malformed_sse", f"event data is not a JSON object: {data[:80]!r}")
        if "error" in obj:
            raise _stream_error(obj["error"])
        usage = obj.get("usage")
        if isinstance(usage, dict):
            state.usage = usage
        choices = obj.get("choices")
        if choices and isinstance(choices, list) and _is_token(choices[0], state.chat, state):
            if state.first is None:
                state.first = now
            else:
                state.gaps.append(now - state.last)
            state.last = now
            state.events += 1
    return False


def _is_token(choice: object, chat: bool, state: _StreamState) -> bool:
    if not isinstance(choice, dict):
        raise _Failure("malformed_sse", f"choice is not a JSON object: {str(choice)[:80]}")
    reason = choice.get("finish_reason")
    if isinstance(reason, str):
        state.finish_reason = reason
    if chat:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return False
        content = delta.get("content")
        if state.reply is not None and isinstance(content, str):
            state.reply.append(content)
        # vLLM's first chat chunk carries only the role, with empty content: not a token.
        return isinstance(content, str) and (content != "" or ("role" not in delta and not choice.get("finish_reason")))
    text = choice.get("text")
    if state.reply is not None and isinstance(text, str):
        state.reply.append(text)
    return isinstance(text, str) and (text != "" or not choice.get("finish_reason"))


def _stream_error(err: object) -> _Failure:
    code: object = None
    msg: object = err
    if isinstance(err, dict):
        code = err.get("code")
        msg = err.get("message", err)
    cls: FailureClass = "http_4xx" if isinstance(code, int) and 400 <= code < 500 else "http_5xx"
    return _Failure(cls, f"error in stream: {str(msg)[:_MAX_MESSAGE]}")


def _server_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
    except ValueError:
        text = raw.decode("utf-8", errors="replace").strip()
        return (text or "(empty body)")[:_MAX_MESSAGE]
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:_MAX_MESSAGE]
        for key in ("message", "detail", "error"):
            if key in obj:
                return str(obj[key])[:_MAX_MESSAGE]
    return str(obj)[:_MAX_MESSAGE]


def _text(e: BaseException, url: str) -> str:
    detail = str(e) or type(e).__name__
    return f"{url}: {detail}"[:_MAX_MESSAGE]


def _record(
    index: int,
    start: float,
    origin: float,
    end: float,
    state: _StreamState,
    warmup: bool,
    cls: FailureClass | None,
    message: str | None,
) -> RequestRecord:
    # The server's time starts when the request is on the wire; before that it waited in this client.
    start = state.sent if state.sent is not None else start
    usage = state.usage or {}
    prompt_tokens = usage.get("prompt_tokens")
    completion_tokens = usage.get("completion_tokens")
    from_server = isinstance(completion_tokens, int)
    return RequestRecord(
        index=index,
        start_s=start - origin,
        ttft_s=None if state.first is None else state.first - start,
        itl_s=state.gaps,
        e2e_s=end - start,
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else 0,
        completion_tokens=completion_tokens if isinstance(completion_tokens, int) else state.events,
        ok=cls is None,
        error_class=cls,
        error_message=message,
        warmup=warmup,
        usage_from_server=from_server,
    )
