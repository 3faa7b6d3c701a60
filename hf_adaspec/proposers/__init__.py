"""Drafters (one per module) behind the ``Proposer`` interface."""

from .base import Proposal, Proposer
from .draft_model import DraftModelProposer
from .prompt_lookup import PromptLookupProposer

__all__ = ["DraftModelProposer", "PromptLookupProposer", "Proposal", "Proposer"]
