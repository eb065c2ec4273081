"""How many rows a step may have, and up to how many rows decode graphs / programs cover.

A row is one sampled sequence position of a step: a decode, a prompt chunk, or with
speculation one of a verify entry's d + 1 decode rows (tessellm.engine.step_inputs). So a
step has at most max_num_seqs x (1 + k) rows, and decode graphs (CUDA graphs, the CPU
plugin's native programs) are made up to that, at most max(max_num_seqs,
MAX_VERIFY_GRAPH_ROWS): wider verify steps run eagerly. The runner's buffers and the
profiler's replayed buckets both follow these numbers.
"""
from __future__ import annotations

from tessellm.config import EngineConfig

MAX_VERIFY_GRAPH_ROWS = 64


def max_step_rows(config: EngineConfig) -> int:
    spec = config.speculative_config
    return config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))


def max_graph_rows(config: EngineConfig) -> int:
    return max(config.max_num_seqs, min(max_step_rows(config), MAX_VERIFY_GRAPH_ROWS))
