"""The `tuner` command. Thin: each sub-module parses its options, calls one function, renders with Rich.

Domain errors (`TunerError`) are printed once, as one line, without a traceback.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperOption

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


def _switch_type(self: TyperOption, ctx: Any) -> str | None:
    """A switch takes no value: Typer 0.29's help printed `--dry-run <bool>`, as if it took one."""
    return None if self.is_flag else _value_type(self, ctx)


_value_type = TyperOption.display_type_rich
TyperOption.display_type_rich = _switch_type  # type: ignore[method-assign]

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


def _prose(text: str) -> str:
    """Each paragraph on one line (a paragraph starting with \\b keeps its lines, as in Click)."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(s.strip() for s in p.splitlines()) for p in paragraphs)


def _help_as_prose(typer_app: typer.Typer) -> None:
    """Typer's rich mode keeps a docstring's line breaks in the command list and in every paragraph after the first,
    so a summary broke mid-sentence at any width but the source's: each command's help is given as prose instead."""
    for info in typer_app.registered_commands:
        doc = info.help if info.help is not None else inspect.getdoc(info.callback) if info.callback else None
        if doc:
            info.help = _prose(doc)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _help_as_prose(group.typer_instance)


_help_as_prose(app)


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
    except ModuleNotFoundError as e:
        # An extra a command did not check for ahead: still one line naming what to install.
        from tuner.cli.extras import extra_for_module

        extra = extra_for_module(e.name or "")
        if extra is None:
            raise
        err_console.print(
            f"[bold red]error:[/bold red] {e.name} is not installed ({extra.purpose}): {escape(extra.install)}",
            highlight=False,
        )
        sys.exit(2)
