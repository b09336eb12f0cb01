"""The emulator as one object: start-up as vLLM does it, then the engine and the HTTP server.

In-process (tests): `Emulator.from_args([...])` then `async with emu.serve_http(host, port=0) as base_url:`.
Process form: `python -m tuner.emulator ...` runs `main()`: start-up lines with emulated delays, the port bound
only when ready, vLLM's message and exit 1 for a start vLLM would refuse, exit 2 for bad arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, suppress
from dataclasses import replace
from typing import TextIO

import uvicorn

from tuner.capacity import (
    CUDA_OOM,
    GIB,
    INSUFFICIENT_FREE_MEMORY,
    INVALID_FLAGS,
    KV_CACHE_TOO_SMALL,
    NO_KV_MEMORY,
    StartupPlan,
    cuda_graph_capture_sizes,
    cuda_graph_counts,
    is_datacenter_blackwell,
    plan_startup,
)
from tuner.clock import Clock
from tuner.emulator.blocks_override import override_blocks
from tuner.emulator.config import EmulatorConfig, VllmRefusal, parse_config
from tuner.emulator.frontend import FrontendEngine
from tuner.emulator.jitter import DEFAULT_STEP_JITTER, StepJitter
from tuner.emulator.logs import VllmLog
from tuner.emulator.metrics import EmulatorMetrics, cache_config_labels
from tuner.emulator.server import VLLM_VERSION, OpenAiApp
from tuner.emulator.step_time import StepTimeModel
from tuner.errors import ConfigError, LaunchError
from tuner.flags import ResolvedFlags, resolve

WEIGHT_LOAD_BYTES_PER_S = 2e9  # safetensors from a warm page cache
PROFILE_SECONDS = 3.0  # dynamo + torch.compile warm cache + profiling run
EAGER_PROFILE_SECONDS = 1.0
GRAPH_SECONDS_PER_SIZE = 0.2


class EmulatorStartupError(LaunchError):
    """A start vLLM would refuse: `reason` is a capacity failure class, `message` vLLM's text."""

    def __init__(self, reason: str, message: str, estimated_max_model_len: int | None = None) -> None:
        super().__init__(message, reason)
        self.message = message
        self.estimated_max_model_len = estimated_max_model_len


def _quiet_uvicorn() -> None:
    # Our own vLLM-shaped lines replace uvicorn's; a cut stream must not print a traceback.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers = [logging.NullHandler()]
        lg.propagate = False


