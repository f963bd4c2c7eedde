"""Speculative sampling with a draft of another tokenizer (drafters/cross_vocab.py) follows the target's distribution
exactly: its drafts reach the engine as target ids without probabilities, verified as point masses.

The target is a random bigram LM over the byte-level tokenizer's ids whose rows give mass to the ids of one sentence
only, favouring that sentence's next id (tests/two_tokenizers.py); the draft, of the SentencePiece-style tokenizer,
goes on with that sentence from wherever the text so far ends in it, so drafts are accepted and rejected, inside
draft words too. 20,000 seeded generations; each of the first POSITIONS generated tokens against the target's exact
marginals (tests/stats.py: chi-square and a TV ceiling). The power check plants the bug of handing the engine the
draft model's own probabilities (rows over its vocabulary) with the target ids, and must fail on 5,000 draws."""

import pytest
import torch

from specdec_cli.drafters.cross_vocab import CrossVocabDrafter
from specdec_cli.engine import FixedK, GenerationStats, SamplingParams, SpeculativeDecoder, logits_to_probs
from specdec_cli.engine.draft import Draft

from tests.stats import fit_failure
from tests.two_tokenizers import BigramLM, TextOracle, draft_tokenizer, target_tokenizer

SENTENCE = " brown dog jumps over lazy fox"  # no target id twice in it: each has one likely next id
DRAWS = 20_000
PLANTED_DRAWS = 5_000
POSITIONS = 3
PARAMS = SamplingParams(temperature=1.0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup():
    target_tok, draft_tok = target_tokenizer(), draft_tokenizer()
    chain = target_tok.encode(SENTENCE)
    target = BigramLM(len(target_tok), sorted(set(chain)), seed=3, scale=1.0)
    for before, after in zip(chain, chain[1:]):
        target.table[before, after] += 5.0
    draft = TextOracle(draft_tok, SENTENCE, follow=True)
    prompt = target_tok.encode("The quick brown") + chain[:1]
    return target_tok, draft_tok, target, draft, prompt


@torch.no_grad()
def exact_marginals(target: BigramLM, last: int) -> torch.Tensor:
    """(POSITIONS, V): P(the i-th generated token = v) under the target alone."""
    following = logits_to_probs(target.table, PARAMS).double()  # (V, V): P(b | a)
    rows = [following[last]]
    for _ in range(POSITIONS - 1):
        rows.append(rows[-1] @ following)
    return torch.stack(rows)


def sample(setup, draws: int) -> tuple[torch.Tensor, GenerationStats]:
    target_tok, draft_tok, target, draft, prompt = setup
    decoder = SpeculativeDecoder(target, CrossVocabDrafter(draft, target_tok, draft_tok), FixedK(2))
    tokens = torch.empty(draws, POSITIONS, dtype=torch.long)
    stats = GenerationStats()
    for seed in range(draws):
        result = decoder.generate(prompt, SamplingParams(PARAMS.temperature, seed=seed), POSITIONS + 1,
                                  stop=lambda generated: len(generated) >= POSITIONS)
        tokens[seed] = torch.tensor(result.tokens[:POSITIONS])
        stats.merge(result.stats)
    vocab = target.config.vocab_size
    counts = torch.stack([torch.bincount(tokens[:, i], minlength=vocab) for i in range(POSITIONS)]).double()
    return counts, stats


def failures(setup, counts: torch.Tensor) -> list[str]:
    exact = exact_marginals(setup[2], setup[4][-1])
    found = [(position, fit_failure(counts[position], exact[position])) for position in range(POSITIONS)]
    return [f"token {position + 1}: {failure}" for position, failure in found if failure]


@pytest.mark.slow
def test_every_position_follows_the_target_distribution(setup):
    counts, stats = sample(setup, DRAWS)
    assert failures(setup, counts) == []
    assert stats.accepted > 0.05 * stats.drafted and stats.accepted < stats.drafted, (stats.accepted, stats.drafted)


def _with_draft_probabilities(real):
    """The planted bug: the draft model's own distribution at the end of its context (a row over its vocabulary)
    handed to the engine for every proposed target id, as if the ids were the draft's."""

    def propose(self, ids, k, params, generator):
        draft = real(self, ids, k, params, generator)
        if not draft.ids:
            return draft
        logits = self.runner.extend(self.draft_context(ids), 1)  # (1, V_draft)
        return Draft(draft.ids, logits_to_probs(logits, params).expand(len(draft.ids), -1))

    return propose


@pytest.mark.slow
def test_the_check_rejects_draft_probabilities_passed_as_the_targets(setup, monkeypatch):
    monkeypatch.setattr(CrossVocabDrafter, "propose", _with_draft_probabilities(CrossVocabDrafter.propose))
    counts, _ = sample(setup, PLANTED_DRAWS)
    assert failures(setup, counts) != []
