"""`tuner launch`: start one server the way a trial would, show its start-up facts, stop it on Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tuner.cli import app
from tuner.config import secret_arg
from tuner.errors import ConfigError, LaunchError
from tuner.flags import VllmFlags
from tuner.launch import DEFAULT_IMAGE, DockerLauncher, Launcher, Server
from tuner.launch.docker import docker_sdk
from tuner.launch.factory import EMULATOR_MODEL, LAUNCHERS, VLLM_MODEL, LaunchOptions
from tuner.launch.failures import log_tail

console = Console()
SCREEN_TAIL_LINES = 15


# The kinds `tuner launch --launcher` offers: every one tuner.launch.factory knows.
LauncherKind = StrEnum("LauncherKind", [(name, name) for name in LAUNCHERS])  # type: ignore[misc]


def _parse_gpus(text: str) -> str | list[str] | None:
    text = text.strip()
    if text in ("all", "none"):
        return None if text == "none" else "all"
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if not ids:
        raise ConfigError(f"--gpus {text!r}: use all, none, or device ids such as 0,1")
    return ids


def _parse_volumes(volumes: list[str]) -> dict[str, str]:
    out = {}
    for v in volumes:
        host, sep, target = v.partition(":")
        if not sep or not host or not target:
            raise ConfigError(f"--volume {v!r}: use HOST_PATH:CONTAINER_PATH[:ro]")
        out[host] = target
    return out


def _parse_cpu_affinity(text: str | None) -> str | dict[str, str] | None:
    if text is None or text in ("auto", "off"):
        return text
    worker, sep, others = text.partition(":")
    if not sep or not worker or not others:
        raise ConfigError(f"--cpu-affinity {text!r}: use auto, off, or WORKER:OTHERS cores such as 1:0 or 2-7:0-1")
    return {"worker": worker, "others": others}


def _is_emulator_image(image: str) -> bool:
    try:
        client = docker_sdk().from_env()
    except Exception:  # no engine: the launcher reports that, with its reason
        return False
    try:
        labels = client.images.get(image).labels or {}
    except Exception:  # image missing: the launcher reports that (image_missing)
        return False
    finally:
        client.close()
    return bool(labels.get("tuner.emulator") == "1")


def build_launcher(
    kind: LauncherKind,
    *,
    model: str | None,
    gpu: str,
    time_scale: float,
    memory_in_use_gib: float,
    extra_args: list[str],
    startup_timeout: float | None,
    image: str,
    gpus: str,
    env: list[str] | None,
    volumes: list[str],
    hf_cache: str | None,
    command: str | None,
    cpu_affinity: str | None = None,
) -> Launcher:
    """The launcher `tuner launch` starts: the options checked here, built by the kind's factory in tuner.launch."""
    emulator_image = kind == "docker" and _is_emulator_image(image)
    options = LaunchOptions(
        model=model,
        gpu=gpu,
        time_scale=time_scale,
        memory_in_use_gib=memory_in_use_gib,
        extra_args=extra_args,
        startup_timeout=startup_timeout,
        image=image,
        gpus=_parse_gpus(gpus) if kind == "docker" and not emulator_image else gpus,
        env=env,
        volumes=_parse_volumes(volumes),
        hf_cache=hf_cache,
        command=command,
        emulator_image=emulator_image,
        cpu_affinity=_parse_cpu_affinity(cpu_affinity),
    )
    return LAUNCHERS[kind.value].from_options(options)


