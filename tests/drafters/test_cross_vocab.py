"""A draft of another tokenizer (drafters/cross_vocab.py): greedy output is the target alone's token for token, its
drafts are accepted where the two models' texts agree whatever their tokenisations, and the draft's cache rolls back
to the accepted text's tokenisation in its own vocabulary.

The pair (tests/two_tokenizers.py): a byte-level BPE target and a SentencePiece-style draft with byte fallback, its
own BOS and more special tokens, trained on other text. The models are text oracles: the target writes REFERENCE,
the draft a copy of it with a few same-length words changed, so drafts are accepted except there."""

import pytest
import torch

from specdec_cli.drafters.cross_vocab import CrossVocabDrafter
from specdec_cli.engine import FixedK, GenerationStats, SamplingParams, SpeculativeDecoder

from tests.conftest import tiny_causal_lm
from tests.two_tokenizers import TextOracle, draft_tokenizer, target_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REFERENCE = ("The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens and the target "
             "verifies them in one pass; understanding café 😀 unbelievable.\nfor i in range(10):\n    print(add(i, i))\n")
# The draft's text: the same length, a word changed here and there (each one a rejection inside a draft word).
DRAFT_REFERENCE = REFERENCE.replace("lazy", "hazy").replace("several", "sevenal").replace("range", "rangy")
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tokenizers():
    return target_tokenizer(), draft_tokenizer()


@pytest.fixture(scope="module")
def oracles(tokenizers):
    target_tok, draft_tok = tokenizers
    return TextOracle(target_tok, REFERENCE), TextOracle(draft_tok, DRAFT_REFERENCE)


@pytest.fixture(scope="module", params=["byte-level target", "SentencePiece target"])
def pair(request, tokenizers):
    """(target tokenizer, draft tokenizer, target oracle, draft oracle), each way round."""
    first, second = tokenizers if request.param == "byte-level target" else tokenizers[::-1]
    return first, second, TextOracle(first, REFERENCE), TextOracle(second, DRAFT_REFERENCE)


