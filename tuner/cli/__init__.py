"""The `tuner` command. Thin: each sub-module parses its options, calls one function, renders with Rich.

Domain errors (`TunerError`) are printed once, as one line, without a traceback.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console
from rich.markup import escape

from tuner.errors import ConfigError, TunerError

app = typer.Typer(
    name="tuner",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
    help="Tune vLLM launch flags for the most throughput within your latency and success-rate SLOs.\n\n"
    "Example: [bold]tuner tune search_spaces/emulator-demo.yaml[/bold]",
)

err_console = Console(stderr=True, soft_wrap=True)  # a domain error stays one line, however long

# Each module registers its command on `app` when imported; one module a command (tune's holds `schema` and `db`
# too). The order is `tuner --help`'s: the morning commands in the order a reader uses them.
_COMMAND_MODULES: list[str] = [
    "tuner.cli.bench",
    "tuner.cli.calibrate",
    "tuner.cli.emulate",
    "tuner.cli.launch",
    "tuner.cli.studies",
    "tuner.cli.status",
    "tuner.cli.trials",
    "tuner.cli.pareto",
    "tuner.cli.show",
    "tuner.cli.export",
    "tuner.cli.rescore",
    "tuner.cli.plan",
    "tuner.cli.tune",
    "tuner.cli.verify",
    "tuner.cli.workers",
]

for _name in _COMMAND_MODULES:
    importlib.import_module(_name)


def main() -> None:
    try:
        app(standalone_mode=True)
    except ConfigError as e:
        # escaped: a message's own brackets (`choices: [true, false]`) are not Rich markup to swallow
        err_console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False)
        sys.exit(2)
    except TunerError as e:
        err_console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False)
        sys.exit(1)
