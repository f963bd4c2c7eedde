"""The context window: a prompt that does not fit is refused before any forward; a budget that would
overflow is cut to what fits, and the caller can tell."""

import copy

import pytest
from transformers import GPT2Config, LlamaConfig

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter, NgramDrafter
from specdec_cli.engine import FixedK, SamplingParams, SpeculativeDecoder, context_length, fit_budget
from specdec_cli.errors import InputError, PromptTooLongError

CONTEXT = 512  # the conftest models' max_position_embeddings


def test_a_budget_that_fits_is_kept():
    budget = fit_budget(100, 50, 512)
    assert (budget.max_new_tokens, budget.cut, budget.note()) == (50, False, "")


def test_a_budget_past_the_context_is_cut_to_what_fits_and_says_so():
    budget = fit_budget(500, 5000, 512)
    assert (budget.max_new_tokens, budget.asked, budget.cut) == (12, 5000, True)
    assert budget.note() == ("max_new_tokens cut from 5000 to 12: the prompt's 500 tokens leave no more "
                             "of the model's 512-token context")


def test_without_a_known_context_nothing_is_cut():
    assert fit_budget(10**7, 10**9, None).max_new_tokens == 10**9


def test_a_prompt_that_leaves_no_room_is_an_input_error_in_one_line():
    assert fit_budget(511, 100, 512).max_new_tokens == 1
    with pytest.raises(PromptTooLongError) as raised:
        fit_budget(512, 100, 512)
    error = raised.value
    assert isinstance(error, InputError)
    assert (error.prompt_tokens, error.context) == (512, 512)
    assert error.one_line() == ("the prompt has 512 tokens but the model takes at most 512 (prompt and reply together)"
                                " — shorten the prompt to fewer than 512 tokens, or use a model with a longer context")


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (LlamaConfig(max_position_embeddings=4096), 4096),
        (GPT2Config(n_positions=1024), 1024),
        (type("Bare", (), {})(), None),
    ],
    ids=["max_position_embeddings", "n_positions", "none"],
)
def test_the_context_comes_from_the_config(config, expected):
    model = type("Model", (), {"config": config})()
    assert context_length(model) == expected


def test_a_model_without_a_config_has_no_known_limit():
    assert context_length(object()) is None


def no_forward(*args, **kwargs):
    raise AssertionError("a forward ran")


def test_a_huge_prompt_is_refused_before_any_forward(llama_target, llama_draft):
    drafter = CascadeDrafter(DraftModelDrafter(llama_draft))
    decoder = SpeculativeDecoder(llama_target, drafter, FixedK(4))
    decoder.target._forward = no_forward
    drafter.model_drafter.runner._forward = no_forward
    huge = [5] * 4_000_000  # what a 5 MB line becomes: refused at once, not after minutes in attention
    with pytest.raises(PromptTooLongError, match="the prompt has 4000000 tokens but the model takes at most 512"):
        decoder.generate(huge, SamplingParams(), 10)
    with pytest.raises(PromptTooLongError):
        next(decoder.stream(huge, SamplingParams(), 10))
    assert decoder.target.ids == [] and drafter.model_drafter.runner.ids == []


def test_a_budget_past_the_context_stops_at_the_last_position(llama_target, llama_draft):
    decoder = SpeculativeDecoder(llama_target, DraftModelDrafter(llama_draft), FixedK(4))
    prompt = [1] + [(7 * i + 3) % 90 + 3 for i in range(CONTEXT - 10)]  # 503 tokens: room for 9 new ones
    result = decoder.generate(prompt, SamplingParams(), 1000)
    assert (len(result.tokens), result.finish_reason) == (9, "length")
    assert (result.budget.max_new_tokens, result.budget.asked, result.budget.cut) == (9, 1000, True)
    assert len(decoder.target.ids) <= CONTEXT
    streamed = [token for event in decoder.stream(prompt, SamplingParams(), 1000) for token in event.tokens]
    assert streamed == result.tokens


def test_a_budget_that_fits_is_reported_uncut(llama_target):
    result = SpeculativeDecoder(llama_target, NgramDrafter(), FixedK(2)).generate([1, 5, 7], SamplingParams(), 6)
    assert (result.budget.max_new_tokens, result.budget.cut) == (6, False)


def test_a_draft_model_with_a_shorter_context_sets_the_limit(llama_target, llama_draft):
    short_draft = copy.deepcopy(llama_draft)
    short_draft.config.max_position_embeddings = 100
    decoder = SpeculativeDecoder(llama_target, DraftModelDrafter(short_draft), FixedK(2))
    assert decoder.context == 100
    decoder.drafter = None  # the target alone (chat's /k 0)
    assert decoder.context == CONTEXT
    decoder.drafter = NgramDrafter()
    assert decoder.context == CONTEXT
