"""The load phase against real vLLM (CPU build, tiny word-level model): prompts it reads, at the exact length it
counts, on both APIs; short replies caught; a bench that measured nothing fails. One shared server (`real_vllm`)."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import run_main
from tests.real_vllm import RealVllm
from tuner.load import Arrival, UniformLength, Workload, run_load
from tuner.load.prompt_fit import PromptFit, fit_prompts

pytestmark = pytest.mark.real_vllm

REQUESTS = 12
OUTPUT = 8


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    code, out, err = run_main(args, capsys, monkeypatch)
    return code, out + err


async def _fit(server: RealVllm) -> PromptFit:
    async with httpx.AsyncClient() as client:
        return await fit_prompts(client, server.base_url, server.model)


def test_the_tiny_models_vocabulary_and_chat_template_are_learnt(real_vllm: RealVllm) -> None:
    fit = asyncio.run(_fit(real_vllm))
    # scripts/make-tiny-model: 2,000 made-up words after 6 specials; its template wraps a message in 2 markers.
    assert fit.exact and len(fit.words) == 2000 and set(fit.ids) == set(range(6, 2006))
    assert fit.chat_overhead == 2


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_bench_gets_every_request_through_at_the_exact_prompt_length(
    api: str,
    real_vllm: RealVllm,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out_file = tmp_path / "bench.json"
    code, out = run_cli(
        ["bench", "--url", real_vllm.base_url, "--api", api, "--concurrency", "4", "--requests", str(REQUESTS),
         "--input-len", "20-300", "--output-len", str(OUTPUT), "--seed", "3", "--json", str(out_file)],
        capsys, monkeypatch,
    )  # fmt: skip
    assert code == 0, out
    assert "fitted with /tokenize" in out
    data = json.loads(out_file.read_text())
    assert data["result"]["summary"]["success_rate"] == 1.0
    workload = Workload(input_len=UniformLength(low=20, high=300), output_len=OUTPUT, api=api, seed=3)  # type: ignore[arg-type]
    asked = [s.prompt_len for s in itertools.islice(workload.prompts(), REQUESTS)]
    records = data["result"]["records"]
    assert len(records) == REQUESTS
    for r in records:
        assert (r["prompt_tokens"], r["completion_tokens"]) == (asked[r["index"]], OUTPUT), r


def test_an_output_vllm_shortens_to_fit_max_model_len_is_short_output(real_vllm: RealVllm) -> None:
    # 1,000 prompt tokens + 100 output > 1,024: vLLM 0.32 answers 200 with 24 tokens and finish_reason "length".
    workload = Workload(input_len=1000, output_len=100)
    run = run_load(
        real_vllm.base_url, real_vllm.model, workload, Arrival(concurrency=1, requests=2), scrape_metrics=False
    )
    result = asyncio.run(run)
    s = result.summary
    assert s.failures == {"short_output": 2} and s.success_rate == 0.0
    assert s.failure_examples["short_output"] == "asked 100 output tokens, got 24 (finish_reason length)"
    assert all(r.prompt_tokens == 1000 for r in result.records)


def test_a_bench_where_every_request_failed_exits_1(
    real_vllm: RealVllm, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = run_cli(
        ["bench", "--url", real_vllm.base_url, "--model", "nope", "--concurrency", "2", "--requests", "2",
         "--input-len", "16", "--output-len", "2"],
        capsys, monkeypatch,
    )  # fmt: skip
    assert code == 1
    assert "all 2 requests failed (2 http_4xx)" in " ".join(out.split()) and "does not exist" in out
