"""Every job file and runnable command the documentation shows is run on the emulator (the convention is in
doc_blocks.py): a page whose example fails, fails here. Pages whose commands start servers are `slow`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import DOCS, ROOT, TRANSCRIPTS, Command, PageExamples, page_examples, pages, transcript_commands

# Guides that show a complete job file (the "each with a complete job file that runs").
_GUIDES_WITHOUT_JOB = {"guides/morning.md", "guides/bench-and-launch.md", "guides/verify.md", "guides/surroundings.md"}


def _examples() -> list[PageExamples]:
    return [ex for ex in map(page_examples, pages()) if ex.files or ex.commands]


def _param(ex: PageExamples) -> object:
    name = str(ex.page.relative_to(DOCS))
    return pytest.param(ex, id=name, marks=[pytest.mark.slow] if ex.slow else [])


def _run(command: Command, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert command.argv[:1] == ("tuner",), f"a runnable command runs tuner: {command.text}"
    # HF_HUB_OFFLINE: a page's model is one the catalog knows or a directory, never a download
    env = {**os.environ, **dict(command.env), "PYTHONPATH": str(ROOT), "COLUMNS": "100", "HF_HUB_OFFLINE": "1"}
    env.pop("TUNER_STORAGE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "tuner", *command.argv[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
    )


# The tiny model's config as scripts/real-vllm links it into .tuner-cache/ (its weights only a real start needs):
# the CPU pages' job files name it, and their dry runs read its shape.
_TINY_LLAMA = (
    '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2004, "hidden_size": 256, '
    '"intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, '
    '"max_position_embeddings": 4096, "torch_dtype": "bfloat16"}'
)


@pytest.mark.parametrize("examples", [_param(ex) for ex in _examples()])
def test_page_examples_run_on_the_emulator(examples: PageExamples, tmp_path: Path) -> None:
    shutil.copytree(ROOT / "search_spaces", tmp_path / "search_spaces")
    (tmp_path / ".tuner-cache" / "tiny-llama").mkdir(parents=True)
    (tmp_path / ".tuner-cache" / "tiny-llama" / "config.json").write_text(_TINY_LLAMA, encoding="utf-8")
    for name, text in examples.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    run_by_page = {word for c in examples.commands for word in c.argv}
    checks = [
        Command(("tuner", "tune", job, "--dry-run"), (), (0,), f"tuner tune {job} --dry-run")
        for job in examples.job_files
        if job not in run_by_page
    ]
    for command in [*checks, *examples.commands]:
        result = _run(command, tmp_path)
        assert result.returncode in command.exit_codes, (
            f"{examples.page.name}: `{command.text}` exited {result.returncode}, the page says {command.exit_codes}\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        )


def test_every_guide_shows_a_job_file_that_runs() -> None:
    missing = []
    for page in sorted((DOCS / "guides").glob("*.md")):
        name = str(page.relative_to(DOCS))
        if name in _GUIDES_WITHOUT_JOB:
            continue
        if not page_examples(page).job_files:
            missing.append(name)
    assert not missing, f'guides without a runnable job file (```yaml title="x.yaml"): {missing}'


def test_the_convention_finds_files_commands_and_exit_codes(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        'Text.\n\n```yaml title="j.yaml"\nstudy: {name: x}\n```\n\n```console\n$ tuner tune j.yaml \\\n'
        "    --dry-run\nout line\n$ VLLM_X=1 tuner tune bad.yaml --check  # exit 2\n```\n\n"
        "```shell\ntuner tune gpu.yaml\n```\n",
        encoding="utf-8",
    )
    ex = page_examples(page)
    assert ex.files == {"j.yaml": "study: {name: x}\n"}
    assert ex.job_files == ["j.yaml"]
    assert [c.argv for c in ex.commands] == [
        ("tuner", "tune", "j.yaml", "--dry-run"),
        ("tuner", "tune", "bad.yaml", "--check"),
    ]
    assert [c.exit_codes for c in ex.commands] == [(0,), (2,)]
    assert ex.commands[1].env == (("VLLM_X", "1"),)
    assert not ex.slow


@pytest.mark.parametrize("page_name", sorted(TRANSCRIPTS))
def test_the_figures_a_page_quotes_come_from_its_own_commands(page_name: str) -> None:
    """docs/snippets/ holds what scripts/docs-figures printed running the page's commands: a page edited without
    running it again fails here (its figures would be another job's), as does a page that stops including them."""
    stem, split = TRANSCRIPTS[page_name]
    text = (DOCS / page_name).read_text(encoding="utf-8")
    names = sorted(p.name for p in (DOCS / "snippets").glob(f"{stem}-*.txt")) if split else [f"{stem}.txt"]
    shown = []
    for name in names:
        assert f'--8<-- "docs/snippets/{name}"' in text, f"{page_name} does not include {name}"
        transcript = (DOCS / "snippets" / name).read_text(encoding="utf-8")
        shown += [line[2:] for line in transcript.splitlines() if line.startswith("$ ")]
    assert shown == [c.text for c in transcript_commands(page_examples(DOCS / page_name))]


def test_the_readme_job_file_is_valid(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    assert len(blocks) == 1 and 15 <= len(blocks[0].splitlines()) <= 25  # the README's 20-line job file
    (tmp_path / "night.yaml").write_text(blocks[0], encoding="utf-8")
    result = _run(Command(("tuner", "tune", "night.yaml", "--dry-run"), (), (0,), "dry run"), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "job file is valid" in result.stdout
