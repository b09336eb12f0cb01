"""The scrape asks the server for the families it reads alone (prometheus_client's `name[]` filter, which vLLM
mounts below /metrics), and still reads everything from a server that has no such filter or whose registry it cannot
look into. The servers here are prometheus_client's own ASGI app over a registry of vLLM's names, and a Starlette app
that serves /metrics alone, reached through httpx.ASGITransport."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from tuner.clock import REAL_TIME
from tuner.load.server_metrics import WANTED_SAMPLES, scrape_metrics

NOISE = 30  # families the summary never reads, as vLLM serves a few dozen


def vllm_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:num_requests_running", "", labels, registry=registry).labels("m", "0").set(6)
    Gauge("vllm:num_requests_waiting", "", labels, registry=registry).labels("m", "0").set(2)
    Gauge("vllm:kv_cache_usage_perc", "", labels, registry=registry).labels("m", "0").set(0.5)
    Counter("vllm:num_preemptions", "", labels, registry=registry).labels("m", "0").inc(3)
    Counter("vllm:generation_tokens", "", labels, registry=registry).labels("m", "0").inc(1000)
    queue = Histogram("vllm:request_queue_time_seconds", "", labels, buckets=(0.3, 1.0), registry=registry)
    queue.labels("m", "0").observe(0.1)
    for i in range(NOISE):
        Histogram(f"vllm:unread_{i}_seconds", "", labels, registry=registry).labels("m", "0").observe(1.0)
    return registry


class NamelessCollector(Collector):
    """Collects without describing, as prometheus_client's MultiProcessCollector does: a registry holding it
    cannot map a `name[]` to it, so a filtered page comes back empty."""

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily("vllm:num_requests_running", "", labels=["model_name"])
        running.add_metric(["m"], 4.0)
        yield running


class Recorder:
    """prometheus_client's app mounted below /metrics, as vLLM mounts it; each query and body size recorded."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.app = make_asgi_app(registry=registry)
        self.queries: list[str] = []
        self.sizes: list[int] = []

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        assert scope["path"].startswith("/metrics")
        self.queries.append(scope["path"] + "?" + scope.get("query_string", b"").decode())

        async def counted(message):  # type: ignore[no-untyped-def]
            if message["type"] == "http.response.body":
                self.sizes.append(len(message.get("body", b"")))
            await send(message)

        await self.app(scope, receive, counted)


async def scrape(app: ASGIApp):  # type: ignore[no-untyped-def]
    transport = httpx.ASGITransport(app=app)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://server") as client,
        scrape_metrics(client, "http://server", clock=REAL_TIME, model="m", interval_s=60) as scraper,
    ):
        while not scraper.samples and not scraper.failures:  # the background scrape's first answer
            await asyncio.sleep(0.01)
    return scraper


async def test_the_scrape_asks_for_the_families_it_reads_alone() -> None:
    filtered = Recorder(vllm_registry())
    scraper = await scrape(filtered)
    assert scraper.filtered and scraper.error is None
    assert len(scraper.samples) == 2  # the first and the closing scrape
    assert all(q.startswith("/metrics/?") and "name%5B%5D=vllm%3Anum_requests_running" in q for q in filtered.queries)
    assert {"vllm:request_queue_time_seconds_bucket", "vllm:num_preemptions_total"} <= set(WANTED_SAMPLES)
    sample = scraper.samples[-1]
    assert (sample.running, sample.waiting, sample.kv_usage) == (6.0, 2.0, 0.5)
    assert (sample.preemptions_total, sample.generation_tokens_total) == (3.0, 1000.0)
    assert sample.queue_time is not None and sample.queue_time.count == 1.0

    # The whole page the server would have rendered otherwise, for comparison.
    transport = httpx.ASGITransport(app=make_asgi_app(registry=vllm_registry()))
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
        whole = (await client.get("/metrics")).text
    assert "vllm:unread_0_seconds" in whole
    assert max(filtered.sizes) < len(whole) / 5


async def test_a_registry_the_filter_cannot_see_into_is_read_whole() -> None:
    registry = CollectorRegistry()
    registry.register(NamelessCollector())
    recorder = Recorder(registry)
    scraper = await scrape(recorder)
    assert not scraper.filtered
    assert [s.running for s in scraper.samples] == [4.0, 4.0]
    assert recorder.queries[0].startswith("/metrics/?name")  # asked once filtered, then whole pages
    assert recorder.queries[1:] == ["/metrics?", "/metrics?"]


async def test_a_server_with_no_filter_below_metrics_is_read_whole() -> None:
    page = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 2.0\n'
    paths: list[str] = []

    async def metrics(request: Request) -> PlainTextResponse:
        paths.append(request.url.path)
        return PlainTextResponse(page)

    scraper = await scrape(Starlette(routes=[Route("/metrics", metrics)]))  # /metrics/ is a redirect here
    assert not scraper.filtered and scraper.error is None
    assert [s.running for s in scraper.samples] == [2.0, 2.0] and paths == ["/metrics", "/metrics"]


class FirstAnswerLate(httpx.AsyncBaseTransport):
    """The first request times out, as a scrape of a server too busy to answer within the scrape's timeout."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.calls == 1:
            raise httpx.ReadTimeout("no answer within the scrape's timeout", request=request)
        return await self.inner.handle_async_request(request)


async def test_a_scrape_a_busy_server_did_not_answer_is_a_failure_not_a_reason_to_read_whole_pages() -> None:
    recorder = Recorder(vllm_registry())
    transport = FirstAnswerLate(httpx.ASGITransport(app=recorder))
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://server") as client,
        scrape_metrics(client, "http://server", clock=REAL_TIME, model="m", interval_s=0.01) as scraper,
    ):
        while not scraper.samples and scraper.failures < 3:
            await asyncio.sleep(0.01)
    assert scraper.filtered and scraper.failures == 1
    assert scraper.error is not None and "ReadTimeout" in scraper.error
    assert recorder.queries and all(q.startswith("/metrics/?name") for q in recorder.queries)
