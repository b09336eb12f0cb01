"""Conversation workloads: each turn carries the conversation so far, waits for the answer and the think time, keeps
its user; the figures split TTFT by turn; ShareGPT files give their human turns in order."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from load_fakes import DONE, LoopClock, chunk, fake_time, usage_chunk
from pydantic import ValidationError

from tuner.errors import ConfigError
from tuner.load import Arrival, RequestRecord, Workload, run_load
from tuner.load.conversation import ConversationSpec, load_sharegpt_conversations, turn_figures

TTFT_S = 1.0
TOKEN_S = 0.5


class ChatServer:
    """A MockTransport chat server whose answers say which request they answer ("a3 a3 ..."), so a later turn's
    history shows whose answer it carries; the first token after TTFT_S, the next TOKEN_S apart (fake time)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.arrivals: list[float] = []
        self.ends: list[float] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if not request.url.path.startswith("/v1/"):
            return httpx.Response(404)
        body = json.loads(request.content)
        n = len(self.bodies)
        self.bodies.append(body)
        self.arrivals.append(asyncio.get_running_loop().time())
        self.ends.append(-1.0)
        tokens = int(body["max_tokens"])

        async def stream() -> AsyncIterator[bytes]:
            await asyncio.sleep(TTFT_S)
            for i in range(tokens):
                if i:
                    await asyncio.sleep(TOKEN_S)
                yield chunk(f" a{n}" if i else f"a{n}", chat=True)
            self.ends[n] = asyncio.get_running_loop().time()
            yield usage_chunk(10, tokens) + DONE

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handler))


def conversation_workload(**spec: Any) -> Workload:
    return Workload(conversations=ConversationSpec(**{"turns": 3, "input_len": 4, "output_len": 2, **spec}), seed=5)


@fake_time
async def test_each_turn_carries_the_conversation_so_far_with_the_servers_answers() -> None:
    server = ChatServer()
    async with server.client() as client:
        result = await run_load(
            "http://fake", "m", conversation_workload(), Arrival(concurrency=1, requests=6), client=client,
            clock=LoopClock(),
        )  # fmt: skip
    assert result.summary.requests_succeeded == 6
    msgs = [b["messages"] for b in server.bodies]
    assert [[m["role"] for m in ms] for ms in msgs[:3]] == [
        ["user"],
        ["user", "assistant", "user"],
        ["user", "assistant", "user", "assistant", "user"],
    ]
    # The answers in the history are the server's own, of the request before, and the earlier turns are unchanged.
    assert msgs[1][1]["content"] == "a0 a0" and msgs[2][3]["content"] == "a1 a1"
    assert msgs[1][:1] == msgs[0] and msgs[2][:3] == msgs[1]
    assert len(msgs[0][0]["content"].split()) == 4
    # The 4th request starts a new conversation: a fresh history, a new message.
    assert len(msgs[3]) == 1 and msgs[3][0]["content"] != msgs[0][0]["content"]
    assert [r.turn for r in result.records] == [0, 1, 2, 0, 1, 2]
    assert all(b["stream"] and b["max_tokens"] == 2 for b in server.bodies)


@fake_time
async def test_a_turn_waits_for_the_previous_answer_and_the_think_time() -> None:
    server = ChatServer()
    async with server.client() as client:
        await run_load(
            "http://fake", "m", conversation_workload(think_s=7.0), Arrival(concurrency=1, requests=6),
            client=client, clock=LoopClock(),
        )  # fmt: skip
    a, e = server.arrivals, server.ends
    # Within a conversation: the answer's end plus 7 s. Between conversations the user starts the next at once.
    for i in (1, 2, 4, 5):
        assert a[i] - e[i - 1] == pytest.approx(7.0, abs=1e-6)
    assert a[3] - e[2] == pytest.approx(0.0, abs=1e-6)


@fake_time
async def test_a_user_thinking_when_the_run_ends_does_not_hold_it_up() -> None:
    server = ChatServer()
    async with server.client() as client:
        await run_load(
            "http://fake", "m", conversation_workload(think_s=1000.0), Arrival(concurrency=2, requests=2),
            client=client, clock=LoopClock(), scrape_metrics=False,
        )  # fmt: skip
        ended = asyncio.get_running_loop().time()
    # Both users' first turns were the run's 2 requests: it ends with their answers, not 1000 s of thinking later.
    assert ended == pytest.approx(max(server.ends), abs=1e-6)


@fake_time
async def test_each_user_holds_its_conversations_and_the_users_overlap() -> None:
    server = ChatServer()
    async with server.client() as client:
        result = await run_load(
            "http://fake", "m", conversation_workload(think_s=3.0), Arrival(concurrency=2, requests=12),
            client=client, clock=LoopClock(),
        )  # fmt: skip
    assert result.summary.requests_succeeded == 12
    # Two users start together; every later turn answers a request of its own conversation, never the other's.
    assert server.arrivals[0] == server.arrivals[1]
    for body in server.bodies:
        answers = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
        users = [m["content"] for m in body["messages"] if m["role"] == "user"]
        for answer in answers:
            k = int(answer.split()[0][1:])
            assert server.bodies[k]["messages"][-1]["content"] in users


