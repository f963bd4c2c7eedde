"""A draft model of another tokenizer (another model family): it drafts text, and the target verifies that text
as its own token ids.

Each step:
  1. read    — the target ids the draft reads (the prompt's last `window` tokens and all after them, `DraftWindow`)
               become text, and that text the draft's own ids: its tokenizer's tokenisation of the whole text, so
               the draft's cache holds what the draft would read had it written the accepted text itself;
  2. draft   — the draft model drafts up to k tokens greedily in its own vocabulary, on its own cache
               (`DraftModelDrafter`: its odds cut, subset head and prompt path as for a draft of the target's
               tokenizer);
  3. convert — the drafted tokens' text, after the accepted text, becomes target ids. The accepted target ids stay
               as they are (the new text alone is tokenised, after a fixed anchor, so that it tokenises as it would
               after other text); the last word is held back (more text after it could tokenise it otherwise, and
               the target, reading on, would not have split it there; of a single word, its last target id); a
               draft special token ends the draft, its text kept only where the target's vocabulary has that
               string as a token of its own;
  4. propose — at most k target ids, without probabilities.
After the target's verdict (`update`) the draft rolls back: the accepted text's tokenisation in the draft's
vocabulary shares a prefix with what its cache holds, the cache is cropped to that prefix (the draft tokens the
target rejected go, and so does a draft token whose text the accepted text splits), and the next forward feeds
the rest (`CachedModel.extend`).

Lossless whatever the draft proposes: the engine verifies a draft without probabilities as a point mass on each
proposed id (engine/acceptance.py). Greedy keeps the longest prefix equal to the target's own argmax; sampling
accepts a proposed x with probability min(1, p(x) / 1) = p(x) and draws a rejection's correction from p with x
removed, renormalised, which gives p exactly. The draft's own probabilities are over its vocabulary and never
reach the engine; drafting greedily in sampling too keeps the proposal a function of the accepted text.

k counts the draft model's tokens (its forwards are what drafting costs, and the policy prices them per proposed
token as it prices any draft model's) and caps the target ids proposed.

Special tokens and chat templates are each model's own. The draft reads the conversation as the target's chat
template wrote it: the target's ids decoded to text with its special tokens written out (a leading BOS left out),
then tokenised by the draft's tokenizer with its own special tokens (its BOS where it adds one; a string that is
one of its own special tokens, such as ChatML's <|im_start|> in both families, becomes that token). A target that
has just emitted part of a character (a byte-level token) drafts nothing until the character is whole.

Only the drafter knows text and tokenizers; the engine sees target ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec_cli.drafters.model import DraftModelDrafter
from specdec_cli.drafters.window import DraftWindow
from specdec_cli.engine.draft import EMPTY_DRAFT, Draft, DraftRule, Drafter
from specdec_cli.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from specdec_cli.engine.kv import CachedModel

GREEDY = SamplingParams()
# Text the new text is tokenised after, then cut off: a boundary no tokenizer merges across (a newline), so that
# the new text tokenises as it does after other text (a SentencePiece tokenizer otherwise gives a text's first
# word a leading space).
ANCHOR = "\n"
# Draft tokens of context decoded together with a draft: a token's text can depend on the one before it (a
# SentencePiece decoder drops the space of the first token it decodes).
DECODE_CONTEXT = 8
REPLACEMENT = "\ufffd"  # what decoding gives for a character whose bytes are not all there yet


class CrossVocabDrafter(Drafter):
    name = "cross-vocabulary"

    def __init__(self, model: torch.nn.Module, target_tokenizer, draft_tokenizer, token_ids: torch.Tensor | None = None,
                 window: int | None = None, share_head: bool = False, min_survival: float = 0.0) -> None:
        """model: the draft model, of `draft_tokenizer`'s vocabulary; token_ids: the draft ids it scores (a subset
        head, as `DraftModelDrafter`'s); window: target tokens of the first prompt it reads (None: all)."""
        self.model_drafter = DraftModelDrafter(model, token_ids=token_ids, share_head=share_head,
                                               min_survival=min_survival)
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.window = DraftWindow(window)
        self.target_prefix = _added_before(target_tokenizer)  # a BOS the target's tokenizer adds: not text
        self.draft_prefix = _added_before(draft_tokenizer)  # the draft's own, which it reads first
        self.draft_special = frozenset(_special_ids(draft_tokenizer))
        self.target_added = frozenset(target_tokenizer.get_added_vocab())
        self.anchor_ids = _encode(target_tokenizer, ANCHOR)
        backend = getattr(target_tokenizer, "backend_tokenizer", None)
        self.words = getattr(backend, "pre_tokenizer", None)  # splits text into the pieces its BPE merges within
        self._read: tuple[list[int], list[int]] = ([], [])  # the last target ids read, and their draft ids

    @property
    def runner(self) -> "CachedModel":
        """The draft model's cache."""
        return self.model_drafter.runner

    def propose(self, ids: Sequence[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        if k <= 0:
            return EMPTY_DRAFT
        context = self.draft_context(ids)
        room = self.model_drafter.context
        if not context or (room is not None and len(context) + k > room):
            return EMPTY_DRAFT
        drafted = self.model_drafter.propose(context, k, GREEDY, generator).ids
        if not drafted:
            return EMPTY_DRAFT
        text, ended = self.drafted_text(context, drafted)
        return Draft(self.target_ids(text, ended)[:k])

    def update(self, ids: Sequence[int], drafted: int, accepted: int) -> None:
        """Roll the draft back to the accepted text: its cache keeps the prefix it shares with that text's
        tokenisation in the draft's vocabulary (the next forward feeds the rest). After a step that proposed nothing
        the next forward's shared-prefix rule alone crops it (no tokenising for a step the target took alone)."""
        if not drafted:
            return
        context = self.draft_context(ids)
        self.runner.crop(self.runner.shared_prefix(context))

    def draft_context(self, ids: Sequence[int]) -> list[int]:
        """The draft's ids of the text of the target ids it reads ([] while that text ends inside a character)."""
        seen = self.window.seen(ids)
        if seen == self._read[0]:
            return self._read[1]
        prefix = self.target_prefix
        text = _decode(self.target_tokenizer, seen[len(prefix):] if seen[: len(prefix)] == prefix else seen)
        context = [] if text.endswith(REPLACEMENT) else self.draft_prefix + _encode(self.draft_tokenizer, text)
        self._read = (seen, context)
        return context

    def drafted_text(self, context: list[int], drafted: list[int]) -> tuple[str, bool]:
        """(the text the draft tokens add after `context`, whether the draft ended: a special token stops it)."""
        end = next((i for i, token in enumerate(drafted) if token in self.draft_special), None)
        if end is not None:
            special = self.draft_tokenizer.convert_ids_to_tokens(drafted[end])
            drafted = drafted[: end + 1] if special in self.target_added else drafted[:end]
        head = context[-DECODE_CONTEXT:]
        before, after = _decode(self.draft_tokenizer, head), _decode(self.draft_tokenizer, head + drafted)
        text = after[len(before):] if after.startswith(before) else _decode(self.draft_tokenizer, drafted)
        return (text, True) if end is not None else (text.rstrip(REPLACEMENT), False)

    def target_ids(self, text: str, ended: bool) -> list[int]:
        """Target ids of `text`, to follow the accepted ids. Unless the draft ended, the last word is held back, or,
        where the text is one word (or the target's tokenizer splits no words), its last id."""
        pieces = self.words.pre_tokenize_str(text) if not ended and self.words is not None else []
        whole = len(pieces) > 1  # the last word can go whole
        if whole:
            text = text[: pieces[-1][1][0]]
        if not text:
            return []
        ids = _encode(self.target_tokenizer, ANCHOR + text)
        anchor = len(self.anchor_ids)
        ids = ids[anchor:] if ids[:anchor] == self.anchor_ids else _encode(self.target_tokenizer, text)
        return ids if ended or whole else ids[:-1]

    def reset(self) -> None:
        self.model_drafter.reset()
        self.window.reset()
        self._read = ([], [])

    def obey(self, rule: DraftRule) -> None:
        self.model_drafter.obey(rule)

    def context_length(self) -> int | None:
        """None: the draft's positions count its own tokens, not the target's; `propose` keeps within them."""
        return None


def _encode(tokenizer, text: str) -> list[int]:
    """The ids of `text`, no special tokens added: through a fast tokenizer's own backend where it has one (what
    transformers' `encode` calls, without its per-call bookkeeping, which a step would pay several times)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


def _decode(tokenizer, ids: Sequence[int]) -> str:
    """The text of `ids`, special tokens written out (through the backend, as `_encode`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(list(ids), skip_special_tokens=False)
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _special_ids(tokenizer) -> set[int]:
    """Every special token's id: the named ones (BOS, EOS, ...) and the added tokens marked special (ChatML's)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {token_id for token_id, token in added.items() if token.special}


def _added_before(tokenizer) -> list[int]:
    """The special ids the tokenizer puts before a text (a BOS; [] for most byte-level BPEs)."""
    plain, marked = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a", add_special_tokens=True)
    starts = [i for i in range(len(marked) - len(plain) + 1) if marked[i: i + len(plain)] == plain]
    return marked[: starts[0]] if starts else []
