"""A trace study fitted by `tuner calibrate --study`: its requests replayed with the prompt blocks their hash ids
share, so the prefix cache serves in the replay what it served the server, not a prefill the fit must pay for."""

from __future__ import annotations

from pathlib import Path

from tuner.calibration.replay import Load, Request, engine_shape, replay
from tuner.calibration.trials import trace_prompt_ids
from tuner.catalog import get_gpu, load_model
from tuner.flags import VllmFlags
from tuner.load import Arrival, RequestRecord
from tuner.step_profile import StepCoefficients

TRACES = Path(__file__).parent.parent / "data" / "traces"
GUESS = StepCoefficients(
    step_overhead_s=0.005, prefill_token_s=1e-5, decode_seq_s=1e-4, context_token_s=1e-8, request_latency_s=0.0
)


def _record(index: int, prompt: int, start: float) -> RequestRecord:
    return RequestRecord(
        index=index, start_s=start, ttft_s=0.1, itl_s=[], e2e_s=0.1, prompt_tokens=prompt, completion_tokens=1, ok=True
    )


def test_a_trace_s_shared_hash_ids_are_shared_prompt_ids() -> None:
    arrival = Arrival(trace=TRACES / "mooncake.jsonl")  # hash ids [0, 1, 2], [0, 3], [0, 1, 4], [5]
    records = [_record(i, n, t) for i, (n, t) in enumerate([(1200, 0.0), (700, 0.25), (1100, 1.5), (300, 4.0)])]
    ids = trace_prompt_ids(arrival, records, 0)
    assert ids is not None and [len(i) for i in ids] == [1200, 700, 1100, 300]
    assert ids[0][:512] == ids[1][:512] == ids[2][:512] and ids[0][:1024] == ids[2][:1024]
    assert ids[3][:300] != ids[0][:300]
    assert trace_prompt_ids(Arrival(trace=TRACES / "plain.jsonl"), records[:3], 0) is None  # no hash ids
    assert trace_prompt_ids(Arrival(rate=1.0, requests=4), records, 0) is None


def test_the_replay_serves_shared_blocks_from_the_prefix_cache() -> None:
    shape = engine_shape(
        load_model("llama-3.1-8b"), get_gpu("h100-80gb"), VllmFlags(max_model_len=4096, enable_prefix_caching=True)
    )
    arrival = Arrival(trace=TRACES / "mooncake.jsonl")
    records = [_record(i, n, t) for i, (n, t) in enumerate([(1200, 0.0), (700, 0.25), (1100, 1.5), (300, 4.0)])]
    ids = trace_prompt_ids(arrival, records, 0)
    assert ids is not None
    alone = Load(tuple(Request(r.prompt_tokens, 1, send_s=r.start_s) for r in records), None)
    shared = Load(tuple(Request(r.prompt_tokens, 1, send_s=r.start_s, prompt_ids=ids[r.index]) for r in records), None)
    # the prompt tokens each first token waited for: the second and third requests find 512 and 1024 cached
    prompt_tokens = 1
    assert replay(shape, alone, GUESS).ttft[prompt_tokens] * 4 == 1200 + 700 + 1100 + 300
    assert replay(shape, shared, GUESS).ttft[prompt_tokens] * 4 == 1200 + (700 - 512) + (1100 - 1024) + 300
