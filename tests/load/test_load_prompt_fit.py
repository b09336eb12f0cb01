"""Prompt fitting: prompts the server can read, of the length it counts, whatever its tokenizer (or none)."""

from __future__ import annotations

import itertools

import pytest
from load_fakes import WordServer, made_up_words

from tuner.load import Arrival, UniformLength, Workload, run_load
from tuner.load.prompt_fit import ENGLISH_WORDS, UNFITTED, PromptFit, fit_prompts


async def fit_of(server: WordServer, model: str = "m") -> PromptFit:
    async with server.client() as client:
        return await fit_prompts(client, "http://fake", model)


async def test_a_word_level_vocabulary_is_learnt_from_the_server() -> None:
    vocab = made_up_words(300)
    server = WordServer(vocab, template=2)
    fit = await fit_of(server)
    assert fit.exact and fit.chat_overhead == 2
    assert set(fit.words) == set(vocab)  # the specials (<unk>, <|user|>, ...) left out
    assert set(fit.ids) == set(range(5, 305))
    assert "300 words from the server's vocabulary" in fit.note


async def test_english_words_are_kept_where_the_vocabulary_has_them() -> None:
    server = WordServer([*ENGLISH_WORDS, *made_up_words(50)], template=7)
    fit = await fit_of(server)
    assert fit.exact and fit.chat_overhead == 7
    assert list(fit.words) == list(ENGLISH_WORDS) and "English words" in fit.note


@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_every_prompt_is_exactly_as_long_as_asked(api: str) -> None:
    server = WordServer(made_up_words(300), template=3)
    wl = Workload(input_len=UniformLength(low=6, high=90), output_len=3, api=api, prefix_len=2, seed=5)  # type: ignore[arg-type]
    async with server.client() as client:
        result = await run_load("http://fake", "m", wl, Arrival(concurrency=4, requests=40), client=client)
    fit = await fit_of(server)
    asked = [s.prompt_len for s in itertools.islice(wl.prompts(fit), 40)]
    assert result.summary.requests_succeeded == 40
    assert [r.prompt_tokens for r in result.records] == asked
    # The lengths are the workload's, whatever the server: the same as unfitted, template included.
    assert asked == [s.prompt_len for s in itertools.islice(wl.prompts(), 40)]
    assert len({str(s.prompt) for s in itertools.islice(wl.prompts(fit), 40)}) == 40  # no two prompts alike


async def test_a_chat_prompt_shorter_than_the_template_gets_one_word() -> None:
    fit = await fit_of(WordServer(made_up_words(100), template=6))
    spec = next(Workload(input_len=3, api="chat").prompts(fit))
    assert spec.prompt_len == 7 and len(str(spec.prompt).split()) == 1


async def test_the_same_seed_gives_the_same_prompts() -> None:
    fit = await fit_of(WordServer(made_up_words(100)))
    wl = Workload(input_len=UniformLength(low=10, high=50), seed=9)
    assert list(itertools.islice(wl.prompts(fit), 20)) == list(itertools.islice(wl.prompts(fit), 20))
    assert list(itertools.islice(wl.prompts(fit), 20)) != list(
        itertools.islice(Workload(input_len=UniformLength(low=10, high=50), seed=10).prompts(fit), 20)
    )


async def test_a_server_without_tokenize_keeps_the_old_prompts_and_says_so() -> None:
    fit = await fit_of(WordServer(made_up_words(100), tokenize=False))
    assert fit.ids == UNFITTED.ids and fit.words == UNFITTED.words and not fit.exact
    assert "not fitted" in fit.note and "the server has no /tokenize" in fit.note


async def test_an_unknown_model_is_named_not_mistaken_for_a_missing_route() -> None:
    fit = await fit_of(WordServer(made_up_words(100)), model="nope")
    assert not fit.exact and "The model `nope` does not exist" in fit.note


async def test_a_tokenizer_that_counts_across_spaces_is_not_fitted() -> None:
    fit = await fit_of(WordServer(made_up_words(100), merge=True))
    assert not fit.exact and fit.ids == UNFITTED.ids and "neither English words nor its own vocabulary" in fit.note


async def test_a_chat_template_of_varying_length_leaves_only_chat_unchecked() -> None:
    fit = await fit_of(WordServer(made_up_words(100), template_per_word=True))
    assert not fit.exact and fit.chat_overhead == 0 and "chat lengths unchecked" in fit.note
    assert set(fit.ids) == set(range(5, 105))  # completions prompts are still exact
