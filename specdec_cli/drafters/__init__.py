"""Drafters: one interface (`Drafter`), a draft model and model-free n-gram lookup."""

from specdec_cli.drafters.cascade import CascadeDrafter
from specdec_cli.drafters.base import EMPTY_DRAFT, Draft, Drafter
from specdec_cli.drafters.model import DraftModelDrafter
from specdec_cli.drafters.ngram import NgramDrafter

__all__ = ["CascadeDrafter", "EMPTY_DRAFT", "Draft", "DraftModelDrafter", "Drafter", "NgramDrafter"]