class _Server(uvicorn.Server):
    """uvicorn without its signal capture: in-process users keep their handlers, the process form installs its
    own (uvicorn would re-raise SIGTERM after a graceful shutdown and turn exit code 0 into -15)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _fmt_args(config: EmulatorConfig) -> str:
    shown = {k: ("<hidden>" if k == "api_key" else v) for k, v in config.non_default_args.items()}
    return repr(shown)


class Emulator:
    def __init__(self, config: EmulatorConfig, *, log_stream: TextIO | None = None) -> None:
        self.config = config
        self.time_scale = config.time_scale
        self.clock = Clock(config.time_scale)
        resolved = resolve(config.flags, config.gpu, config.model)
        self.memory_blocks = plan_startup(config.model, config.gpu, resolved, config.memory_in_use_gib)
        # `--max-model-len auto`: the engine and the API run with the length the start fitted
        self.derived_max_model_len = resolved.max_model_len
        if resolved.auto_max_model_len and self.memory_blocks.max_model_len:
            resolved = replace(resolved, max_model_len=self.memory_blocks.max_model_len)
        self.resolved: ResolvedFlags = resolved
        # the CPU build's worker is a process of its own and writes as `(Worker pid=N)` (cpu_worker.py)
        self.log = VllmLog(
            log_stream, tensor_parallel_size=self.resolved.tensor_parallel_size, separate_worker=config.gpu.is_cpu
        )
        self.plan: StartupPlan = override_blocks(self.memory_blocks, config.num_gpu_blocks_override, self.resolved)
        self.step_model = StepTimeModel.build(config.model, config.gpu, self.resolved, config.profile)
        self.exit_code: int | None = None
        self.fatal_reason: str | None = None
        self._server: uvicorn.Server | None = None
        self._engine_task: asyncio.Task[None] | None = None
        self._startup_logged = False
        r = self.resolved
        p = self.plan
        cache_info = cache_config_labels(
            block_size=r.block_size, block_size_given="block_size" in config.non_default_args,
            cache_dtype=r.kv_cache_dtype, prefix_caching=r.enable_prefix_caching,
            utilization=r.gpu_memory_utilization, num_blocks=p.num_gpu_blocks, kv_tokens=p.kv_tokens,
            max_concurrency=p.max_concurrency, kv_cache_memory_bytes=None,
        )  # fmt: skip
        self.metrics = EmulatorMetrics(config.served_model_name, r.max_model_len, cache_info)
        self.engine = FrontendEngine(
            config.model,
            r,
            self.plan,
            self.step_model,
            self.clock,
            self.metrics,
            self.log,
            self._on_fatal,
            crash_after_requests=config.fault_crash_after_requests,
            log_stats=not config.disable_log_stats,
            jitter=StepJitter(DEFAULT_STEP_JITTER if config.step_jitter is None else config.step_jitter, config.seed),
            request_latency_s=config.profile.coefficients.request_latency_s if config.profile else 0.0,
        )
        self.api = OpenAiApp(
            self.engine,
            self.metrics,
            config.served_model_names,
            config.model_arg,
            r.max_model_len,
            config.seed,
            config.api_key,
            lambda: self.engine.dead,
            self._ensure_engine,
        )
        self.app = self.api.app

    @classmethod
    def from_args(cls, argv: list[str], *, log_stream: TextIO | None = None) -> Emulator:
        """Parse vLLM-style arguments; raises ConfigError for bad ones, EmulatorStartupError for a refused start."""
        emu = cls(parse_config(argv), log_stream=log_stream)
        emu.check_startup()
        return emu

    def check_startup(self) -> None:
        p = self.plan
        if not p.ok:
            assert p.reason is not None and p.message is not None
            raise EmulatorStartupError(p.reason, p.message, p.estimated_max_model_len)

    # -- start-up ------------------------------------------------------------------------------------------------

    def startup_seconds(self) -> float:
        """Emulated seconds from launch to ready: weights load, profiling, CUDA graph capture."""
        p = self.plan
        sizes = () if self.config.gpu.is_cpu else cuda_graph_capture_sizes(self.resolved)  # the CPU captures none
        graphs = len(sizes) * GRAPH_SECONDS_PER_SIZE
        profile = EAGER_PROFILE_SECONDS if self.resolved.enforce_eager else PROFILE_SECONDS
        return p.weights_bytes / WEIGHT_LOAD_BYTES_PER_S + profile + graphs

    async def _pause(self, emulated_s: float, delays: bool) -> None:
        if delays:
            await self.clock.sleep(emulated_s)

    def _fail(self, source: str, lines: list[str]) -> None:
        self.log.error("core.py:708", "EngineCore failed to start.", "engine")
        self.log.error("core.py:708", "Traceback (most recent call last):", "engine")
        for line in lines:
            self.log.error("core.py:708", line, "engine")
        self.log.error(
            source,
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        )

    async def startup(self, delays: bool = True) -> bool:
        """Print vLLM's start-up lines in order, pausing as long as each phase takes (scaled); False if the
        start fails at the point where vLLM discovers it (the error is logged)."""
        p = self.plan
        self._startup_logged = True
        self._log_launch()
        if p.reason == INVALID_FLAGS:
            self._fail_value_error()
            return False
        self._log_engine_config()
        device = self.config.gpu
        if p.reason == INSUFFICIENT_FREE_MEMORY and (not device.is_cpu or device.kv_space_gib is None):
            self._fail_value_error()  # CPUWorker.__init__ checks the requested share before loading too
            return False
        if self.config.gpu.is_cpu:
            return await self._cpu_startup(delays)
        if not await self._load_weights(delays):
            return False
        profile_s = await self._profile_memory(delays)
        if p.reason in (NO_KV_MEMORY, KV_CACHE_TOO_SMALL):
            self._fail_value_error()
            return False
        self._log_kv_cache()
        return await self._capture_graphs(profile_s, delays)

    def _fail_value_error(self) -> None:
        self._fail("api_server.py:1920", [f"ValueError: {self.plan.message}"])

    def _fail_cuda_oom(self) -> None:
        self._fail("api_server.py:1920", [self.plan.message or "torch.OutOfMemoryError: CUDA out of memory."])

    def _log_launch(self) -> None:
        """The API server's first lines: version, the arguments as given, and the model and GPU resolved."""
        cfg, log = self.config, self.log
        # vLLM 0.32's banner (log_version_and_model in vllm/entrypoints/serve/utils/api_utils.py), monochrome.
        log.info(
            "api_utils.py:347",
            "\n       █     █     █▄   ▄█\n"
            f" ▄▄ ▄█ █     █     █ ▀▄▀ █  version {VLLM_VERSION}\n"
            f"  █▄█▀ █     █     █     █  model   {cfg.model_arg} (tuner emulator)\n"
            "   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀\n",
        )
        log.info("utils.py:328", f"non-default args: {_fmt_args(cfg)}")
        if cfg.ignored_args:
            log.warning(
                "arg_utils.py:1762",
                f"The emulator ignores these vLLM arguments (not modelled): {' '.join(cfg.ignored_args)}",
            )
        log.info("__init__.py:742", f"Resolved architecture: {cfg.model.name} on {cfg.gpu.device_name}")

    def _log_engine_config(self) -> None:
        """The resolved limits, as the engine core reports them once the flags are accepted."""
        r, log = self.resolved, self.log
        log.info("__init__.py:1815", f"Using max model len {r.max_model_len}")
        if r.enable_chunked_prefill:
            log.info(
                "scheduler.py:222",
                f"Chunked prefill is enabled with max_num_batched_tokens={r.max_num_batched_tokens}.",
            )
        log.info(
            "core.py:654",
            f"Waiting for init message from front-end. max_num_seqs={r.max_num_seqs}, "
            f"gpu_memory_utilization={r.gpu_memory_utilization}, tensor_parallel_size={r.tensor_parallel_size}",
            "engine",
        )

    async def _load_weights(self, delays: bool) -> bool:
        """Load the weights; False if they alone do not fit (vLLM finds out about half-way through the load)."""
        cfg, p, log = self.config, self.plan, self.log
        if cfg.fault_hang_on_start:
            log.info("gpu_model_runner.py:1953", f"Starting to load model {cfg.model_arg}...", "worker")
            await asyncio.Event().wait()  # never ready, never exits (fault injection)
        log.info("gpu_model_runner.py:1953", f"Starting to load model {cfg.model_arg}...", "worker")
        load_s = p.weights_bytes / WEIGHT_LOAD_BYTES_PER_S
        if p.reason == CUDA_OOM and p.weights_bytes > p.free_bytes:
            await self._pause(load_s * 0.5, delays)
            self._fail_cuda_oom()
            return False
        await self._pause(load_s, delays)
        log.info("default_loader.py:501", f"Loading weights took {load_s:.2f} seconds", "worker")
        log.info(
            "gpu_model_runner.py:2007",
            f"Model loading took {p.weights_bytes / GIB:.2f} GiB memory and {load_s:.2f} seconds",
            "worker",
        )
        return True

    async def _profile_memory(self, delays: bool) -> float:
        """Compile (unless eager), profile, estimate the CUDA graphs' memory, then report the KV budget; the
        seconds it took."""
        r, p, log = self.resolved, self.plan, self.log
        profile_s = EAGER_PROFILE_SECONDS if r.enforce_eager else PROFILE_SECONDS
        if not r.enforce_eager:
            log.info("backends.py:548", f"Dynamo bytecode transform time: {profile_s * 0.6:.2f} s", "worker")
            log.info("monitor.py:34", f"torch.compile takes {profile_s * 0.6:.2f} s in total", "worker")
        await self._pause(profile_s, delays)
        if r.kv_cache_memory_bytes is not None:
            # Worker.determine_available_memory: the figure given replaces the profile (gpu_worker.py, 0.32.0)
            log.info(
                "gpu_worker.py:669",
                f"Initial free memory {p.free_bytes / GIB:.2f} GiB, reserved {r.kv_cache_memory_bytes / GIB:.2f} GiB "
                "memory for KV Cache as specified by kv_cache_memory_bytes config and skipped memory profiling. "
                "This does not respect the gpu_memory_utilization config. Only use kv_cache_memory_bytes config "
                "when you want manual control of KV cache memory size. If OOM'ed, check the difference of initial "
                "free memory between the current run and the previous run where kv_cache_memory_bytes is "
                "suggested and update it correspondingly.",
                "worker",
            )
            return profile_s
        log.info(
            "gpu_worker.py:276",
            f"Memory profiling takes {profile_s * 0.4:.2f} seconds\n"
            f"the current vLLM instance can use total_gpu_memory ({p.total_bytes / GIB:.2f}GiB) x "
            f"gpu_memory_utilization ({r.gpu_memory_utilization:.2f}) = {p.requested_bytes / GIB:.2f}GiB\n"
            f"model weights take {p.weights_bytes / GIB:.2f}GiB; non_torch_memory takes "
            f"{p.non_torch_bytes / GIB:.2f}GiB; PyTorch activation peak memory takes "
            f"{p.activation_bytes / GIB:.2f}GiB; the rest of the memory reserved for KV Cache is "
            f"{p.available_kv_bytes / GIB:.2f}GiB.",
            "worker",
        )
        self._log_graph_estimate()
        log.info("gpu_worker.py:761", f"Available KV cache memory: {p.available_kv_bytes / GIB:.2f} GiB", "worker")
        if p.cuda_graph_profiled:
            u, delta = r.gpu_memory_utilization, p.graph_utilization_delta
            log.info(
                "gpu_worker.py:774",
                "CUDA graph memory profiling is enabled (default since v0.21.0). The current "
                f"--gpu-memory-utilization={u:.4f} is equivalent to --gpu-memory-utilization="
                f"{round(u - delta, 4):.4f} without CUDA graph memory profiling. To maintain the same effective KV "
                f"cache size as before, increase --gpu-memory-utilization to {min(round(u + delta, 4), 1.0):.4f}. "
                "To disable, set VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.",
                "worker",
            )
        return profile_s

    def _log_graph_estimate(self) -> None:
        """GPUModelRunner.profile_cudagraph_memory's two lines (gpu_model_runner.py, 0.32.0)."""
        p, log = self.plan, self.log
        if not p.cuda_graph_profiled:
            return
        counts = cuda_graph_counts(self.resolved, blackwell=is_datacenter_blackwell(self.config.gpu))
        log.info("gpu_model_runner.py:6369", f"Profiling CUDA graph memory: {counts.log_text()}", "worker")
        estimate = f"Estimated CUDA graph memory: {p.cuda_graph_bytes / GIB:.2f} GiB total"
        log.info("gpu_model_runner.py:6474", estimate, "worker")

    def _log_kv_cache(self) -> None:
        r, p, log = self.resolved, self.plan, self.log
        if r.auto_max_model_len:
            # _auto_fit_max_model_len in vllm/v1/core/kv_cache_utils.py (0.32.0)
            check = p.available_kv_bytes - p.kv_bytes_per_token * r.block_size  # less the null block
            memory = f"{check / GIB:.2f} GiB GPU"
            if r.max_model_len >= self.derived_max_model_len:
                text = (
                    f"Auto-fit max_model_len: full model context length {self.derived_max_model_len} fits in "
                    f"available KV cache memory ({memory})"
                )
            else:
                text = (
                    f"Auto-fit max_model_len: reduced from {self.derived_max_model_len} to {r.max_model_len} to fit "
                    f"in available KV cache memory ({memory})"
                )
            log.info("kv_cache_utils.py:2476", text, "engine")
        # One line since 0.2x, the device's name first (kv_cache_utils.py _report_kv_cache_config).
        log.info(
            "kv_cache_utils.py:2327",
            f"GPU KV cache size: {p.kv_tokens:,} tokens, Maximum concurrency for {r.max_model_len:,} tokens per "
            f"request: {p.max_concurrency:.2f}x",
            "engine",
        )

    async def _cpu_startup(self, delays: bool) -> bool:
        """vLLM's CPU build after the flags are accepted, in its words (vllm/v1/worker/cpu_worker.py,
        CPUWorker.determine_available_memory; cpu_model_runner.py): load, warm up (compile), the KV space
        (explicit from VLLM_CPU_KVCACHE_SPACE, else auto), the KV check, the CPU KV cache size line."""
        cfg, r, p, log = self.config, self.resolved, self.plan, self.log
        log.info("cpu_model_runner.py:68", f"Starting to load model {cfg.model_arg}...", "worker")
        load_s = p.weights_bytes / WEIGHT_LOAD_BYTES_PER_S
        await self._pause(load_s, delays)
        log.info("default_loader.py:501", f"Loading weights took {load_s:.2f} seconds", "worker")
        warmup_s = EAGER_PROFILE_SECONDS if r.enforce_eager else PROFILE_SECONDS
        log.info("cpu_model_runner.py:87", "Warming up model for the compilation...", "worker")
        await self._pause(warmup_s, delays)
        log.info("cpu_model_runner.py:91", "Warming up done.", "worker")
        if p.reason in (INSUFFICIENT_FREE_MEMORY, NO_KV_MEMORY):
            self._fail_value_error()
            return False
        total = f"{p.total_bytes / GIB:.2f}"
        kv = f"{p.available_kv_bytes / GIB:.2f}"
        if cfg.gpu.kv_space_gib is not None:
            log.info("cpu_worker.py:260", f"Explicitly set ({kv}/{total}) GiB for KV cache on node 0.", "worker")
        else:
            log.info(
                "cpu_worker.py:282",
                f"Auto set ({kv}/{total}) GiB for KV cache on node 0, with {p.requested_bytes / GIB:.2f} GiB "
                f"requested memory for the worker. {(p.weights_bytes + p.non_torch_bytes) / GIB:.2f} GiB memory "
                "was consumed by non-kv usages.",
                "worker",
            )
        if cfg.num_gpu_blocks_override is not None:
            log.info(
                "kv_cache_utils.py:829",
                f"Overriding num_gpu_blocks={self.memory_blocks.num_gpu_blocks} with "
                f"num_gpu_blocks_override={cfg.num_gpu_blocks_override}",
                "engine",
            )
        if p.reason == KV_CACHE_TOO_SMALL:
            self._fail_value_error()
            return False
        log.info(
            "kv_cache_utils.py:2327",
            f"CPU KV cache size: {p.kv_tokens:,} tokens, Maximum concurrency for {r.max_model_len:,} tokens per "
            f"request: {p.max_concurrency:.2f}x",
            "engine",
        )
        log.info("core.py:402", f"init engine (profile, create kv cache, warmup model) took {warmup_s:.2f} s", "engine")
        return True

    async def _capture_graphs(self, profile_s: float, delays: bool) -> bool:
        """Capture the CUDA graphs and report the engine ready; False if the capture runs out of memory."""
        r, p, log = self.resolved, self.plan, self.log
        graph_s = len(cuda_graph_capture_sizes(r)) * GRAPH_SECONDS_PER_SIZE
        await self._pause(graph_s, delays)
        if p.reason == CUDA_OOM:
            self._fail_cuda_oom()
            return False
        if graph_s:
            log.info(
                "gpu_model_runner.py:2708",
                f"Graph capturing finished in {graph_s:.0f} secs, took {p.cuda_graph_bytes / GIB:.2f} GiB",
                "worker",
            )
        if p.cuda_graph_profiled:
            # the emulator's capture costs exactly its estimate
            graphs = round(p.cuda_graph_bytes / GIB, 2)
            log.info(
                "gpu_worker.py:971",
                f"CUDA graph pool memory: {graphs} GiB (actual), {graphs} GiB (estimated), difference: 0.0 GiB (0.0%).",
                "worker",
            )
        log.info(
            "core.py:214",
            f"init engine (profile, create kv cache, warmup model) took {profile_s + graph_s:.2f} s",
            "engine",
        )
        return True

    # -- serving -------------------------------------------------------------------------------------------------

    def _on_fatal(self, reason: str, lines: list[str]) -> None:
        self.fatal_reason = reason
        self.exit_code = 1
        for line in lines:
            self.log.error("core.py:710", line, "engine")
        self.log.error("async_llm.py:420", "AsyncLLM output_handler failed.")
        self.log.error("launcher.py:101", "Engine failed, terminating server.")
        self.engine.cut_all()
        if self._server is not None:
            self._server.should_exit = True

    @asynccontextmanager
    async def serve_http(
        self, host: str | None = None, port: int | None = None, *, startup_delay: bool = False
    ) -> AsyncIterator[str]:
        """Run uvicorn and the engine in the current event loop; yields the base URL once it accepts
        connections. With startup_delay the emulated start-up time passes first (connections refused)."""
        self.check_startup()
        if not self._startup_logged:
            await self.startup(delays=startup_delay)
        host = self.config.host if host is None else host
        port = self.config.port if port is None else port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))  # listen() happens in uvicorn: refused until then
        except OSError as e:
            sock.close()
            raise LaunchError(f"cannot bind {host}:{port}: {e}", "unknown") from None
        actual_port = sock.getsockname()[1]
        _quiet_uvicorn()
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=30,
        )
        server = _Server(config)
        self._server = server
        engine_task = self._ensure_engine()
        serve_task = asyncio.create_task(server.serve(sockets=[sock]), name="emulator-uvicorn")
        try:
            while not server.started and not serve_task.done():
                await asyncio.sleep(0.005)
            if serve_task.done():
                serve_task.result()
                raise LaunchError("the HTTP server stopped during start-up", "unknown")
            shown = f"[{host}]" if ":" in host else host
            url = f"http://{shown}:{actual_port}"
            self.log.info("entry.py:140", f"Starting vLLM server on {url}")
            self.log.uvicorn(f"Started server process [{os.getpid()}]")
            self.log.uvicorn("Waiting for application startup.")
            self.log.uvicorn("Application startup complete.")
            self.log.uvicorn(f"Uvicorn running on {url} (Press CTRL+C to quit)")
            yield url.replace("0.0.0.0", "127.0.0.1") if host == "0.0.0.0" else url
        finally:
            self.engine.stop()
            self.engine.cut_all()
            server.should_exit = True
            try:
                await serve_task
            finally:
                await self._stop_engine(engine_task)
                sock.close()
                self._server = None
                self.log.uvicorn("Shutting down")
                self.log.uvicorn(f"Finished server process [{os.getpid()}]")

    def _ensure_engine(self) -> asyncio.Task[None]:
        """The engine's task in the running loop, started on first use (also by a request through
        httpx.ASGITransport, which never calls serve_http)."""
        if self._engine_task is None:
            self._engine_task = asyncio.get_running_loop().create_task(self.engine.run(), name="emulator-engine")
        return self._engine_task

    async def _stop_engine(self, task: asyncio.Task[None]) -> None:
        self.engine.stop()
        self.engine.cut_all()
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Emulator]:
        """The engine without a socket, for `httpx.ASGITransport(app=emu.app)` (which buffers whole responses:
        use serve_http to measure streaming). Stops the engine, and cuts open requests, on exit."""
        self.check_startup()
        task = self._ensure_engine()
        try:
            yield self
        finally:
            await self._stop_engine(task)

    def request_stop(self) -> None:
        """Stop serving gracefully (what SIGTERM does to the process form)."""
        if self._server is not None:
            self._server.should_exit = True

    async def wait_closed(self) -> None:
        """Until the server stops by itself (a fatal error) or is told to (SIGTERM/SIGINT)."""
        while self._server is not None and not self._server.should_exit:
            await asyncio.sleep(0.05)

    async def run_process(self) -> int:
        """The process form: start-up with delays, serve until a signal or a fatal error; the exit code."""
        if not await self.startup(delays=True):
            return 1
        loop = asyncio.get_running_loop()
        async with self.serve_http(startup_delay=True):
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            await self.wait_closed()
        return self.exit_code or 0


def main(argv: list[str] | None = None, prog: str = "python -m tuner.emulator") -> int:
    """Entry point of `python -m tuner.emulator` and `tuner emulate`; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        from tuner.emulator.config import build_parser

        build_parser(prog).print_help()
        return 0
    try:
        config = parse_config(args, prog)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, VllmRefusal) else 2
    emu = Emulator(config)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(emu.run_process())
    except KeyboardInterrupt:
        return 130


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where installed: about twice the streamed tokens a CPU second of asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
