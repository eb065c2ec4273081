"""Speculative decoding: proposers fill draft tokens for running requests, the target model
verifies them in one step, and a policy keeps it only where it pays.

  config       SpeculativeConfig (the engine's `speculative_config`, vLLM's shape)
  ngram        prompt lookup: the request's own tokens propose what followed the last n-gram
  draft_model  a smaller model with the target's tokenizer drafts greedily, in an engine of its own
  proposer     the Proposer protocol, the built-in ones and those of plugins
  verification which drafts a step's sampled tokens accept (exact for greedy and sampled rows)
  policy       never slower: per-request acceptance and measured step costs decide each step
  speculator   the engine core's part: proposes before schedule(), learns after complete()
  stats        proposal / acceptance counters per method (/metrics)
"""
from tessellm.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
