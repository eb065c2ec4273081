"""The profiling forward pass a device runs to measure the activation peak before it sizes the
KV pool (DevicePlugin.kv_cache_budget).

It is one pass of the plan at the largest step the scheduler can form: max_num_batched_tokens
tokens in as few prefill sequences as max_model_len allows, and a logits row for each of up to
max_num_seqs sequences. It writes nothing (every slot is -1) and reads a scratch cache of one
zero block per layer through tables of block 0, so it needs no KV pool and leaves no state.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from tessellm.models.pipeline import HIDDEN_FEED
from tessellm.config import EngineConfig
from tessellm.device import DevicePlugin
from tessellm.graph.plan import KV_CACHE_FEED, ExecutionPlan, group_meta_feeds
from tessellm.lora.sites import LORA_SLOTS_FEED
from tessellm.kernels.attention_metadata import AttentionMetadata
from tessellm.models.spec import ModelSpec


def largest_step_lengths(max_tokens: int, max_model_len: int) -> list[int]:
    """Sequence lengths of the largest step: max_tokens split into max_model_len pieces."""
    full, rest = divmod(max_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


def profile_forward(plan: ExecutionPlan, spec: ModelSpec, config: EngineConfig,
                    device: DevicePlugin, dtype: torch.dtype,
                    max_model_len: int) -> Callable[[], None]:
    """A callable that runs the profiling pass (device tensors are made when it is called)."""

    def run() -> None:
        dev = torch.device(device.torch_device_type)
        lens = largest_step_lengths(config.max_num_batched_tokens, max_model_len)
        T, bs = sum(lens), config.block_size
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        width = math.ceil(max(lens) / bs)
        meta = AttentionMetadata(
            num_decodes=0, num_prefills=len(lens), num_decode_tokens=0, num_prefill_tokens=T,
            block_size=bs, slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros((len(lens), width), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens_host=lens, query_lens_host=lens, max_seq_len=max(lens),
            max_query_len=max(lens))
        positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
        n_logits = min(config.max_num_seqs, T)
        feeds = {"input_ids": torch.zeros(T, dtype=torch.int64, device=dev),
                 "positions": positions, "attn_meta": meta,
                 "logits_indices": torch.arange(T - n_logits, T, device=dev)}
        feeds.update({name: meta for name, _ in group_meta_feeds(plan.inputs)})   # all null
        scratch = (2, 1, spec.num_kv_heads, bs, spec.head_dim)
        feeds.update({KV_CACHE_FEED.format(layer=i): torch.zeros(scratch, dtype=dtype, device=dev)
                      for i in range(spec.num_layers)})
        if HIDDEN_FEED in plan.inputs:   # a later pipeline stage: the hidden state comes in
            feeds[HIDDEN_FEED] = torch.zeros((T, spec.hidden_size), dtype=dtype, device=dev)
        if LORA_SLOTS_FEED in plan.inputs:   # every row through slot 0: the LoRA terms' peak
            feeds[LORA_SLOTS_FEED] = torch.zeros(T, dtype=torch.int64, device=dev)
        plan.run(feeds)

    return run
