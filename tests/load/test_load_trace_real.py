"""A Mooncake trace replayed against real vLLM (CPU build, prefix caching on by default): requests that share a hash
id share that block of prompt, and vLLM's own prefix-cache counters see the reuse the trace holds. One shared server
(`real_vllm`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.real_vllm import RealVllm
from tuner.clock import Clock
from tuner.load import Arrival, Workload, run_load
from tuner.load.trace_replay import reusable_tokens

pytestmark = pytest.mark.real_vllm

BLOCK = 256  # two of the CPU build's 128-token cache blocks: a shared id is whole cache blocks
ROWS = [  # seconds apart, so each prompt is cached before the next one asks for it
    {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [70, 71]},
    {"timestamp": 1500, "input_length": 600, "output_length": 4, "hash_ids": [70, 71]},
    {"timestamp": 3000, "input_length": 600, "output_length": 4, "hash_ids": [70, 72]},
    {"timestamp": 4500, "input_length": 600, "output_length": 4, "hash_ids": [73]},
]


def test_a_traces_shared_blocks_are_vllms_own_prefix_cache_hits(real_vllm: RealVllm, tmp_path: Path) -> None:
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    arrival = Arrival(trace=trace, block_tokens=BLOCK)
    result = asyncio.run(
        run_load(
            real_vllm.base_url, real_vllm.model, Workload(api="completions", seed=11), arrival, clock=Clock(1.0),
            request_timeout_s=120.0,
        )
    )  # fmt: skip
    assert result.summary.requests_succeeded == len(ROWS)
    assert [r.prompt_tokens for r in result.records] == [row["input_length"] for row in ROWS]
    # The trace's own reusable share: 512 tokens of the 2nd request (ids 70, 71), 256 of the 3rd (70).
    reusable = reusable_tokens(arrival.trace_requests(), BLOCK)
    assert reusable == [0, 512, 256, 0]
    expected = sum(reusable) / sum(row["input_length"] for row in ROWS)
    assert result.server is not None and result.server.prefix_cache_hit_rate is not None
    # vLLM counts in whole cache blocks, the same 128-token blocks the shared ids fill: the rate is the trace's.
    assert result.server.prefix_cache_hit_rate == pytest.approx(expected, abs=0.02)
