"""Fake servers for the load tests: httpx.MockTransport handlers, and raw loopback servers that misbehave."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, ParamSpec

import httpx
import looptime

from tuner.clock import Clock


def chunk(text: str = "x", *, chat: bool = False) -> bytes:
    if chat:
        return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode() + b"\n\n"
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


def usage_chunk(prompt: int, completion: int) -> bytes:
    body = {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def sse(tokens: int, *, prompt: int = 8, usage: bool = True, done: bool = True, chat: bool = False) -> bytes:
    out = b"".join(chunk(chat=chat) for _ in range(tokens))
    if usage:
        out += usage_chunk(prompt, tokens)
    return out + (DONE if done else b"")


class LoopClock(Clock):
    """The running loop's time as the clock: under `fake_time` it is looptime's fake time, which moves only when
    every task waits, so what a test measures is what the code scheduled, whatever the machine's load."""

    def now(self) -> float:
        return asyncio.get_running_loop().time() * self.scale


P = ParamSpec("P")


def fake_time(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """Runs an async test on its own looptime loop (fake time from 0), closed after it.

    Not looptime's pytest plugin (disabled in pyproject.toml): on Python 3.11 it makes an event loop for every sync
    test and never closes it, which fails a later test with an unraisable ResourceWarning.
    """

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        loop = looptime.new_event_loop(start=0.0)
        try:
            loop.run_until_complete(test(*args, **kwargs))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    return run


class FakeVllm:
    """A MockTransport server: each request streams `max_tokens` chunks, `token_s` wall seconds apart.

    Counts requests in flight (from the handler's start to the end of its stream) and their peak.
    """

    def __init__(self, *, token_s: float = 0.0, ttft_s: float = 0.0, slots: int | None = None) -> None:
        self.token_s = token_s
        self.ttft_s = ttft_s
        self.in_flight = 0
        self.peak = 0
        self.bodies: list[dict[str, object]] = []
        self.arrivals: list[float] = []
        self.slots = asyncio.Semaphore(slots) if slots else None
        self.metrics_text: str | None = None

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            if self.metrics_text is None:
                return httpx.Response(404)
            return httpx.Response(200, text=self.metrics_text)
        if not request.url.path.startswith("/v1/"):  # no /tokenize: prompts go unfitted
            return httpx.Response(404)
        body = json.loads(request.content)
        self.bodies.append(body)
        self.arrivals.append(asyncio.get_running_loop().time())
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        n = int(body.get("max_tokens", 4))
        chat = "messages" in body

        finished = False

        def finish() -> None:
            # Once, at the last byte or when the client goes away (MockTransport may never close the generator).
            nonlocal finished
            if not finished:
                finished = True
                self.in_flight -= 1
                if self.slots is not None:
                    self.slots.release()

        async def stream() -> AsyncIterator[bytes]:
            try:
                if self.slots is not None:
                    await self.slots.acquire()
                await asyncio.sleep(self.ttft_s)
                for i in range(n):
                    if i:
                        await asyncio.sleep(self.token_s)
                    yield chunk(chat=chat)
                yield usage_chunk(len(body.get("prompt", [])), n)
                finish()
                yield DONE
            finally:
                finish()

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handler), base_url="http://fake")


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


_OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class BrokenServer:
    """A real loopback HTTP server whose replies cycle through `modes`, one per request.

    Modes: ok, http_500, http_400, cut (stream ends before [DONE]), garbage (not SSE), stall (never answers),
    reset (closes the connection before any response), linger (a whole reply through [DONE] whose stream is then
    held open for `stall_s`). `connections` counts the TCP connections accepted.
    """

    def __init__(self, modes: list[str], *, tokens: int = 4, stall_s: float = 30.0) -> None:
        self.modes = modes
        self.tokens = tokens
        self.stall_s = stall_s
        self.count = 0
        self.connections = 0
        self.metrics_text: str | None = None
        self._tasks: set[asyncio.Task[object]] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            while True:
                try:
                    head_and_body = await _read_request_with_path(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                target, _body = head_and_body
                path = target.partition("?")[0]  # routed by path, as a server is: the scrape sends a query
                if path == "/metrics":
                    text = (self.metrics_text or "").encode()
                    status = b"200 OK" if self.metrics_text is not None else b"404 Not Found"
                    writer.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status, len(text), text))
                    await writer.drain()
                    continue
                if not path.startswith("/v1/"):  # no /tokenize: its probe must not use up a mode
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                mode = self.modes[self.count % len(self.modes)]
                self.count += 1
                if not await self._reply(mode, writer):
                    return
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _reply(self, mode: str, writer: asyncio.StreamWriter) -> bool:
        """Write one reply; False when the connection is to be closed."""
        if mode == "ok":
            writer.write(_OK_HEAD + _chunked(sse(self.tokens)) + b"0\r\n\r\n")
        elif mode in ("http_500", "http_400"):
            code = 500 if mode == "http_500" else 400
            body = json.dumps({"error": {"message": f"fake {code} error", "code": code}}).encode()
            reason = b"Internal Server Error" if code == 500 else b"Bad Request"
            writer.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (code, reason, len(body), body)
            )
        elif mode == "cut":
            writer.write(_OK_HEAD + _chunked(sse(self.tokens, usage=False, done=False)))
            await writer.drain()
            return False
        elif mode == "garbage":
            writer.write(_OK_HEAD + _chunked(b"<html>oops</html>\n\n") + b"0\r\n\r\n")
        elif mode == "linger":
            writer.write(_OK_HEAD + _chunked(sse(self.tokens)))
            await writer.drain()
            await asyncio.sleep(self.stall_s)
            return False
        elif mode == "stall":
            await asyncio.sleep(self.stall_s)
            return False
        elif mode == "reset":
            return False
        await writer.drain()
        return True

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.close()
            # Stalled handlers are cancelled, not waited for, so the server stops at once.
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()


