"""Glue between loaded models and the engine, shared by chat, run and compare: the drafter and
draft-length policy for a drafter name and k, EOS ids, prompt encoding, and stop strings.

The engine sees token ids only; everything that touches text lives here or above. Settings (which
models, which k, which sampling) are chosen in `settings.py`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec_cli.drafters import CascadeDrafter, DraftModelDrafter, NgramDrafter
from specdec_cli.drafters.cross_vocab import CrossVocabDrafter
from specdec_cli.drafters.subset_head import draft_vocabulary, shared_subset_head, with_prompt_path
from specdec_cli.drafters.tree import DEFAULT_BUDGET, VALUE_BUDGET, TreeDrafter, budget_from_costs
from specdec_cli.engine import CalibratedDraftOrNot, DraftLengthPolicy, DraftOrNot, FixedK, SpeculativeDecoder
from specdec_cli.engine.batched import BatchedDecoder
from specdec_cli.engine.draft import DraftRule, Drafter
from specdec_cli.engine.gate import DraftingGate
from specdec_cli.engine.kv import tree_capable
from specdec_cli.errors import ChatTemplateError, InputError
from specdec_cli.models import LoadedModel
from specdec_cli.models.device import dtype_name
from specdec_cli.models.formats.calibration import calibrated_seconds
from specdec_cli.models.runtime.quantize import computes_rows_alone
from specdec_cli.profiles import DRAFTERS

# End-of-turn tokens that chat templates close an assistant turn with. Some checkpoints (GGUF
# conversions especially) list only one of them as EOS; generation must stop at any.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")

# k = auto: draft up to AUTO_MAX_K tokens, stopping once the draft's own odds that its whole draft survives
# (the product of its probabilities) fall below AUTO_SURVIVAL; the cost model decides whether to draft at all.
# What these values measured lives in docs/draft-length-and-policy.md, not here.
AUTO_MAX_K = 20
AUTO_SURVIVAL = 0.3
# k = auto: a tree grows by value (drafters/tree.py), a further child going in where its path's odds reach this until
# the cost model has measured what one more verified node costs (DraftOrNot's branch cut replaces it then).
AUTO_BRANCH_CUT = 0.15


def draft_rule(k: int | str) -> DraftRule:
    """auto: the draft model stops on its own odds, and a tree grows by value; a fixed k drafts exactly k (a
    tree of the budget's shape)."""
    if k == "auto":
        return DraftRule(min_survival=AUTO_SURVIVAL, branch_cut=AUTO_BRANCH_CUT)
    return DraftRule()


def make_policy(k: int | str, clock_free: bool = False, verify_curve: dict[int, float] | None = None,
                draft_curve: dict[int, float] | None = None) -> DraftLengthPolicy:
    """auto: the cost model says whether to draft (0 when drafting does not pay; up to AUTO_MAX_K when it
    does, the draft model stopping on its own odds); a number: always that many. The policy carries the
    drafter's stop rule (`draft_rule`).

    clock_free: decisions that never read the clock, for `run`'s promise that the same input and seed give
    the same file — the cost model's timings differ from run to run, and with them which tokens are
    drafted, which changes the random draws of sampling (the distribution stays exact, the sample not).
    auto then prices drafts with this machine's calibrated costs alone (`CalibratedDraftOrNot`: the target's
    `verify_curve` and the draft's one-token forward from `draft_curve`); without them it drafts up to
    AUTO_MAX_K and the odds cut alone decides how far, without the fallback to plain decoding.

    verify_curve, draft_curve: the target's and the draft's calibrated forward seconds per token count on this
    machine (`specdec calibrate`); the cost model scales the target's by the run's timings (None: it learns the
    curve from the run) and reads the draft's shape (what a tree level's further rows cost)."""
    rule = draft_rule(k)
    if k != "auto":
        return FixedK(int(k), rule)
    draft_seconds = (draft_curve or {}).get(1)
    if clock_free:
        if verify_curve and draft_seconds:
            return CalibratedDraftOrNot(draft_seconds, verify_curve, max_k=AUTO_MAX_K, rule=rule,
                                        draft_curve=draft_curve)
        return FixedK(AUTO_MAX_K, rule)
    return DraftOrNot(max_k=AUTO_MAX_K, rule=rule, verify_curve=verify_curve, draft_curve=draft_curve)


# Prompt tokens the draft model reads (DraftModelDrafter's window; lossless): a long prompt's draft prefill is a
# large part of a run, and a short window costs the draft little agreement with the target while saving that
# prefill, so a short one is ahead end to end (docs/draft-length-and-policy.md, "The draft's window").
DRAFT_WINDOW = 64


def make_drafter(drafter: str, draft: LoadedModel | None, k: int | str = "auto", target: LoadedModel | None = None,
                 tree_budget: int | None = None) -> Drafter | None:
    """model: the draft model; ngram: prompt lookup; cascade: prompt lookup when it matches, else
    the draft model (model and cascade score the draft's most frequent ids only where its vocabulary is
    large: `draft_vocabulary`, lossless; and read only the prompt's last DRAFT_WINDOW tokens); tree: the cascade with
    the draft model proposing a token tree (the same ids and window), grown by value within `tree_budget` nodes with
    k = auto, else of `tree_budget` nodes (None: `tree_nodes`), as deep as k allows; or the cascade's chains where
    the draft or the target cannot take a tree mask, or the draft has another tokenizer (`tree_note` says so); none:
    the target alone. A draft of another tokenizer than the target's drafts text (`CrossVocabDrafter`, the same ids,
    window and policy). It obeys k's stop rule (`draft_rule`) from the start."""
    if drafter == "none":
        return None
    if drafter == "ngram":
        return NgramDrafter()
    if drafter not in DRAFTERS:
        raise InputError(f"unknown drafter {drafter!r}", f"use one of: {', '.join(DRAFTERS)}")
    if draft is None:
        raise InputError(f"the {drafter} drafter needs a draft model", "pass --draft NAME, or --drafter ngram")
    vocabulary = draft_vocabulary(draft.tokenizer, draft.vocab_size)
    if cross_vocabulary(draft):
        if target is None:
            raise ValueError("a draft of another tokenizer needs its target's tokenizer")
        model_drafter = CrossVocabDrafter(draft.model, target.tokenizer, draft.tokenizer, token_ids=vocabulary,
                                          window=DRAFT_WINDOW, share_head=True)
    elif drafter == "tree" and tree_note(target, draft) is None:
        model_drafter = TreeDrafter(draft.model, budget=tree_budget or tree_nodes(target, k), max_depth=AUTO_MAX_K,
                                    window=DRAFT_WINDOW, token_ids=vocabulary, share_head=True)
    else:
        model_drafter = DraftModelDrafter(draft.model, token_ids=vocabulary, share_head=True, window=DRAFT_WINDOW)
    chosen = CascadeDrafter(model_drafter) if drafter in ("cascade", "tree") else model_drafter
    chosen.obey(draft_rule(k))
    return chosen


def tree_nodes(target: LoadedModel | None, k: int | str) -> int:
    """A tree's nodes unless told: k = auto grows it by value (drafters/tree.py) within VALUE_BUDGET nodes; a fixed
    k gives it `tree_budget_for` the target."""
    return VALUE_BUDGET if k == "auto" else tree_budget_for(target)


def tree_budget_for(target: LoadedModel | None) -> int:
    """A tree's nodes for this target: what its forward-cost curve measured on this machine keeps flat
    (`verify_curve`; see drafters/tree.py), else DEFAULT_BUDGET."""
    costs = verify_curve(target) if target is not None else None
    return (budget_from_costs(costs) if costs else None) or DEFAULT_BUDGET


def cross_vocabulary(draft: LoadedModel | None) -> bool:
    """Whether the draft has another tokenizer than its target's (`load_pair` measured their overlap)."""
    return draft is not None and draft.vocabulary_overlap is not None


def tree_note(target: LoadedModel | None, draft: LoadedModel) -> str | None:
    """One line when the tree drafter must draft chains: a draft of another tokenizer (its tree would be of its own
    ids, which the target cannot verify as a tree), or a model whose attention takes no tree mask."""
    if cross_vocabulary(draft):
        return ("note: the draft has another tokenizer than the target; the tree drafter drafts the cascade's chains "
                "(a tree needs a draft of the target's tokenizer)")
    for role, model in (("draft", draft), ("target", target)):
        if model is not None and not tree_capable(model.model):
            attention = getattr(model.model.config, "_attn_implementation", None)
            return (f"note: the {role} ({attention} attention) cannot take a tree mask; the tree drafter drafts "
                    "chains (trees need eager, sdpa or int8/int4 attention and no sliding window)")
    return None


def eos_token_ids(model: LoadedModel) -> tuple[int, ...]:
    """The model's EOS ids and the ids of the END_OF_TURN_TOKENS its vocabulary has. Each token is looked up on
    its own (an id counts only where it maps back to the same token: an unknown token may come back as the unknown
    token's id): `get_vocab` builds the dict of the whole vocabulary, a cost every
    `build_decoder` would pay."""
    tokenizer, extra = model.tokenizer, set()
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token:
            extra.add(token_id)
    return tuple(sorted(set(model.eos_token_ids) | extra))


def build_decoder(
    target: LoadedModel, draft: LoadedModel | None, drafter: str, k: int | str, clock_free: bool = False,
    tree_budget: int | None = None,
) -> SpeculativeDecoder:
    """drafter: "model", "ngram", "cascade", "tree" or "none" (the target alone); k: an int or "auto" (see
    make_policy; for a tree, its depth limit); tree_budget: a tree's nodes (None: `tree_budget_for`). The
    policy's rule binds the drafter (`SpeculativeDecoder.set_drafting`)."""
    chosen = make_drafter(drafter, draft, k, target, tree_budget) if k != 0 else None
    policy = policy_for(k, target, draft, clock_free) if chosen else FixedK(0)
    return SpeculativeDecoder(target.model, chosen, policy, eos_token_ids(target),
                              reuse_prompts=computes_rows_alone(target.model))


def policy_for(k: int | str, target: LoadedModel, draft: LoadedModel | None,
               clock_free: bool = False) -> DraftLengthPolicy:
    """`make_policy` with the target's and the draft's forward costs as `specdec calibrate` measured them here."""
    return make_policy(k, clock_free, verify_curve(target), forward_curve(draft) if draft is not None else None)


def verify_curve(target: LoadedModel) -> dict[int, float] | None:
    """What `specdec calibrate` measured on this machine for the target as loaded (None: not measured): its
    `forward_curve`, read as what a verify of n tokens costs."""
    return forward_curve(target)


# Batch sizes the default is chosen among: the token counts `specdec calibrate` measures.
BATCH_SIZES = (1, 2, 4, 8, 16)
BATCH_GAIN = 1.1  # doubling the batch must bring at least 10% more tokens per forward-second


DEFAULT_BATCH_SIZE = 8  # without a calibration: a forward of 8 rows costs well under 8 of one row, flat verify or not


def forward_curve(model: LoadedModel) -> dict[int, float] | None:
    """A forward's seconds per new-token count for `model` as loaded, as `specdec calibrate` measured it on this
    machine (None: not measured). Never measured on the fly: what `run` decides from it (the batch size, each
    row's draft length) must be the same on every run of the same input, or sampled records would differ."""
    return calibrated_seconds(model.name, model.quantization, dtype_name(model.dtype))


def batch_size_for(curve: dict[int, float] | None) -> int:
    """The batch size `run` takes by default: double from 1 while a forward of twice the rows yields at least
    BATCH_GAIN times the tokens per second (a forward of B one-token rows costs about one of B tokens).
    Where a forward of a few tokens costs about one (int8 or bf16 on AVX512, a GPU) that runs to the largest
    measured; where it grows about linearly it stays small. No curve: DEFAULT_BATCH_SIZE."""
    if not curve:
        return DEFAULT_BATCH_SIZE
    chosen = 1
    for size in BATCH_SIZES[1:]:
        if size not in curve or chosen not in curve:
            break
        if (size / curve[size]) < BATCH_GAIN * (chosen / curve[chosen]):
            break
        chosen = size
    return chosen


def batched_note(target: LoadedModel, draft: LoadedModel | None, drafter: str) -> str | None:
    """Why `run` must decode one request at a time with these models (None: it can batch): a model whose
    attention takes no packed 4D mask (flash or flex attention, a sliding window), or a draft of another tokenizer
    (the batched engine drafts in the target's ids)."""
    if drafter in ("model", "cascade", "tree") and cross_vocabulary(draft):
        return ("the draft has another tokenizer than the target; requests run one at a time (a batch drafts only "
                "with a draft of the target's tokenizer)")
    for role, model in (("target", target), ("draft", draft if drafter in ("model", "cascade", "tree") else None)):
        if model is not None and not tree_capable(model.model):
            attention = getattr(model.model.config, "_attn_implementation", None)
            return (f"the {role} ({attention} attention) cannot take the packed mask of a batch; requests run one "
                    "at a time (batches need eager, sdpa or int8/int4 attention and no sliding window)")
    return None


def build_batched_decoder(target: LoadedModel, draft: LoadedModel | None, drafter: str, k: int | str,
                          batch_size: int, target_curve: dict[int, float] | None = None,
                          draft_curve: dict[int, float] | None = None) -> BatchedDecoder:
    """The batched engine for `run` and `compare --batch-size`: drafter as for `build_decoder` (a tree drafts
    the cascade's chains in a batch: one path per row; the draft model scores its most frequent ids, `draft_vocabulary`, and
    reads DRAFT_WINDOW tokens of each prompt, as the one-sequence drafters do), k = auto priced by the models'
    forward-cost curves (given, else `forward_curve`; assumed shapes where not calibrated) and checked against the
    run's own clock (`DraftingGate`: a step drafts only where drafting measured faster than not; a seeded sampled
    row never follows the clock, so its record stays the same on every run)."""
    batched_drafter = "cascade" if drafter == "tree" else drafter  # a tree's lookups first, then the model's chains
    if k == 0:  # k = 0: the target alone, whatever the drafter
        batched_drafter = "none"
    uses_draft = batched_drafter in ("model", "cascade")
    if uses_draft and draft is None:
        raise InputError(f"the {drafter} drafter needs a draft model", "pass --draft NAME, or --drafter ngram")
    if uses_draft and cross_vocabulary(draft):
        raise InputError("a batch drafts only with a draft of the target's tokenizer; this draft has another one",
                         "compare one request at a time (leave out --batch-size), or use --drafter ngram")
    vocabulary = draft_vocabulary(draft.tokenizer, draft.vocab_size) if uses_draft else None
    draft_model = None
    if uses_draft:
        draft_model = shared_subset_head(draft.model, vocabulary) if vocabulary is not None else draft.model
        draft_model = with_prompt_path(draft_model, draft.model)  # its window read as the one-sequence drafters do
    return BatchedDecoder(
        target.model, draft_model, batched_drafter, batch_size, k, eos_token_ids(target),
        verify_curve=(target_curve or forward_curve(target)) if k == "auto" else None,
        draft_curve=(draft_curve or forward_curve(draft)) if uses_draft and k == "auto" else None,
        lookup_factory=_lookup_factory(batched_drafter), draft_ids=vocabulary,
        draft_window=DRAFT_WINDOW if uses_draft else None,
        reuse_prompts=[role for role, model in (("target", target), ("draft", draft if uses_draft else None))
                       if model is not None and computes_rows_alone(model.model)],
        gate=DraftingGate() if k == "auto" else None,
    )


def _lookup_factory(drafter: str):
    """A new lookup index per row: the cascade's (2-gram matches and longer) or the n-gram drafter's."""
    if drafter == "cascade":
        return lambda: NgramDrafter(max_n=4, min_n=2)
    return NgramDrafter if drafter == "ngram" else None


def encode_chat(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> list[int]:
    """Token ids of a conversation through the model's own chat template; `continue_final_message`: the last message
    left open, for the model to go on with it (vLLM's and HF's name)."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise InputError("this model has no chat template", "give a raw prompt instead of messages")
    template = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
    messages = _roles_rendered(tokenizer, messages, template)
    try:
        ids = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False, **template)
    except TemplateError as error:  # the template's own raise_exception: Gemma's has no system role, for one
        raise ChatTemplateError(f"the model's chat template refuses these messages: {error}",
                         "change the roles it names (a system prompt can go at the start of the first user message)"
                         ) from None
    except ValueError as error:  # transformers' own checks, of continue_final_message for one
        raise ChatTemplateError(f"the model's chat template cannot take these messages: {str(error).strip()[:200]}",
                                "check the last message and the template options the line sets") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


COMMON_ROLES = ("system", "user", "assistant", "tool")


def _render(tokenizer, messages: Sequence[dict], template: dict) -> str | None:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, **template)
    except (TemplateError, ValueError):
        return None


def _roles_rendered(tokenizer, messages: Sequence[dict], template: dict) -> Sequence[dict]:
    """`messages`, with a role the chat template does not know refused rather than lost: a template skips a message
    whose role it does not name (Qwen's drops "developer", "System", "function" and keeps the rest), so its text never
    reached the model and nothing said so. A message is lost when the prompt is the same without it. OpenAI's
    "developer" is its newer name for "system", so where the template leaves it out it goes in as "system"."""
    unusual = [i for i, m in enumerate(messages) if m.get("role") not in COMMON_ROLES and m.get("content")]
    if not unusual:
        return messages

    def lost(candidate: Sequence[dict], indices: list[int]) -> list[int]:
        """Those of `indices` whose message the prompt is the same without (the whole prompt rendered once)."""
        whole = _render(tokenizer, candidate, template)
        return [] if whole is None else [
            i for i in indices if whole == _render(tokenizer, [*candidate[:i], *candidate[i + 1:]], template)]

    missing = lost(messages, unusual)
    if missing and all(messages[i]["role"] == "developer" for i in missing):
        as_system = [{**m, "role": "system"} if i in missing else m for i, m in enumerate(messages)]
        if not lost(as_system, missing):
            return as_system
    if not missing:
        return messages
    index = missing[0]
    role = messages[index]["role"]
    known = [r for r in COMMON_ROLES if r == role.strip().lower()]
    instead = f'write "{known[0]}"' if known else 'use "system", "user" or "assistant"'
    raise ChatTemplateError(f'messages[{index}] has the role "{role}", which the model\'s chat template leaves out of '
                            "the prompt: its text would never reach the model", instead)


def encode_folding_system(tokenizer, messages: Sequence[dict], **template) -> tuple[list[int], bool]:
    """(ids, folded): `messages` through the chat template; where the template refuses their leading system message
    (no system role: Gemma's raises on one), its text opens the first user message instead, as llama.cpp does for
    such templates. For a system prompt specdec adds (--system, a profile's); one the user wrote stays as written."""
    try:
        return encode_chat(tokenizer, messages, **template), False
    except ChatTemplateError:
        folded = fold_system(messages)
        if folded is None:
            raise
        return encode_chat(tokenizer, folded, **template), True


def fold_system(messages: Sequence[dict]) -> list[dict] | None:
    """The leading system message's text at the start of the first user message (None: there is no such pair)."""
    if len(messages) < 2 or messages[0].get("role") != "system" or messages[1].get("role") != "user":
        return None
    first = messages[1]
    return [{**first, "content": f"{messages[0]['content']}\n\n{first['content']}"}, *messages[2:]]


def encode_completion(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise InputError("the prompt is empty", "give at least one character of prompt")
    return list(ids)


@dataclass
class StopStrings:
    """A stop callback for the engine: True once the decoded output contains any stop string.
    `cut(text)` then removes the stop string and what follows (as OpenAI's API does)."""

    tokenizer: object
    stops: tuple[str, ...]

    def __call__(self, generated: list[int]) -> bool:
        if not self.stops:
            return False
        # Only the tail can hold a new match: decode enough tokens to cover the longest stop string.
        tail = self.tokenizer.decode(generated[-(max(map(len, self.stops)) + 8):], skip_special_tokens=False)
        return any(stop in tail for stop in self.stops)

    def cut(self, text: str) -> str:
        positions = [text.find(stop) for stop in self.stops if stop in text]
        return text[: min(positions)] if positions else text
