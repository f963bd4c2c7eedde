"""Every quantised target format, loaded as users load it (`load_model`), under speculation: greedy output
identical to the same quantised target decoding alone (test_quantised_target.py checks the int8/int4 row
arithmetic itself on random models; this covers the bitsandbytes formats and the whole loading path).

Random tiny models are poor witnesses for formats that compute in bfloat16 (nf4, int4): their two best
logits are often exactly tied in bf16, and the batched verify forward may break such a tie differently
from a one-token forward. So the target is a tiny model trained for a few seconds to follow a rule (each
id of a 64-id alphabet has one successor): its choices win by several logits, which no rounding flips,
and the test asserts that margin first. The draft is the target fine-tuned on a rule that differs for
40% of the ids: rejected often, mid-draft too."""

import warnings

import pytest
import torch

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter
from specdec_cli.engine import CachedModel, DraftOrNot, DraftRule, FixedK, SamplingParams, SpeculativeDecoder
from specdec_cli.models import load_model

from tests.conftest import hf_greedy
from tests.tiny import build_tiny_model, build_tokenizer, train_to_follow

ALPHABET = torch.arange(10, 74)
NEW_TOKENS = 40
MARGIN = 2.0  # logits between the target's choice and its runner-up, far above any quantiser's noise

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
              pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def confident_pair(tmp_path_factory):
    """Saved folders: `target` follows `successor`; `draft` is the target fine-tuned on a rule that
    differs for 26 of the 64 ids. Returns (target folder, draft folder, successor)."""
    root, tokenizer = tmp_path_factory.mktemp("confident"), build_tokenizer()
    generator = torch.Generator().manual_seed(0)
    successor = torch.zeros(len(tokenizer), dtype=torch.long)
    successor[ALPHABET] = ALPHABET[torch.randperm(len(ALPHABET), generator=generator)]
    draft_successor = successor.clone()
    changed = ALPHABET[torch.randperm(len(ALPHABET), generator=generator)[:26]]
    draft_successor[changed] = ALPHABET[torch.randint(len(ALPHABET), (26,), generator=generator)]
    torch.manual_seed(0)
    target = train_to_follow(build_tiny_model(root / "target", arch="llama", tokenizer=tokenizer), successor, ALPHABET, 80)
    target.save_pretrained(root / "target")
    draft = build_tiny_model(root / "draft", arch="llama", tokenizer=tokenizer)
    draft.load_state_dict(target.state_dict())
    train_to_follow(draft, draft_successor, ALPHABET, 30, seed=1).save_pretrained(root / "draft")
    return root / "target", root / "draft", successor


@pytest.fixture(scope="module")
def prompt(confident_pair):
    _, _, successor = confident_pair
    ids = [int(ALPHABET[5])]
    for _ in range(7):
        ids.append(int(successor[ids[-1]]))
    return ids


def alone_with_margins(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The target's own greedy tokens, one forward per token, and each choice's lead over the runner-up."""
    runner, ids, margins = CachedModel(model), list(prompt), []
    for _ in range(NEW_TOKENS):
        logits = runner.extend(ids, 1)[-1].float()  # (V,)
        best_two = logits.topk(2).values
        margins.append(float(best_two[0] - best_two[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], margins


@pytest.mark.parametrize(
    "quantization, dtype",
    [("nf4", "bfloat16"), ("bnb8", "float32"), ("int8", "float32"), ("int4", "bfloat16"), ("q4", "bfloat16")])
def test_a_quantised_target_under_speculation_gives_its_own_greedy_output(confident_pair, prompt, quantization, dtype):
    pytest.importorskip({"nf4": "bitsandbytes", "bnb8": "bitsandbytes", "int4": "torchao"}.get(quantization, "torch"))
    target_folder, draft_folder, successor = confident_pair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = load_model(str(target_folder), device="cpu", dtype=dtype, quantization=quantization, progress=False)
    draft = load_model(str(draft_folder), device="cpu", dtype="float32", progress=False)
    assert target.quantization == quantization
    alone, margins = alone_with_margins(target.model, prompt)
    assert min(margins) > MARGIN  # the precondition: no choice is within the quantiser's noise
    assert alone == hf_greedy(target.model, prompt, NEW_TOKENS)
    assert alone[:3] == [int(successor[prompt[-1]]), int(successor[alone[0]]), int(successor[alone[1]])]
    decoders = {f"k={k}": (DraftModelDrafter(draft.model), FixedK(k)) for k in (1, 3, 6)}
    decoders["the default: cascade, odds cut, draft or not"] = (
        CascadeDrafter(DraftModelDrafter(draft.model)), DraftOrNot(rule=DraftRule(min_survival=0.3)))
    for name, (drafter, policy) in decoders.items():
        result = SpeculativeDecoder(target.model, drafter, policy).generate(prompt, SamplingParams(), NEW_TOKENS)
        assert result.tokens == alone, name
        assert 0 < result.stats.accepted < result.stats.drafted, name  # accepted and rejected drafts
