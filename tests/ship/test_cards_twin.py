"""The twin's capacity search behind `tuner plan --compare-gpus`: a rate the SLOs hold at, never above what a full
batch serves, and steps long enough that a rate too high is seen to miss them."""

from __future__ import annotations

from pathlib import Path

from tuner.config.loader import load_job
from tuner.flags import VllmFlags
from tuner.load import Arrival
from tuner.ship.cards import STEP_REQUESTS, _pool, _probe, _run, best_on_card, on_card, twin_capacity

JOB = Path(__file__).resolve().parents[2] / "search_spaces" / "emulator-demo-max-rate.yaml"
FLAGS = VllmFlags(max_num_seqs=16, max_model_len=4096, gpu_memory_utilization=0.9)


def test_capacity_meets_the_slos_and_twice_it_does_not() -> None:
    job = on_card(load_job(JOB), "l40s")
    probe = _probe(job, FLAGS)
    assert probe is not None
    estimate = probe.request_throughput
    rate, summary = twin_capacity(job, FLAGS, estimate)
    assert rate is not None and summary is not None and 0 < rate <= estimate
    assert all(slo.violation(summary) <= 0 for slo in job.parsed_slos())
    over = _run(job, FLAGS, Arrival(rate=2 * estimate, requests=STEP_REQUESTS, warmup_requests=10))
    assert over is None or any(slo.violation(over) > 0 for slo in job.parsed_slos())


def test_the_card_is_the_one_simulated() -> None:
    job = load_job(JOB)
    fast, slow = (_probe(on_card(job, card), FLAGS) for card in ("h100-80gb", "l40s"))
    assert fast is not None and slow is not None
    assert fast.request_throughput > slow.request_throughput
    assert on_card(job, "l40s").gpu_profile().key == "l40s" and on_card(job, "l40s").target.profile is None


BIG = """
study: {name: big}
target: {launcher: emulator, model: llama-3.1-70b, gpu: h100-80gb, gpus: 8}
space:
  tensor_parallel_size: {choices: [1, 2, 4, 8]}
  max_num_seqs: {low: 16, high: 256, log: true}
  max_model_len: 4096
workload: {input_len: 512, output_len: 128, seed: 1}
arrival: {concurrency: 64, requests: 200}
slos: ["e2e_p95 <= 20s", "ttft_p95 <= 2s", "success_rate >= 0.99"]
"""


def test_every_shape_is_probed_and_the_card_gets_one_its_model_fits(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(BIG)
    job = on_card(load_job(path), "l40s")
    assert {f.world_size for f in _pool(job, 4)} == {1, 2, 4, 8}
    # 70B in bf16 is about 140 GB of weights: an L40S (48 GB) holds it from tensor parallel 4 on.
    pick = best_on_card(job, "l40s", rate=5, headroom=0.7, flag_sets=4)
    assert pick.flags is not None and pick.flags.world_size >= 4 and pick.capacity_rps