def facts_table(server: Server) -> Table:
    table = Table(title=f"{server.launcher} server ready", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("URL", server.base_url)
    table.add_row("model", server.model)
    f = server.facts
    rows = (
        ("KV cache", f"{f.kv_tokens:,} tokens" if f.kv_tokens is not None else None),
        ("KV cache memory", f"{f.available_kv_gib:.2f} GiB" if f.available_kv_gib is not None else None),
        (
            "max concurrency",
            f"{f.max_concurrency:.2f}x at {f.max_model_len:,} tokens a request"
            if f.max_concurrency is not None and f.max_model_len is not None
            else None,
        ),
        ("weights", f"{f.weights_gib:.2f} GiB" if f.weights_gib is not None else None),
        ("weights loading", f"{f.weights_load_seconds:.2f} s" if f.weights_load_seconds is not None else None),
        ("start-up (wall)", f"{f.startup_seconds:.1f} s" if f.startup_seconds is not None else None),
    )
    for name, value in rows:
        table.add_row(name, value if value is not None else "[dim]not in the log[/dim]")
    if server.cpu_plan is not None:
        table.add_row("CPU cores", server.cpu_plan.describe().removeprefix("CPU cores: "))
    if server.time_scale != 1.0:
        table.add_row("time scale", f"{server.time_scale:g}x faster than the GPU it imitates")
    return table


def failure_panel(error: LaunchError, title: str) -> Panel:
    body: list[Any] = [Text(str(error))]
    if error.estimated_max_model_len is not None:
        body.append(Text(f"vLLM's estimate of the longest max_model_len that fits: {error.estimated_max_model_len:,}"))
    tail = "\n".join(_on_screen(line) for line in log_tail(error.log_tail, SCREEN_TAIL_LINES).splitlines())
    if tail:
        body += [Text(""), Text("log tail:", style="bold"), Text(tail, style="dim", no_wrap=True, overflow="ellipsis")]
    return Panel(Group(*body), title=f"[bold red]{title}: {error.reason}[/bold red]", title_align="left")


# `(EngineCore_DP0 pid=41) ERROR 12-02 10:15:00 [core.py:708] msg`: the pid and the date crowd out the message in
# a panel one screen wide; the writer, level and source stay (the whole line is in the server's log file).
_LOG_PREFIX = re.compile(r"^\((?P<writer>[\w-]+) pid=\d+\) (?P<level>[A-Z]+):? +(?:\d\d-\d\d \d\d:\d\d:\d\d )?")


def _on_screen(line: str) -> str:
    return _LOG_PREFIX.sub(lambda m: f"{m['writer']} {m['level']} ", line, count=1)


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """Ctrl-C and `kill` both end the wait and stop the server, even where SIGINT came in ignored (a background job of
    a script, some CI runners), where asyncio.run would leave it ignored and the server running."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _serve(launcher: Launcher) -> int:
    try:
        with _stopped_by_signals():
            return await _serve_until_stopped(launcher)
    except asyncio.CancelledError:
        console.print("stopped.")
        return 0


async def _serve_until_stopped(launcher: Launcher) -> int:
    try:
        async with launcher.start(VllmFlags()) as server:
            console.print(facts_table(server))
            plan = getattr(launcher, "cpu_plan", None)
            if plan is not None and not plan.applies:
                console.print(f"[yellow]{plan.describe()}[/yellow]")
            elif plan is not None and server.cpu_plan is None:
                console.print(f"[yellow]the server's worker did not bind to cores {plan.env()}: nothing was moved")
            console.print("Press [bold]Ctrl-C[/bold] to stop the server.")
            while server.exit_code is None:
                await asyncio.sleep(0.5)
            failure = server.failure()
            if failure is not None:
                console.print(failure_panel(failure, "server died"))
            return 1
    except LaunchError as e:
        console.print(failure_panel(e, "start failed"))
        return 1


LauncherOpt = Annotated[
    LauncherKind,
    typer.Option("--launcher", "-l", help=", ".join(f"{k.name} ({k.help})" for k in LAUNCHERS.values())),
]
LaunchModelOpt = Annotated[
    str | None,
    typer.Option(help=f"model (default {EMULATOR_MODEL} for the emulator, {VLLM_MODEL} for vLLM)"),
]
LaunchGpuOpt = Annotated[
    str,
    typer.Option(
        help="GPU profile the emulator imitates; with --launcher process, cpu says the server is vLLM's CPU "
        "build (its cores can be planned: --cpu-affinity)"
    ),
]
EnvOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--env",
        help="name of an environment variable for the server, value never shown (docker: passed into the "
        "container, default HF_TOKEN; process: it inherits the environment, these are masked in its log)",
    ),
]
HfCacheOpt = Annotated[str, typer.Option(help="docker: Hugging Face cache mounted into the container")]
CommandOpt = Annotated[
    str | None, typer.Option(help="process: the command line; {model}, {host}, {port} are filled in")
]
StartupTimeoutOpt = Annotated[
    float | None, typer.Option(help="wall seconds to wait for /health before killing the server")
]
CpuAffinityOpt = Annotated[
    str | None,
    typer.Option(
        help="process, vLLM's CPU build: off (the default), auto (its worker gets cores of its own, the API "
        "server and engine core the rest), or WORKER:OTHERS cores, e.g. 1:0 or 2-7:0-1"
    ),
]


@app.command(
    "launch",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    help="Start one server as a trial would, print its start-up facts, stop it on Ctrl-C. "
    "Everything after [bold]--[/bold] is passed to the server as vLLM flags.\n\n"
    "Examples:\n\n"
    "[bold]tuner launch --gpu rtx4090 --time-scale 10 -- --max-model-len 8192[/bold]\n\n"
    "[bold]tuner launch --launcher docker --model meta-llama/Llama-3.1-8B-Instruct --env HF_TOKEN -- "
    "--max-num-seqs 128[/bold]\n\n"
    "[bold]tuner launch --launcher process --command 'vllm serve {model}' -- --gpu-memory-utilization 0.85[/bold]\n\n"
    "[bold]tuner launch --launcher process --gpu cpu --cpu-affinity 1:0 --command "
    "'.tuner-cache/vllm/bin/python -m vllm.entrypoints.openai.api_server --model {model} --port {port}' "
    "--model .tuner-cache/tiny-llama[/bold]",
)
def launch(
    ctx: typer.Context,
    launcher: LauncherOpt = LauncherKind.emulator,  # type: ignore[attr-defined]
    model: LaunchModelOpt = None,
    gpu: LaunchGpuOpt = "h100-80gb",
    time_scale: Annotated[float, typer.Option(help="emulator: run this many times faster than the GPU")] = 1.0,
    memory_in_use_gib: Annotated[float, typer.Option(help="emulator: GPU memory held by other processes")] = 0.0,
    image: Annotated[str, typer.Option(help="docker: the image (the emulator image is recognised)")] = DEFAULT_IMAGE,
    gpus: Annotated[str, typer.Option(help="docker: all, none, or device ids such as 0,1")] = "all",
    env: EnvOpt = None,
    volume: Annotated[list[str] | None, typer.Option(help="docker: HOST_PATH:CONTAINER_PATH[:ro]")] = None,
    hf_cache: HfCacheOpt = "~/.cache/huggingface",
    command: CommandOpt = None,
    startup_timeout: StartupTimeoutOpt = None,
    cpu_affinity: CpuAffinityOpt = None,
) -> None:
    if (found := secret_arg(list(ctx.args))) is not None:
        name, env_name = found
        raise ConfigError(
            f"{name} would put the secret on the server's command line and in its log; pass it by name instead: "
            f"export {env_name}=... and add --env {env_name} (vLLM reads {env_name} from its environment)"
        )
    chosen = build_launcher(
        launcher,
        model=model,
        gpu=gpu,
        time_scale=time_scale,
        memory_in_use_gib=memory_in_use_gib,
        extra_args=list(ctx.args),
        startup_timeout=startup_timeout,
        image=image,
        gpus=gpus,
        env=list(env) if env is not None else None,
        volumes=list(volume or []),
        hf_cache=hf_cache,
        command=command,
        cpu_affinity=cpu_affinity,
    )
    try:
        code = asyncio.run(_serve(chosen))
    finally:
        if isinstance(chosen, DockerLauncher):
            chosen.close()
    if code:
        raise typer.Exit(code)
