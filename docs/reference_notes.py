"""The words of the generated reference pages that the models do not carry (docs/reference_gen.py).

A note explains a field whose model gives it no `description`; a field that has one uses it.
Every mapping is read-only: the generator refuses notes for fields that do not exist and
fields that have neither.
"""
from __future__ import annotations

from types import MappingProxyType

CONFIG_INTRO = """
Every option, with its type, default and bounds, as the configuration models declare them
(`tessellm.config.EngineConfig`, `tessellm.server.server_config.ServerConfig`). Unknown keys
are an error that names the key; so is a value of the wrong type.

`tessellm serve --config FILE` reads one flat YAML mapping holding engine and server options
side by side. Precedence, lowest first: the defaults below, the environment
(`TESSELLM_API_KEY` only), the YAML file, command-line flags (`--max-num-seqs` for
`max_num_seqs`, and so on; `tessellm serve --help` lists them).

```yaml
# engine.yaml
model: ../shared/models/stories260K-hf
dtype: float32
max_num_seqs: 16
kernel_selection: profile
port: 8000
max_queue: 64
```
"""

ENGINE_NOTES = MappingProxyType({
    "quantization": "weights in memory: `auto` keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 "
                    "and K-quant (Q4_K/Q5_K/Q6_K) tensors packed (other types are dequantized "
                    "at load) and loads safetensors as is; "
                    "`none` dequantizes everything to the compute dtype; `int8` (= `q8_0`), "
                    "`q4_0`, `q4_1` quantize a safetensors model's linears weight-only at load",
    "dtype": "compute dtype; `auto` is the checkpoint's (float32 for GGUF files)",
    "max_num_seqs": "most sequences in one engine step",
    "max_num_batched_tokens": "token budget of one engine step (prefill chunks and decodes "
                              "together)",
    "max_model_len": "longest sequence (prompt + output); default the model's context length",
    "block_size": "tokens per KV cache block",
    "enable_prefix_caching": "reuse the KV of full blocks whose tokens (and salt) match an "
                             "earlier request's",
    "num_kv_blocks": "KV pool size in blocks (give this or kv_cache_bytes, not both)",
    "kv_cache_bytes": "KV pool size in bytes; default: measured on devices that measure "
                      "(cuda), else 4 GiB, capped at what max_num_seqs full sequences use",
    "gpu_memory_utilization": "on devices that size the KV pool from measured memory (cuda): "
                              "the fraction of total device memory the engine may use, weights "
                              "and a profiling pass included; ignored when num_kv_blocks or "
                              "kv_cache_bytes is given",
    "enforce_eager": "on devices that capture decode steps as graphs (cuda's CUDA graphs): run "
                     "every step eagerly",
    "kernel_selection": "`profile`: the runtime profiler ranks the kernels of each op and "
                        "token bucket and takes the fastest one that agrees with the reference "
                        "(decisions cached on disk); `first`: each op's first kernel; "
                        "`{op: kernel}`: that kernel for that op, `profile` for the rest",
    "graph_passes": "`default` runs the fusion passes (each where the device has the fused "
                    "op's kernel) and plugins' passes; `none` runs only dead-code removal",
    "num_threads": "torch's CPU threads (per rank with tensor parallelism); default all cores",
    "tensor_parallel_size": "ranks the model is split over, one process and device each "
                            "(see Tensor parallelism)",
    "pipeline_parallel_size": "stages the decoder layers are split into, each of "
                              "tensor_parallel_size ranks (see Tensor parallelism)",
    "pipeline_micro_batches": "most micro-batches a pipelined step's requests are split "
                              "into so the stages overlap (default: pipeline_parallel_size; "
                              "1: the whole step through the stages in turn)",
    "pipeline_micro_batch_tokens": "a pipelined step is split only into micro-batches of at "
                                   "least this many tokens on average (each re-reads the "
                                   "stage's weights; decodes of few requests stay whole)",
    "distributed_executor_backend": "who starts the ranks: mp (local processes, or a "
                                    "launcher such as torchrun) or ray (Ray actors in a "
                                    "placement group; see Tensor parallelism)",
    "ray_address": "the Ray cluster to join (`auto`, `HOST:PORT`) for the ray backend's "
                   "ranks and the server's data-parallel replicas; default: start a local one",
    "ray_placement_strategy": "the ray backend's placement group: the worker ranks on as few "
                              "nodes as hold them (`PACK`) or one per node as far as the nodes "
                              "go (`SPREAD`)",
    "distributed_timeout_s": "a collective that waits longer fails (never hangs)",
    "load_progress": "show a progress bar while loading weights",
    "priority_levels": "priority classes of requests: 0 (most urgent) to priority_levels - 1",
    "aging_interval_steps": "a waiting request rises one priority level per this many steps "
                            "waited (0: no aging)",
    "preemption_mode": "what happens to a request preempted for a more urgent one: "
                       "`recompute` frees its blocks and recomputes them on resume; `swap` "
                       "copies its KV to a host pool and back",
    "num_host_kv_blocks": "swap: the host pool in blocks (default as many as the device "
                          "pool, at most half the host's available memory)",
    "swap_space_bytes": "swap: the host pool in bytes (give this or num_host_kv_blocks)",
    "sla_itl_p99_ms": "SLA batch sizing (off unless set): the running-batch cap shrinks while "
                      "the p99 inter-token latency is above this",
    "sla_target_tokens_per_s": "SLA batch sizing: the cap grows while throughput is below this",
    "sla_window_steps": "SLA batch sizing: steps in the latency window",
    "sla_min_num_seqs": "SLA batch sizing: the cap never goes below this",
    "enable_lora": "serve LoRA adapters (PEFT format) over the base model: requests name one "
                   "(`LLM.generate(..., lora_request=LoRARequest(...))`, the server's `model` "
                   "field); see Multi-LoRA",
    "max_loras": "LoRA: most distinct adapters in one step (the device slot table); a request "
                 "of another adapter waits until one of them has no running request",
    "max_lora_rank": "LoRA: largest adapter rank accepted (every slot is this wide)",
    "max_cpu_loras": "LoRA: loaded adapters kept on the host (LRU); default max_loras",
})

