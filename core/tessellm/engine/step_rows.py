"""How many rows a step may have, and up to how many rows decode graphs / programs cover.

A row is one sampled sequence position of a step: a decode, a prompt chunk, or with
speculation one of a verify entry's d + 1 decode rows (tessellm.engine.step_inputs). Every
row is one of the step's tokens, so a step has at most min(max_num_seqs x (1 + k),
max_num_batched_tokens) rows, and decode graphs (CUDA graphs, the CPU plugin's native
programs) are made up to that, at most max(max_num_seqs, MAX_VERIFY_GRAPH_ROWS): wider
verify steps run eagerly. The runner's buffers and the
profiler's replayed buckets both follow these numbers.
"""
from __future__ import annotations

from tessellm.config import EngineConfig

MAX_VERIFY_GRAPH_ROWS = 64


def max_step_rows(config: EngineConfig) -> int:
    spec = config.speculative_config
    return min(config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)),
               config.max_num_batched_tokens)


def max_graph_rows(config: EngineConfig) -> int:
    rows = max_step_rows(config)
    return min(max(config.max_num_seqs, min(rows, MAX_VERIFY_GRAPH_ROWS)), rows)
