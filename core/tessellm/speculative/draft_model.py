"""The `draft_model` proposer: a smaller model sharing the target's tokenizer drafts greedily.

The draft runs in an engine of its own (LLMEngine: its own plan and kernels chosen by the
profiler, its own paged KV cache with prefix caching, on the target's device), built once
when the target engine is. Each step, every eligible request's whole sequence (prompt and
output, its last sampled token included) is a draft request of max_tokens = k, greedy; the
draft engine runs them to completion (one step for what its prefix cache does not hold, then
k - 1 decode steps, all requests batched) and their outputs are the drafts. Its blocks are
freed when a draft request finishes; the full blocks (of DRAFT_BLOCK_SIZE tokens) stay in its
prefix cache, so the next step recomputes only the tokens since the last full block (and
whatever the target did not accept). Greedy drafts are deterministic given the tokens, so verification stays exact.

Vocabulary: the draft's tokenizer must map every token to the same id as the target's
(checked at load: a ConfigError naming the first difference); drafts at ids the target's
embedding does not have are cut, and a request the draft engine cannot take (past its
context or pool, ids its embedding lacks) gets no drafts. A draft step that fails is logged and its requests decode
without drafts (the target's outputs do not depend on drafts).

Layering: the draft is an engine, so this module imports tessellm.engine when it is built
(the one place the speculative package reaches up; nothing imports it at module level).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tessellm.errors import ConfigError, InvalidRequestError, TessellmError
from tessellm.speculative.config import SpeculativeConfig

log = logging.getLogger(__name__)

# the draft's KV block size: its prefix cache keeps full blocks, and a step recomputes the
# tokens after the last one (as a prefill step): small blocks keep that tail short (SmolLM2
# Q4_1, 3 drafts: 45 ms a step with blocks of 16, 36 ms with 4)
DRAFT_BLOCK_SIZE = 4


def token_vocab(tokenizer: Any) -> dict[str, int]:
    """Token string -> id of an HF tokenizer or the engine core's (its Rust backend)."""
    get = getattr(tokenizer, "get_vocab", None)
    if get is not None:
        return dict(get())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"cannot read the vocabulary of tokenizer {type(tokenizer).__name__}")
    return dict(backend.get_vocab(with_added_tokens=True))


def check_same_vocab(target: Any, draft: Any, draft_name: str) -> None:
    """Raise ConfigError unless every token has the same id in both tokenizers."""
    if target is None or draft is None:
        raise ConfigError("speculative method 'draft_model' needs the tokenizers of the target "
                          "and of the draft to check their vocabularies")
    a, b = token_vocab(target), token_vocab(draft)
    if a == b:
        return
    diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:1]
    where = f"; first difference: token {diff[0][0]!r} (id {diff[0][1]})" if diff else ""
    raise ConfigError(f"the draft model {draft_name!r} does not share the target's "
                      f"vocabulary ({len(b)} tokens vs {len(a)}{where}): a draft model must "
                      "use the target's tokenizer")


class DraftModelProposer:
    method = "draft_model"
    costly = True   # the speculator asks only for the proposals its policy takes

    def __init__(self, config: SpeculativeConfig, parts: Any) -> None:
        from tessellm.config import EngineConfig
        from tessellm.engine.builder import build_engine_parts
        from tessellm.engine.kernel_warmup import prepare_kernels
        from tessellm.engine.llm_engine import LLMEngine
        target = parts.config
        draft_config = EngineConfig(
            model=config.model, quantization=config.quantization or "auto",
            device=parts.device.name, max_num_seqs=target.max_num_seqs,
            max_num_batched_tokens=target.max_num_batched_tokens,
            num_kv_blocks=parts.num_kv_blocks * target.block_size // DRAFT_BLOCK_SIZE,
            block_size=DRAFT_BLOCK_SIZE,
            enable_prefix_caching=True, kernel_selection=target.kernel_selection,
            cache_dir=target.cache_dir, num_threads=target.num_threads,
            packed_activations=target.packed_activations, load_progress=False)
        draft_parts = build_engine_parts(draft_config)
        check_same_vocab(parts.tokenizer, draft_parts.tokenizer, config.model or "")
        self.engine = LLMEngine(draft_parts)
        if draft_config.kernel_selection != "first":
            prepare_kernels(self.engine)
        self.vocab_size = parts.spec.vocab_size
        self.failed_steps = 0

    def propose(self, requests: Sequence[Any], max_drafts: Sequence[int]) -> list[list[int]]:
        from tessellm.sampling_params import SamplingParams
        engine = self.engine
        queued: list[Any] = []
        for request, k in zip(requests, max_drafts):
            tokens = request.token_ids_slice(0, request.num_known_tokens)
            try:   # past the draft's context or pool, ids its embedding lacks: no drafts
                queued.append(engine.add_request(
                    tokens, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True),
                    request_id=f"draft-{request.request_id}"))
            except InvalidRequestError:
                queued.append(None)
        try:
            while engine.has_unfinished():
                engine.step()
        except TessellmError as e:   # its requests were failed (blocks freed)
            self.failed_steps += 1
            log.warning("speculative draft model: a draft step failed (%s); these requests "
                        "decode without drafts this step", e)
            for r in queued:
                if r is not None and not r.is_finished:
                    engine.abort(r.request_id)
            return [[] for _ in requests]
        out = []
        for r in queued:
            drafts = [] if r is None else list(r.output_token_ids)
            cut = next((i for i, t in enumerate(drafts) if t >= self.vocab_size), len(drafts))
            out.append(drafts[:cut])
        return out

    def release(self, request: Any) -> None:
        return None   # draft requests finish inside propose(); their blocks are already free