@fake_time
async def test_a_failed_turn_ends_its_conversation() -> None:
    calls = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        if not request.url.path.startswith("/v1/"):
            return httpx.Response(404)
        calls += 1
        body = json.loads(request.content)
        if calls == 2:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        content = chunk("x", chat=True) * body["max_tokens"] + usage_chunk(3, body["max_tokens"]) + DONE
        return httpx.Response(200, content=content, headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        result = await run_load(
            "http://fake", "m", conversation_workload(), Arrival(concurrency=1, requests=4), client=client,
            clock=LoopClock(),
        )  # fmt: skip
    assert [(r.turn, r.ok) for r in result.records] == [(0, True), (1, False), (0, True), (1, True)]


def test_turn_figures_split_first_turns_from_later_ones() -> None:
    def rec(i: int, turn: int, ttft: float, ok: bool = True, warmup: bool = False) -> RequestRecord:
        return RequestRecord(index=i, start_s=i, ttft_s=ttft, e2e_s=2 * ttft, ok=ok, turn=turn, warmup=warmup)

    records = [rec(0, 0, 9.0, warmup=True), rec(1, 0, 1.0), rec(2, 1, 0.2), rec(3, 2, 0.4), rec(4, 0, 3.0)]
    records.append(rec(5, 1, 50.0, ok=False))
    figures = turn_figures(records)
    assert figures is not None
    assert (figures.first_turns, figures.later_turns, figures.max_turn) == (2, 3, 2)
    assert figures.ttft_p50_first_s == pytest.approx(2.0)
    assert figures.ttft_p95_first_s == pytest.approx(2.9)
    assert figures.ttft_p50_later_s == pytest.approx(0.3)
    assert figures.ttft_p95_later_s == pytest.approx(0.39)
    assert turn_figures([RequestRecord(index=0, start_s=0, ok=True)]) is None


@fake_time
async def test_the_run_reports_ttft_by_turn() -> None:
    server = ChatServer()
    async with server.client() as client:
        result = await run_load(
            "http://fake", "m", conversation_workload(), Arrival(concurrency=2, requests=6), client=client,
            clock=LoopClock(),
        )  # fmt: skip
    assert result.turns is not None
    assert (result.turns.first_turns, result.turns.later_turns) == (2, 4)
    assert result.turns.ttft_p95_first_s == pytest.approx(TTFT_S, abs=1e-6)


SHAREGPT = [
    {
        "id": "a",
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "first question"},
            {"from": "gpt", "value": "x" * 40},
            {"from": "human", "value": "second question"},
            {"from": "gpt", "value": "y" * 80},
            {"from": "human", "value": "unanswered"},
        ],
    },
    {"id": "b", "conversations": [{"from": "human", "value": "only one"}, {"from": "gpt", "value": "z" * 8}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "no question"}]},
]


def test_sharegpt_conversations_keep_their_human_turns_in_order(tmp_path: Path) -> None:
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(SHAREGPT))
    rows = load_sharegpt_conversations(path)
    assert rows == (
        (("first question", 10), ("second question", 20)),
        (("only one", 2),),
    )


@fake_time
async def test_a_sharegpt_file_is_played_turn_by_turn(tmp_path: Path) -> None:
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(SHAREGPT))
    wl = Workload(dataset=path, conversations=ConversationSpec(think_s=1.0))
    server = ChatServer()
    async with server.client() as client:
        result = await run_load("http://fake", "m", wl, Arrival(concurrency=1, requests=3), client=client)
    bodies = server.bodies
    firsts = {b["messages"][0]["content"] for b in bodies if len(b["messages"]) == 1}
    assert firsts <= {"first question", "only one"}
    second = next(b for b in bodies if b["messages"][-1]["content"] == "second question")
    assert [m["content"] for m in second["messages"][::2]] == ["first question", "second question"]
    assert second["max_tokens"] == 20
    assert result.summary.requests_succeeded == 3


def test_a_bad_sharegpt_file_is_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "chats.json"
    path.write_text(json.dumps([{"prompt": "single turn"}]))
    with pytest.raises(ConfigError, match=r"entry 0 has no 'conversations' list"):
        load_sharegpt_conversations(path)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"api": "completions"}, "chat API"),
        ({"input_len": 64}, "give input_len under conversations"),
        ({"prefix_len": 8}, "give system_len under conversations"),
    ],
)
def test_fields_a_conversation_takes_from_conversations_are_refused_at_the_top(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        Workload(conversations=ConversationSpec(), **fields)


def test_a_conversation_workload_is_chat_and_bounds_its_longest_request() -> None:
    wl = conversation_workload(system_len=10)
    assert wl.path == "/v1/chat/completions"
    spec = wl.conversations
    assert spec is not None
    # 3 turns of (4 in + 2 out + template) and the system prompt: the last turn's prompt and answer.
    assert wl.max_request_tokens() == spec.longest_conversation_tokens() >= 10 + 3 * (4 + 2)


async def test_an_open_loop_is_refused_for_conversations() -> None:
    with pytest.raises(ValueError, match="closed loop"):
        await run_load("http://fake", "m", conversation_workload(), Arrival(rate=1.0, requests=3), scrape_metrics=False)


def test_a_workload_without_conversations_dumps_and_hashes_as_before_they_existed() -> None:
    # The stored job, the workload hash and the twin's seed of every study run before stay the same.
    plain = Workload(input_len=64, output_len=8)
    assert plain.model_dump(mode="json") == {
        "input_len": 64, "output_len": 8, "dataset": None, "api": "completions", "prefix_len": 0, "seed": 0,
    }  # fmt: skip
    assert conversation_workload().model_dump(mode="json")["conversations"]["turns"] == 3
    # A conversation workload's dump (the stored job) reads back as the same workload.
    dump = conversation_workload().model_dump(mode="json")
    assert "input_len" not in dump and dump["api"] == "chat"
    again = Workload.model_validate(dump)
    assert again.model_dump(mode="json") == dump and again.fingerprint() == conversation_workload().fingerprint()
