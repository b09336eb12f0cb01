"""Trace files read to their published schemas, bad rows named by line, and a slice's prompts and shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.errors import ConfigError
from tuner.load.arrival import Arrival
from tuner.load.prompt_fit import UNFITTED
from tuner.load.trace_replay import reusable_tokens, slice_shape, sparkline, trace_prompts, trace_slice
from tuner.load.traces import load_trace

DATA = Path(__file__).parent.parent / "data" / "traces"


def test_mooncake_milliseconds_lengths_and_hash_ids() -> None:
    trace = load_trace(DATA / "mooncake.jsonl")
    assert trace.format == "mooncake" and trace.note is None
    assert [r.t_s for r in trace.requests] == [0.0, 0.25, 1.5, 4.0]
    assert next((r.input_len, r.output_len) for r in trace.requests) == (1200, 40)
    assert trace.requests[1].hash_ids == (0, 3)


def test_azure_datetimes_become_seconds_from_the_first() -> None:
    trace = load_trace(DATA / "azure.csv")
    assert trace.format == "azure"
    assert [r.t_s for r in trace.requests] == pytest.approx([0.0, 4.314579, 4.31941, 15.81941])
    # a logged 0-token answer is sent as 1 token: a request asks for at least one
    assert [(r.input_len, r.output_len) for r in trace.requests] == [(374, 44), (396, 109), (879, 1), (91, 17)]


def test_burstgpt_seconds_and_token_columns() -> None:
    trace = load_trace(DATA / "burstgpt.csv")
    assert trace.format == "burstgpt"
    assert [r.t_s for r in trace.requests] == [0.0, 40.0, 113.0, 115.0]
    assert [r.input_len for r in trace.requests] == [472, 1087, 417, 1360]


def test_plain_jsonl_and_a_named_format() -> None:
    trace = load_trace(DATA / "plain.jsonl", "jsonl")
    assert [(r.t_s, r.input_len, r.output_len) for r in trace.requests] == [
        (0.0, 100, 20),
        (0.5, 200, 10),
        (2.25, 50, 30),
    ]


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("a.jsonl", '{"t": 0, "input_len": 5, "output_len": 1}\n{"t": 1, "output_len": 1}\n', "line 2: no 'input_len'"),
        (
            "b.jsonl",
            '{"t": 0, "input_len": 5, "output_len": 1}\n\n{"t": -2, "input_len": 5, "output_len": 1}\n',
            "line 3: 't' is -2; a time is a number >= 0",
        ),
        (
            "c.csv",
            "Timestamp,Model,Request tokens,Response tokens\n1,x,12,4\n2,x,many,4\n",
            "line 3: 'Request tokens' is 'many', not a number of tokens",
        ),
        (
            "d.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,4\n2023-11-16 18:15:47,3\n",
            "line 3: no 'GeneratedTokens'",
        ),
        ("e.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n", "line 2: 'TIMESTAMP' is 'yesterday'"),
        (
            "f.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}\n',
            "line 1: 'hash_ids' is not a list of integers",
        ),
        ("g.jsonl", '{"prompt": "hi"}\n', "cannot tell its format from line 1"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_and_line(tmp_path: Path, name: str, text: str, said: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_trace(path)
    assert str(e.value).startswith(f"trace {path}: ") and said in str(e.value) and "\n" not in str(e.value)


def test_an_unsorted_file_is_sorted_with_a_note(tmp_path: Path) -> None:
    path = tmp_path / "u.jsonl"
    path.write_text(
        "".join(f'{{"t": {t}, "input_len": {n}, "output_len": 1}}\n' for t, n in [(3, 30), (1, 10), (2, 20)])
    )
    trace = load_trace(path)
    assert [r.input_len for r in trace.requests] == [10, 20, 30] and [r.t_s for r in trace.requests] == [0, 1, 2]
    assert trace.note is not None and "sorted" in trace.note


def test_a_slice_starts_at_its_start_and_plays_faster() -> None:
    trace = load_trace(DATA / "mooncake.jsonl")
    sent = trace_slice(trace, start_s=0.2, duration_s=2.0, speedup=4)
    # requests at 0.25 and 1.5 s of the trace, sent (t - 0.2) / 4 s after the replay starts
    assert [r.send_s for r in sent] == pytest.approx([0.0125, 0.325])
    assert [r.input_len for r in sent] == [700, 1100]


def test_shared_hash_ids_are_identical_prompt_blocks() -> None:
    trace = load_trace(DATA / "mooncake.jsonl")
    prompts = list(trace_prompts(trace.requests, UNFITTED, block_tokens=512))
    ids = [p.prompt for p in prompts]
    assert all(isinstance(i, list) for i in ids)
    assert [len(i) for i in ids] == [1200, 700, 1100, 300] == [p.prompt_len for p in prompts]
    a, b, c, d = ids
    assert a[:512] == b[:512] == c[:512]  # hash id 0
    assert a[:1024] == c[:1024]  # 0, 1
    assert a[1024:1100] != c[1024:1100]  # 2 against 4
    assert b[512:] != a[512:700] and d[:300] != a[:300]


def test_chat_prompts_share_blocks_of_words() -> None:
    trace = load_trace(DATA / "mooncake.jsonl")
    prompts = list(trace_prompts(trace.requests, UNFITTED, api="chat", block_tokens=16))
    words = [str(p.prompt).split() for p in prompts]
    assert words[0][:16] == words[1][:16] == words[2][:16] and words[0][:32] == words[2][:32]
    assert [p.prompt_len for p in prompts] == [1200, 700, 1100, 300]


def test_reusable_tokens_are_the_leading_blocks_seen_before() -> None:
    trace = load_trace(DATA / "mooncake.jsonl")
    assert reusable_tokens(trace.requests, 512) == [0, 512, 1024, 0]


def test_the_slice_shape_counts_a_minute_each_and_the_reuse() -> None:
    trace = load_trace(DATA / "burstgpt.csv")
    shape = slice_shape(trace_slice(trace))
    assert (
        shape.requests == 4
        and shape.bucket_s == 10
        and shape.counts == [1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 2]
        and shape.reusable_share is None
    )
    assert shape.input_pct == {50: 472, 90: 1360, 99: 1360}
    moon = slice_shape(trace_slice(load_trace(DATA / "mooncake.jsonl")))
    assert moon.reusable_share == pytest.approx(1536 / 3300)
    assert any("reusable" in line for line in moon.lines())
    assert sparkline([0, 1, 2, 4]) == "▁▂▄█"


@pytest.mark.parametrize("arrival", [Arrival(rate=2, requests=5), Arrival(trace=DATA / "plain.jsonl", speedup=2)])
def test_a_stored_arrival_with_every_field_reads_back(arrival: Arrival) -> None:
    """A study stores the job's arrival whole, defaults included: they are not fields given out of place."""
    assert Arrival.model_validate(arrival.model_dump(mode="json")) == arrival
