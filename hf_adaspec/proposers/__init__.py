"""Drafters, one per module, behind the row-batched ``Proposer`` interface."""

from .base import Proposal, Proposer, Rows, StopRule
from .draft_model import DraftModelProposer
from .prompt_lookup import PromptLookupProposer
from .suffix import SuffixMemory, SuffixProposer

__all__ = ["DraftModelProposer", "PromptLookupProposer", "Proposal", "Proposer", "Rows", "StopRule", "SuffixMemory",
           "SuffixProposer"]