SERVER_NOTES = MappingProxyType({})

REQUESTS_INTRO = """
Every field the two generation endpoints accept, from the request schemas
(`tessellm.server.protocol`). Validation is strict: JSON types must match (`"n": "2"` is a 400,
never coerced) and an unknown field is a 400 naming it. Fields OpenAI has that this server does
not implement (`echo`, `suffix`, `best_of`, `logit_bias`) accept their default only; any other
value is a clear 400. Extensions beyond OpenAI, named as vLLM names them: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `priority`. With the `openai` client,
pass extensions through `extra_body={...}`.
"""

_SAMPLING = {
    "model": "the served model: its id (`GET /v1/models`) or the `--model` text or path it "
             "was started with; absent means that one; any other name is a 404",
    "temperature": "0 is greedy",
    "top_p": "nucleus sampling; 1 disables it",
    "top_k": "keep the k most likely tokens; None or <= 0 disables it (extension)",
    "min_p": "drop tokens less likely than min_p x the most likely one; 0 disables it "
             "(extension)",
    "seed": "reproducible sampling for this request, whatever else shares its batch",
    "stop": "stop strings (at most 16, non-empty); the output ends before the first one",
    "stop_token_ids": "token ids that end the output (extension)",
    "n": "samples of the prompt (at most the server's max_n); the prompt is computed once",
    "stream": "answer with server-sent events, one chunk per new text",
    "stream_options": "`{\"include_usage\": true}` adds a last chunk with the token usage",
    "presence_penalty": "OpenAI's presence penalty over the generated tokens",
    "frequency_penalty": "OpenAI's frequency penalty over the generated tokens",
    "repetition_penalty": "Hugging Face's penalty over prompt and generated tokens; 1 "
                          "disables it (extension)",
    "ignore_eos": "keep generating past the end-of-sequence token (extension)",
    "priority": "0 is the most urgent class; a waiting urgent request may preempt running "
                "less urgent ones (extension)",
    "user": "OpenAI's end-user id: accepted, not used",
    "logit_bias": "`{\"token id\": bias}` added to the logits after the penalties, each bias "
                  "in [-100, 100] (OpenAI's semantics; ids checked against the vocabulary)",
    "response_format": "`{\"type\": \"text\"}`, `{\"type\": \"json_object\"}` (any JSON "
                       "object) or `{\"type\": \"json_schema\", \"json_schema\": {\"name\", "
                       "\"schema\", \"strict\"}}`: the output is constrained to it (enforced "
                       "by a grammar, strict or not)",
    "structured_outputs": "vLLM's constraint: exactly one of `json` (a schema), `json_object`, "
                          "`regex`, `choice` (a list of strings), `grammar` (Lark or GBNF), "
                          "with optional `disable_any_whitespace` (extension)",
    "num_speculative_tokens": "on a server started with `--speculative-config`: this "
                              "request's cap on draft tokens per step, 0 for none (more than "
                              "the server's k is a 400); the output is the same (extension)",
    "guided_json": "vLLM's older name for structured_outputs.json (extension)",
    "guided_regex": "vLLM's older name for structured_outputs.regex (extension)",
    "guided_choice": "vLLM's older name for structured_outputs.choice (extension)",
    "guided_grammar": "vLLM's older name for structured_outputs.grammar (extension)",
}

