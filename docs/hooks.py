"""MkDocs hooks: the pages generated from the code at build time, so they cannot drift from it.

- reference/job-file.md from the job file's pydantic schema (every field: its type, default, description);
- reference/commands.md from the Typer app (every command, its help and its options);
- reference/metrics.md from the metric registry (tuner.scoring.METRICS, FIGURES);
- reference/export-formats.md from tuner.export (FORMATS, each rendered for a sample flag set);
- benchmarks/*.md, one page a `##` section of benchmarks/README.md, which stays the repository's benchmark index.

tests/docs/test_docs_reference.py holds these pages to the schema and the CLI.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the checkout's tuner, not an installed copy of another version
    sys.path.insert(0, str(ROOT))

BENCHMARKS_README = ROOT / "benchmarks" / "README.md"


# ---- the job file ---------------------------------------------------------------------------------------------------


def _type_of(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in schema or "oneOf" in schema:
        parts = [_type_of(s, defs) for s in schema.get("anyOf", schema.get("oneOf", []))]
        return " | ".join(dict.fromkeys(parts))
    if "enum" in schema:
        return " | ".join(repr(v) if isinstance(v, str) else str(v) for v in schema["enum"])
    if "const" in schema:
        return repr(schema["const"])
    kind = schema.get("type")
    if kind == "array":
        return f"list[{_type_of(schema.get('items', {}), defs)}]"
    if kind == "object":
        extra = schema.get("additionalProperties")
        return f"map[str, {_type_of(extra, defs)}]" if isinstance(extra, dict) else "object"
    return str(kind or "any")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _factory_default(path: str) -> Any:
    """The value a field's default_factory makes (JSON Schema leaves it out), found by walking the models."""
    from pydantic import BaseModel

    from tuner.config.schema import Job

    model: Any = Job
    for name in path.split("."):
        info = model.model_fields[name]
        value = info.get_default(call_default_factory=True)
        model = info.annotation
    return "its fields' defaults" if isinstance(value, BaseModel) else f"`{value}`"


def _default(schema: dict[str, Any], path: str) -> str:
    if "default" not in schema:  # a default_factory
        try:
            return _factory_default(path)
        except (KeyError, AttributeError):  # inside a union or a list: not walked
            return "—"
    value = schema["default"]
    return "—" if value is None else f"`{value!r}`" if not isinstance(value, dict | list) or value else f"`{value}`"


def _object_rows(
    prefix: str, schema: dict[str, Any], defs: dict[str, Any], seen: tuple[str, ...]
) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    required = set(schema.get("required", []))
    for name, field in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        default = "required" if name in required else _default(field, path)
        rows.append((path, _type_of(field, defs), default, field.get("description", "")))
        refs = _refs(field)
        if len(refs) == 1 and refs[0] not in seen and defs[refs[0]].get("properties"):
            rows.extend(_object_rows(f"{path}.", defs[refs[0]], defs, (*seen, refs[0])))
    return rows


def _refs(schema: dict[str, Any]) -> list[str]:
    """The model definitions a field holds directly (not inside a list or a map: those are listed on their own)."""
    if "$ref" in schema:
        return [schema["$ref"].rsplit("/", 1)[-1]]
    return [r for s in (*schema.get("anyOf", []), *schema.get("oneOf", [])) for r in _refs(s)]


def job_schema_rows() -> list[tuple[str, str, str, str]]:
    """(dotted field path, type, default, description) for every field of the job file, nested sections included."""
    from tuner.config.schema import Job

    schema = Job.model_json_schema()
    return _object_rows("", schema, schema.get("$defs", {}), ())


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}{key}"
            out.setdefault(path, value)
            _flatten(value, f"{path}.", out)


def field_examples() -> dict[str, str]:
    """A value each field takes in the repository's ready job files (search_spaces/), by dotted path."""
    import json

    import yaml

    seen: dict[str, Any] = {}
    for job in sorted((ROOT / "search_spaces").glob("*.yaml")):
        _flatten(yaml.safe_load(job.read_text(encoding="utf-8")), "", seen)
    return {path: json.dumps(value) for path, value in seen.items() if not isinstance(value, dict)}


