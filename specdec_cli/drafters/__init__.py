"""Concrete drafters: a draft model (its chains, or token trees: tree.py), a draft model of another tokenizer
(cross_vocab.py), model-free n-gram lookup, and the cascade of lookups and a draft model.

They implement the engine's interface (`specdec_cli.engine.draft`), re-exported here for convenience."""

from specdec_cli.drafters.cascade import CascadeDrafter
from specdec_cli.drafters.cross_vocab import CrossVocabDrafter
from specdec_cli.drafters.model import DraftModelDrafter
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.engine.draft import EMPTY_DRAFT, Draft, DraftRule, Drafter

__all__ = ["CascadeDrafter", "CrossVocabDrafter", "EMPTY_DRAFT", "Draft", "DraftModelDrafter", "DraftRule", "Drafter",
           "NgramDrafter"]