CHAT_NOTES = MappingProxyType({
    **_SAMPLING,
    "max_tokens": "most tokens to generate; default the context left after the prompt",
    "messages": "the conversation: `role` (system, developer, user, assistant, tool), "
                "`content` (a string or a list of `{\"type\": \"text\", \"text\": ...}` parts), "
                "optional `name`, an assistant turn's `tool_calls`, a tool turn's "
                "`tool_call_id`; rendered with the chat template",
    "tools": "functions the model may call: `{\"type\": \"function\", \"function\": "
             "{\"name\", \"description\", \"parameters\"}}` (parameters: a JSON schema of "
             "type object); rendered by the chat template if it knows tools, else by a "
             "generic prompt",
    "tool_choice": "`none`, `auto` (the default with tools: the model decides), `required` "
                   "or `{\"type\": \"function\", \"function\": {\"name\"}}`: a valid call "
                   "of a listed (or the named) function, enforced by a grammar",
    "parallel_tool_calls": "with required or named tool_choice: allow more than one call",
    "max_completion_tokens": "OpenAI's newer name for max_tokens (wins when both are given)",
    "logprobs": "return the sampled tokens' log probabilities",
    "top_logprobs": "with logprobs: also the most likely tokens at each position (at most 20)",
})

COMPLETION_NOTES = MappingProxyType({
    **_SAMPLING,
    "max_tokens": "most tokens to generate",
    "prompt": "a string, a list of token ids, or a list of either (one choice per prompt "
              "and sample)",
    "logprobs": "return the sampled tokens' log probabilities and this many most likely "
                "tokens at each position (at most 20)",
    "echo": "each choice's text starts with its prompt; with logprobs, so do its logprobs "
            "(the first prompt token's are null)",
    "suffix": "not supported: only an empty or absent value is accepted",
    "best_of": "accepted only when equal to n",
})

STREAM_OPTIONS_NOTES = MappingProxyType({
    "include_usage": "a last chunk carries `usage` (prompt, completion and total tokens)",
})

METRICS_INTRO = """
`GET /metrics` answers in Prometheus' text format; every name starts with `tessellm:`. Engine
state is read at scrape time from the engine core's latest report (sent after every step and
every 0.25 s while idle); request latencies are observed as they happen. A counter's sample is
its name with `_total`; a histogram has `_bucket` (with `le`), `_count` and `_sum` samples.
The table is generated from the metrics the server registers (`tessellm.server.metrics`).
`tessellm:device_counter` carries the device plugin's own counters (xla:
`xla_compilations`, ...), one `name` each. Behind `--data-parallel-size N` every series read
from an engine core (all but the request histograms, `request_finished` and the speculation
and LoRA counters, which are the replicas' sums) carries a `replica` label (`replica-0`, ...),
one sample per replica (docs/ray.md).
"""