def job_file_page() -> str:
    from tuner.config.schema import Job

    schema = Job.model_json_schema()
    defs = schema.get("$defs", {})
    lines = [
        "# Job file reference",
        "",
        "Generated from the job file's schema (`tuner/config/schema.py`) when the site is built: every field with its",
        "type, its default and its description. `tuner schema` prints the same schema as JSON Schema for an editor;",
        "[the job file guide](../guides/job-file.md) shows a whole file annotated.",
        "",
        "The example is a value the field takes in one of the repository's ready job files (`search_spaces/`).",
        "",
        "| field | type | default | example | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    examples = field_examples()
    for path, kind, default, description in job_schema_rows():
        example = f"`{examples[path]}`" if path in examples else ""
        lines.append(f"| `{path}` | {_cell(kind)} | {_cell(default)} | {_cell(example)} | {_cell(description)} |")
    listed = {r.rsplit("/", 1)[-1] for r in re.findall(r'"\$ref": "([^"]+)"', _json(schema))}
    nested = sorted(
        name for name in listed if defs.get(name, {}).get("properties") and name not in _directly_held(schema, defs)
    )
    if nested:
        lines += ["", "## Types held in lists, maps and unions", ""]
        for name in nested:
            lines += [f"### {name}", "", defs[name].get("description", "").strip(), ""]
            lines += ["| field | type | default | description |", "| --- | --- | --- | --- |"]
            for path, kind, default, description in _object_rows("", defs[name], defs, (name,)):
                lines.append(f"| `{path}` | {_cell(kind)} | {_cell(default)} | {_cell(description)} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def _json(schema: dict[str, Any]) -> str:
    import json

    return json.dumps(schema)


def _directly_held(schema: dict[str, Any], defs: dict[str, Any]) -> set[str]:
    held: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        for field in node.get("properties", {}).values():
            refs = _refs(field)
            if len(refs) == 1 and refs[0] not in held:  # one of several (a union) gets a table of its own
                held.add(refs[0])
                walk(defs[refs[0]])

    walk(schema)
    return held


# ---- the commands ---------------------------------------------------------------------------------------------------


def command_helps() -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """(command name, its help, [(option or argument, its type or metavar, its help)]) for every command of `tuner`."""
    import typer.main

    from tuner.cli import app

    group = typer.main.get_command(app)
    out: list[tuple[str, str, list[tuple[str, str, str]]]] = []
    for name in group.commands:  # type: ignore[attr-defined]
        command = group.commands[name]  # type: ignore[attr-defined]
        ctx = command.make_context(name, [], resilient_parsing=True)
        params = []
        for param in command.params:
            names = ", ".join(param.opts + param.secondary_opts) if param.param_type_name == "option" else param.name
            kind = (
                "switch" if getattr(param, "is_flag", False) else param.metavar or param.display_type(ctx).strip("<>")
            )
            params.append((names, kind, getattr(param, "help", None) or ""))
        out.append((name, command.help or "", params))
    return out


def _rich_to_md(text: str) -> str:
    return re.sub(
        r"\[(/?)(bold|dim|italic|cyan|green|red|yellow)[^\]]*\]", lambda m: "**" if m.group(2) == "bold" else "", text
    )


def commands_page() -> str:
    lines = [
        "# Command reference",
        "",
        "Generated from the `tuner` command (its Typer app) when the site is built: each command's help as",
        "`tuner COMMAND --help` prints it, and its arguments and options.",
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    helps = command_helps()
    for name, text, _ in helps:
        summary = _rich_to_md(text.split("\n\n")[0])
        lines.append(f"| [`tuner {name}`](#tuner-{name}) | {_cell(summary)} |")
    for name, text, params in helps:
        lines += ["", f"## tuner {name}", ""]
        for paragraph in text.split("\n\n"):
            paragraph = paragraph.lstrip("\b").strip()
            if paragraph.startswith("Example:") or "\n" in paragraph:
                lines += ["```text", _rich_to_md(paragraph).replace("**", ""), "```", ""]
            else:
                lines += [_rich_to_md(paragraph), ""]
        if params:
            lines += ["| argument or option | takes | help |", "| --- | --- | --- |"]
            for names, kind, help_text in params:
                lines.append(f"| `{names}` | {_cell(kind)} | {_cell(_rich_to_md(help_text))} |")
    return "\n".join(lines) + "\n"


# ---- the metrics ----------------------------------------------------------------------------------------------------


def metrics_page() -> str:
    from tuner.scoring import FIGURES, METRICS

    lines = [
        "# Metrics",
        "",
        "Generated from the metric registry (`tuner/scoring.py`, `METRICS`) when the site is built. An SLO names a",
        "latency with a statistic (`ttft_p95 <= 2s`, `e2e_p99 <= 30s`, `itl_mean <= 50ms`) and a rate as it is",
        "(`success_rate >= 0.99`, `good_share >= 95%`); the alert rules of `tuner plan --rules` ask each latency's",
        "vLLM histogram at the SLO's own quantile.",
        "",
        "| name | kind | unit | table label | vLLM histogram |",
        "| --- | --- | --- | --- | --- |",
    ]
    for metric in METRICS.values():
        kind = "latency" if metric.is_latency else "rate"
        lines.append(
            f"| `{metric.name}` | {kind} | {metric.unit} | {metric.label} | "
            f"{'`' + metric.histogram + '`' if metric.histogram else '—'} |"
        )
    lines += [
        "",
        "## Figures every trial records",
        "",
        "Each is stored in the trial's user attributes as `<name>_s` and is a column of `tuner trials`' CSV and JSON;",
        "a headline figure is also a column of its table where it fits. A study also records each figure its SLOs",
        "and `latency_metric` name (`ttft_p90 <= 60s`: `ttft_p90_s`), and its tables show those first.",
        "",
        "| figure | attribute | headline |",
        "| --- | --- | --- |",
    ]
    for figure in FIGURES:
        lines.append(f"| `{figure.name}` | `{figure.attr}` | {'yes' if figure.headline else 'no'} |")
    return "\n".join(lines) + "\n"


# ---- the export formats ---------------------------------------------------------------------------------------------


_FORMAT_LANG = {"vllm-config": "yaml", "compose": "yaml", "kubernetes": "yaml", "json": "json", "python": "python"}


def export_formats_page() -> str:
    from tuner.export import FORMATS, DeployOptions, render
    from tuner.flags import VllmFlags

    flags = VllmFlags(max_num_seqs=48, max_model_len=4096, gpu_memory_utilization=0.94, max_num_batched_tokens=2048)
    options = DeployOptions(model="meta-llama/Llama-3.1-8B-Instruct")
    lines = [
        "# Export formats",
        "",
        "Generated from `tuner/export.py` when the site is built: each format `tuner export -f FORMAT` writes,",
        "rendered for one flag set (`max_num_seqs 48`, `max_model_len 4096`, `gpu_memory_utilization 0.94`,",
        "`max_num_batched_tokens 2048`, Llama-3.1-8B). An export of a study's trial adds its provenance as comments",
        "(the study, the trial, what was measured, the `tuner verify` line) where the format has comments.",
        "",
    ]
    for fmt in FORMATS:
        lines += [
            f"## {fmt}",
            "",
            f"```{_FORMAT_LANG.get(fmt, 'shell')}",
            render(fmt, flags, options).rstrip(),
            "```",
            "",
        ]
    return "\n".join(lines)


# ---- the benchmarks -------------------------------------------------------------------------------------------------


def _slug(title: str) -> str:
    words = re.sub(r"\(`[^`]*`\)", "", title)
    words = re.sub(r"[^a-z0-9]+", "-", words.lower()).strip("-")
    return words[:60].rstrip("-")


def benchmark_sections() -> tuple[str, list[tuple[str, str, str]]]:
    """benchmarks/README.md's introduction, and (slug, title, body) for each of its `##` sections."""
    text = BENCHMARKS_README.read_text(encoding="utf-8")
    parts = re.split(r"^## ", text, flags=re.MULTILINE)
    intro = re.sub(r"^# .*\n", "", parts[0]).strip()
    sections = []
    for part in parts[1:]:
        title, _, body = part.partition("\n")
        sections.append((_slug(title), title.strip(), body.strip()))
    return intro, sections


def benchmark_pages() -> dict[str, str]:
    intro, sections = benchmark_sections()
    index = ["# Benchmarks", "", intro, "", "Each page is a section of `benchmarks/README.md`, the repository's", ""]
    index[-2] += " benchmark index, with its command and the date it was measured:"
    for slug, title, _ in sections:
        index.append(f"- [{_plain(title)}]({slug}.md)")
    pages = {"benchmarks/index.md": "\n".join(index) + "\n"}
    for slug, title, body in sections:
        # the README's ### and #### become the page's ## and ###
        body = re.sub(r"^#(#{2,})", r"\1", body, flags=re.MULTILINE)
        pages[f"benchmarks/{slug}.md"] = f"# {title}\n\n{body}\n"
    return pages


def _plain(title: str) -> str:
    return title.replace("`", "")


# ---- the hooks ------------------------------------------------------------------------------------------------------


def generated_pages() -> dict[str, str]:
    pages = {
        "reference/job-file.md": job_file_page(),
        "reference/commands.md": commands_page(),
        "reference/metrics.md": metrics_page(),
        "reference/export-formats.md": export_formats_page(),
    }
    pages.update(benchmark_pages())
    return pages


def on_config(config: Any) -> Any:
    """The Benchmarks entry of the nav becomes a section of its generated pages, one a section of the README."""
    _, sections = benchmark_sections()
    for i, entry in enumerate(config["nav"]):
        if isinstance(entry, dict) and entry.get("Benchmarks") == "benchmarks/index.md":
            pages: list[Any] = [{"Overview": "benchmarks/index.md"}]
            pages += [{_plain(title): f"benchmarks/{slug}.md"} for slug, title, _ in sections]
            config["nav"][i] = {"Benchmarks": pages}
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, content in generated_pages().items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=content))
    return files
