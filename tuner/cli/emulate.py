"""`tuner emulate`: the vLLM emulator as a server process (same arguments as `python -m tuner.emulator`)."""

from __future__ import annotations

import typer

from tuner.cli import app
from tuner.emulator import main as emulator_main


@app.command(
    "emulate",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
    help="Serve a CPU-only vLLM look-alike with vLLM's flags (see `tuner emulate --help` for all of them).\n\n"
    "Example: [bold]tuner emulate --model llama-3.1-8b --gpu rtx4090 --max-model-len 8192 --port 8000[/bold]",
)
def emulate(ctx: typer.Context) -> None:
    # vLLM's own argparse flags, parsed by the emulator's parser, so both entry points accept the same line
    raise typer.Exit(emulator_main(list(ctx.args), prog="tuner emulate"))
