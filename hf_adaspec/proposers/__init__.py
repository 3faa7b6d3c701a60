"""Drafters, one per module, behind the three-call ``Drafter`` interface (``base``)."""

from .base import CostlessDrafter, Drafter, DraftOffer, Proposal, Proposals, Rows, StopRule
from .draft_model import DraftModelProposer
from .prompt_lookup import PromptLookupProposer
from .suffix import SuffixMemory, SuffixProposer

__all__ = [
    "CostlessDrafter",
    "DraftModelProposer",
    "DraftOffer",
    "Drafter",
    "PromptLookupProposer",
    "Proposal",
    "Proposals",
    "Rows",
    "StopRule",
    "SuffixMemory",
    "SuffixProposer",
]