def boundaries(tokenizer, text: str) -> set[int]:
    """The character offsets inside `text` where one token ends and the next begins."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return {end for _, end in offsets[:-1]}


# Texts whose two tokenisations disagree at every boundary (found by a search over pairs of target tokens); the
# target oracle goes on with REFERENCE from their length, mid-word.
DISAGREEING = ["Thera", " thela", " young", " andra", "llyou", "Hever", " dogec"]


def prompts() -> list[str]:
    """REFERENCE cut after every 7th character (mid-word, after a space, inside a multi-byte character's word), and
    DISAGREEING."""
    return [REFERENCE[:end] for end in range(3, len(REFERENCE) - 10, 7)] + DISAGREEING


def test_the_disagreeing_prompts_disagree_at_every_boundary(tokenizers):
    """The premise of the identity test: no token of one tokenizer ends where one of the other does."""
    target_tok, draft_tok = tokenizers
    for text in DISAGREEING:
        target_cuts, draft_cuts = boundaries(target_tok, text), boundaries(draft_tok, text)
        assert target_cuts and draft_cuts and not target_cuts & draft_cuts, (text, target_cuts, draft_cuts)


def test_greedy_output_is_the_target_alones_and_drafts_are_accepted(pair):
    target_tok, draft_tok, target, draft = pair
    drafting = SpeculativeDecoder(target, CrossVocabDrafter(draft, target_tok, draft_tok), FixedK(4))
    alone = SpeculativeDecoder(target)
    stats = GenerationStats()
    for text in prompts():
        prompt = target_tok.encode(text)
        result = drafting.generate(prompt, max_new_tokens=MAX_NEW_TOKENS)
        assert result.tokens == alone.generate(prompt, max_new_tokens=MAX_NEW_TOKENS).tokens, text
        stats.merge(result.stats)
    # Drafts of the text the target writes are its tokens whatever the boundaries: most are accepted (every prompt
    # runs into a changed word, where drafts are rejected inside a draft word: 0.62 of them accepted here).
    assert stats.accepted >= 0.55 * stats.drafted, (stats.accepted, stats.drafted)
    assert stats.accepted < stats.drafted
    assert stats.new_tokens >= 2 * stats.steps, (stats.new_tokens, stats.steps)


def test_greedy_output_with_transformer_models_is_the_target_alones(tokenizers):
    """Random tiny Llamas of the two vocabularies (real KV caches, cropped on every rollback), plain and chat
    prompts (the target's ChatML special tokens reach the draft as its own)."""
    target_tok, draft_tok = tokenizers
    target = tiny_causal_lm("llama", vocab_size=len(target_tok), seed=0, logit_scale=8.0)
    draft = tiny_causal_lm("llama", vocab_size=len(draft_tok), seed=1, logit_scale=8.0)
    texts = [target_tok.encode(text) for text in prompts()[::4]]
    chat = target_tok.apply_chat_template([{"role": "user", "content": "Hello, café?"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
    drafting = SpeculativeDecoder(target, CrossVocabDrafter(draft, target_tok, draft_tok), FixedK(3))
    alone = SpeculativeDecoder(target)
    drafted = 0
    for prompt in [*texts, list(chat)]:
        result = drafting.generate(prompt, max_new_tokens=16)
        assert result.tokens == alone.generate(prompt, max_new_tokens=16).tokens
        drafted += result.stats.drafted
    assert drafted > 0


def test_a_rejection_inside_a_draft_token_rolls_the_draft_back(tokenizers):
    """The draft writes " quick" as one token of its own; the target writes " quack": it accepts " qu", corrects
    "a", and the draft's cache keeps only what the accepted text's own tokenisation shares with it."""
    target_tok, draft_tok = tokenizers
    assert "▁quick" in draft_tok.get_vocab()
    target = TextOracle(target_tok, "The quack brown fox.")
    draft = TextOracle(draft_tok, "The quick brown fox.")
    drafter = CrossVocabDrafter(draft, target_tok, draft_tok)
    decoder = SpeculativeDecoder(target, drafter, FixedK(4))
    prompt = target_tok.encode("The")
    event = next(decoder.stream(prompt, SamplingParams(), max_new_tokens=8))
    quick = draft_tok.convert_tokens_to_ids("▁quick")
    assert target_tok.decode(event.tokens) == " qua" and event.accepted == 3  # " ", "q", "u" kept, "a" corrects
    accepted_text = drafter.draft_context(prompt + event.tokens)  # " qua" in the draft's ids: no "▁quick" in it
    assert quick not in accepted_text
    assert quick not in drafter.runner.ids  # rolled back as the step ended
    assert drafter.runner.ids == accepted_text[: len(drafter.runner.ids)]
    drafter.propose(prompt + event.tokens, 4, SamplingParams(), torch.Generator())
    assert drafter.runner.ids[: len(accepted_text)] == accepted_text  # the next draft reads the accepted text


def test_a_draft_special_token_ends_the_draft(tokenizers):
    """A draft special token the target's vocabulary also has (ChatML's <|im_end|>) becomes the target's token and
    ends the proposal there; one it lacks (the draft's EOS, </s>) ends it before; neither holds the last word back."""
    target_tok, draft_tok = tokenizers
    drafter = CrossVocabDrafter(TextOracle(draft_tok, "x"), target_tok, draft_tok)
    context = drafter.draft_context(target_tok.encode("The quick"))
    words = draft_tok.encode(" brown fox", add_special_tokens=False)
    for special, expected in (("<|im_end|>", " brown fox<|im_end|>"), ("</s>", " brown fox")):
        drafted = words + draft_tok.convert_tokens_to_ids([special, "▁the"])
        text, ended = drafter.drafted_text(context, drafted)
        assert (text, ended) == (expected, True)
        assert drafter.target_ids(text, ended) == target_tok.encode(expected)
    text, ended = drafter.drafted_text(context, words)
    assert not ended and drafter.target_ids(text, ended) == target_tok.encode(" brown")  # " fox" held back


def test_nothing_is_drafted_while_the_target_is_inside_a_character(tokenizers, oracles):
    target_tok, draft_tok = tokenizers
    drafter = CrossVocabDrafter(oracles[1], target_tok, draft_tok)
    inside = target_tok.encode("café")[:-1]  # "caf" and the first byte of "é"
    assert target_tok.decode(inside).endswith("\ufffd")
    assert drafter.propose(inside, 4, SamplingParams(), torch.Generator()).ids == []
