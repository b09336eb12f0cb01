"""Workload lengths, prompts, datasets and validation."""

from __future__ import annotations

import itertools
import json
import random
import statistics
from pathlib import Path

import pytest
from pydantic import ValidationError

from tuner.errors import ConfigError
from tuner.load import Arrival, LogNormalLength, NormalLength, UniformLength, Workload
from tuner.load.prompt_fit import UNFITTED
from tuner.load.workload import draws


def take(wl: Workload, n: int) -> list:  # type: ignore[type-arg]
    return list(itertools.islice(wl.prompts(), n))


def test_fixed_lengths_are_exact_token_ids() -> None:
    specs = take(Workload(input_len=100, output_len=7), 5)
    assert all(isinstance(s.prompt, list) and len(s.prompt) == 100 and s.output_len == 7 for s in specs)
    assert len({tuple(s.prompt) for s in specs}) == 5


def test_seed_reproduces_and_changes_the_sequence() -> None:
    a = take(Workload(input_len=UniformLength(low=10, high=50), seed=1), 20)
    assert a == take(Workload(input_len=UniformLength(low=10, high=50), seed=1), 20)
    assert a != take(Workload(input_len=UniformLength(low=10, high=50), seed=2), 20)


def test_tokens_are_drawn_as_random_choice_draws_them() -> None:
    """`draws` is the fast form of `rng.choice` a token: the same tokens from the same seed, so a seeded workload's
    prompts (and every twin prediction and recorded figure made from them) are what they were."""
    for size in (1, 2, 3, 7, 8, 9, 1000, 32000):
        items = list(range(size))
        for n in (0, 1, 50):
            mine, theirs = random.Random(f"s{size}"), random.Random(f"s{size}")
            assert draws(mine, items, n) == [theirs.choice(items) for _ in range(n)], (size, n)
            assert mine.getstate() == theirs.getstate()  # the generator is left where choice leaves it
    assert draws(random.Random(0), [], 0) == []
    with pytest.raises(IndexError):
        draws(random.Random(0), [], 1)
    tokens = random.Random("tokens-5")  # the workload's own token generator for seed 5
    specs = take(Workload(input_len=UniformLength(low=10, high=50), prefix_len=4, seed=5), 6)
    prefix = [tokens.choice(UNFITTED.ids) for _ in range(4)]
    before = [prefix + [tokens.choice(UNFITTED.ids) for _ in range(s.prompt_len - 4)] for s in specs]
    assert [s.prompt for s in specs] == before


def test_drawn_lengths_stay_in_their_bounds() -> None:
    u = take(Workload(input_len=UniformLength(low=10, high=20), output_len=UniformLength(low=1, high=3)), 500)
    assert {s.prompt_len for s in u} == set(range(10, 21)) and {s.output_len for s in u} == {1, 2, 3}
    n = take(Workload(input_len=NormalLength(mean=200, std=50, min=100, max=260)), 2000)
    lens = [s.prompt_len for s in n]
    assert min(lens) >= 100 and max(lens) <= 260 and statistics.fmean(lens) == pytest.approx(200, rel=0.05)
    ln = take(Workload(input_len=LogNormalLength(median=100, sigma=0.5)), 2000)
    assert statistics.median(s.prompt_len for s in ln) == pytest.approx(100, rel=0.1)


def test_yaml_shapes_validate() -> None:
    wl = Workload.model_validate(
        {"input_len": {"dist": "uniform", "low": 100, "high": 200}, "output_len": 64, "api": "chat"}
    )
    assert wl.max_request_tokens() == 264
    with pytest.raises(ValidationError, match="high"):
        Workload.model_validate({"input_len": {"dist": "uniform", "low": 200, "high": 100}})
    with pytest.raises(ValidationError):
        Workload.model_validate({"input_len": {"dist": "zipf"}})
    with pytest.raises(ValidationError, match="extra"):
        Workload.model_validate({"input_length": 5})


def test_prefix_is_shared_by_every_prompt() -> None:
    specs = take(Workload(input_len=64, prefix_len=48), 4)
    assert len({tuple(s.prompt[:48]) for s in specs}) == 1  # type: ignore[index]
    assert len({tuple(s.prompt[48:]) for s in specs}) == 4  # type: ignore[index]
    with pytest.raises(ValidationError, match="prefix_len"):
        Workload(input_len=10, prefix_len=10)


def test_chat_prompts_are_text_with_about_the_right_words() -> None:
    wl = Workload(input_len=30, api="chat", prefix_len=10)
    specs = take(wl, 3)
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 30 for s in specs)
    body = wl.body("m", specs[0])
    assert body["messages"] == [{"role": "user", "content": specs[0].prompt}] and wl.path == "/v1/chat/completions"


def test_max_request_tokens_and_fingerprint() -> None:
    wl = Workload(input_len=NormalLength(mean=100, std=10), output_len=UniformLength(low=5, high=50))
    assert wl.max_request_tokens() == 140 + 50
    assert (
        wl.fingerprint()
        == Workload(input_len=NormalLength(mean=100, std=10), output_len=UniformLength(low=5, high=50)).fingerprint()
    )
    assert wl.fingerprint() != Workload(input_len=100).fingerprint()


def test_jsonl_dataset(tmp_path: Path) -> None:
    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"prompt": "a" * 400, "output_len": 9}) + "\n\n" + json.dumps({"prompt": "hi"}) + "\n")
    wl = Workload(dataset=p, output_len=5)
    specs = take(wl, 4)
    assert sorted({(s.prompt, s.output_len) for s in specs}) == [("a" * 400, 9), ("hi", 5)]
    assert wl.max_request_tokens() == 134 + 9
    before = wl.fingerprint()
    p.write_text(json.dumps({"prompt": "other"}) + "\n")
    assert Workload(dataset=p).fingerprint() != before


def test_aiperf_single_turn_rows_are_read(tmp_path: Path) -> None:
    p = tmp_path / "aiperf.jsonl"
    p.write_text(json.dumps({"text": "the of and", "output_length": 12}) + "\n")
    assert take(Workload(dataset=p), 1)[0].output_len == 12


def test_sharegpt_dataset(tmp_path: Path) -> None:
    p = tmp_path / "sg.json"
    conv = [
        {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "x" * 40}]},
        {"conversations": [{"from": "human", "value": "Hello"}]},
    ]
    p.write_text(json.dumps(conv))
    specs = take(Workload(dataset=p, output_len=3), 2)
    assert sorted((s.prompt, s.output_len) for s in specs) == [("Hello", 3), ("What is 2+2?", 10)]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json\n", "line 1 is not JSON"),
        ('{"body": "x"}\n', "needs a string 'prompt'"),
        ("[{}]", "entry 0 has no prompt"),
        ("", "no prompts"),
    ],
)
def test_bad_datasets_say_what_is_wrong(tmp_path: Path, content: str, match: str) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(content)
    with pytest.raises(ConfigError, match=match):
        take(Workload(dataset=p), 1)


def test_missing_dataset() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        Workload(dataset=Path("/nonexistent/x.jsonl")).max_request_tokens()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"requests": 5}, "exactly one"),
        ({"concurrency": 2, "rate": 1.0, "requests": 5}, "exactly one"),
        ({"concurrency": 2}, "requests"),
        ({"concurrency": 2, "requests": 1, "max_in_flight": 3}, "open loop"),
        ({"rate": 0, "requests": 1}, "greater than 0"),
    ],
)
def test_arrival_validation(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        Arrival.model_validate(kw)
