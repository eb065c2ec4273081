"""A speculative proposer that drafts from what earlier requests generated."""