async def _read_request_with_path(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    first = head.split(b"\r\n", 1)[0].split(b" ")
    path = first[1].decode() if len(first) > 1 else "/"
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await reader.readexactly(length) if length else b""
    return path, body


class WordServer:
    """A MockTransport vLLM with a tokenizer of its own: words split on spaces, each known word one token.

    `vocab` words have ids from `first_id` on (lower ids are specials, which decode to markup); any other word is
    `<unk>` (id 0). `merge` joins every pair of words into one token (a tokenizer counting across spaces);
    `template` is the chat template's tokens around one message, `template_per_word` more for each 32 words (a
    template whose length varies). Completions of token ids outside the vocabulary answer vLLM's 400; replies
    carry `usage` with the prompt as this tokenizer counts it, and `short_by` fewer tokens than max_tokens.
    """

    SPECIALS = ("<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>")

    def __init__(
        self,
        vocab: list[str],
        *,
        first_id: int = 5,
        template: int = 2,
        template_per_word: bool = False,
        merge: bool = False,
        tokenize: bool = True,
        short_by: int = 0,
    ) -> None:
        self.ids = {w: first_id + i for i, w in enumerate(vocab)}
        self.words = {i: w for w, i in self.ids.items()} | dict(enumerate(self.SPECIALS))
        self.size = first_id + len(vocab)
        self.template = template
        self.template_per_word = template_per_word
        self.merge = merge
        self.has_tokenize = tokenize
        self.short_by = short_by
        self.prompt_tokens: list[int] = []

    def encode(self, text: str) -> list[int]:
        ids = [self.ids.get(w, 0) for w in text.split()]
        return ids[::2] if self.merge else ids

    def chat_len(self, content: str) -> int:
        n = len(self.encode(content))
        return n + self.template + (n // 32 if self.template_per_word else 0)

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        if body.get("model") not in (None, "m"):
            return httpx.Response(404, json={"error": {"message": f"The model `{body['model']}` does not exist."}})
        if path in ("/tokenize", "/detokenize") and not self.has_tokenize:
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/tokenize":
            if "messages" in body:
                tokens = [3] * self.chat_len(body["messages"][0]["content"])
            else:
                tokens = self.encode(body["prompt"])
            return httpx.Response(200, json={"count": len(tokens), "max_model_len": 1024, "tokens": tokens})
        if path == "/detokenize":
            return httpx.Response(200, json={"prompt": " ".join(self.words.get(i, "") for i in body["tokens"]).strip()})
        if path in ("/v1/completions", "/v1/chat/completions"):
            chat = "messages" in body
            if chat:
                n_prompt = self.chat_len(body["messages"][0]["content"])
            else:
                prompt = body["prompt"]
                if isinstance(prompt, list):
                    bad = [i for i in prompt if not 0 <= i < self.size]
                    if bad:
                        return httpx.Response(
                            400, json={"error": {"message": f"Token id {max(bad)} is out of vocabulary"}}
                        )
                n_prompt = len(prompt) if isinstance(prompt, list) else len(self.encode(prompt))
            self.prompt_tokens.append(n_prompt)
            n = int(body["max_tokens"]) - self.short_by
            end = (
                b"data: "
                + json.dumps(
                    {"choices": [{"index": 0, "text": "", "delta": {"content": ""}, "finish_reason": "length"}]}
                ).encode()
                + b"\n\n"
            )
            return httpx.Response(
                200,
                content=b"".join(chunk(chat=chat) for _ in range(n)) + end + usage_chunk(n_prompt, n) + DONE,
                headers={"content-type": "text/event-stream"},
            )
        return httpx.Response(404)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handler))


def made_up_words(n: int) -> list[str]:
    """Words no English text holds: a word-level vocabulary like the real-vLLM tests' tiny model's."""
    syllables = ["ka", "lo", "mi", "nu", "pe", "ra", "si", "to"]
    return [a + b + c for a in syllables for b in syllables for c in syllables][:n]
