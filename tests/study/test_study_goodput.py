"""The goodput objective's load phase on the in-process emulator: the capacity search judged by the share of good
requests (each met every latency SLO on its own), not by the SLOs' percentiles."""

from __future__ import annotations

import io

from study_fakes import IdleHandle

from tuner.config import parse_job
from tuner.emulator import Emulator
from tuner.flags import VllmFlags
from tuner.launch import Server
from tuner.launch.base import StartupFacts
from tuner.launch.redact import Redactor
from tuner.scoring import is_good
from tuner.study.measure import measure_load

SEQS = 4  # few slots: past its capacity the queue, and every request's TTFT, grows within a step

JOB = {
    "study": {"name": "goodput"},
    "target": {"launcher": "emulator", "model": "llama-3.1-8b", "gpu": "h100-80gb"},
    "space": {"max_num_seqs": {"low": 2, "high": 8}, "max_model_len": 4096},
    "workload": {"input_len": 256, "output_len": 32},
    "arrival": {"concurrency": 8, "requests": 30},
    "slos": ["ttft_p95 <= 500ms", "e2e_p95 <= 5s", "success_rate >= 0.9"],
    "objective": "goodput",
    "capacity_search": {"requests_per_step": 30, "max_steps": 3},
}


async def test_goodput_search_finds_a_rate_whose_good_share_holds_and_a_higher_one_that_did_not() -> None:
    job = parse_job(JOB)
    bound = job.goodput_slo()
    assert (bound.metric, bound.threshold) == ("good_share", 0.9)
    # Time scale 1: the machine's own delays are not multiplied into the emulated latencies.
    args = ["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--max-model-len", "4096", "--max-num-seqs", str(SEQS)]
    emulator = Emulator.from_args([*args, "--time-scale", "1"], log_stream=io.StringIO())
    async with emulator.serve_http(host="127.0.0.1", port=0) as url:
        server = Server(
            base_url=url, model="llama-3.1-8b", facts=StartupFacts(), time_scale=1.0, handle=IdleHandle(),
            redactor=Redactor(), launcher="emulator",
        )  # fmt: skip
        found = await measure_load(server, job, VllmFlags(max_num_seqs=SEQS, max_model_len=4096))
    assert found.rate is not None and found.result is not None, [(s.rate, s.summary.good_share) for s in found.steps]
    best = found.result
    # The rate found holds the bound, counted request by request against the job's latency SLOs.
    measured = [r for r in best.records if not r.warmup]
    good = [r for r in measured if is_good(r, job.parsed_slos())]
    assert best.summary.good_share == len(good) / len(measured) >= 0.9
    assert found.steps[found.scored_step].rate == found.rate and found.steps[found.scored_step].meets_slos
    # Each step was judged by that one bound; a higher rate was probed and its share fell short of it.
    assert all(s.meets_slos == (s.summary.good_share >= 0.9 and s.slo_stop is None) for s in found.steps)
    higher = [s for s in found.steps if s.rate > found.rate]
    assert higher and all(not s.meets_slos for s in higher)
    assert all(len(s.violations) == 1 for s in found.steps)
