"""Messages between the front end and the engine-core process (msgpack through msgspec).

Everything that crosses the process boundary is one of these typed structs, encoded with
msgspec's msgpack codec and decoded against the union type: nothing is ever unpickled, and a
malformed message is a DecodeError, never code execution. Front end -> core: AddRequest,
FinishRequests, Shutdown. Core -> front end: Ready (once, after load and kernel profiling),
StartupFailed, StepOutputs (after every step, and as a heartbeat while idle), Heartbeat (while
a step runs long), CoreFailed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from tessellm.engine.token_logprobs import TokenLogprobs
from tessellm.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    """n > 1: copy-on-write siblings "<request_id>-<i>" (LLMEngine.add_request_group)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]          # SamplingParams fields (re-validated in the core)
    priority: int = 0
    n: int = 1
    arrival: float = 0.0            # front end's time.monotonic()
    lora: list[Any] | None = None   # LoRA: [name, int id, path] (None: the base model)


class FinishRequests(msgspec.Struct, tag=True):
    """Abort (client gone) or stop (a stop string matched in the front end)."""

    request_ids: list[str]
    reason: str = "abort"           # "abort" | "stop"


class UnloadAdapter(msgspec.Struct, tag=True):
    """Drop a LoRA adapter from the core's host cache and slot table (requests holding it
    keep it until they finish)."""

    lora_int_id: int


class Shutdown(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    """What the front end needs to validate requests (RequestLimits) and describe the model."""

    pid: int
    device: str
    dtype: str
    max_model_len: int
    vocab_size: int
    priority_levels: int
    block_size: int
    num_kv_blocks: int
    weight_bytes: int
    eos_token_ids: list[int]
    kernel_choices: dict[str, str]  # profiled "op|dtype|T<bucket>|dims" -> kernel name
    plugin: str = ""                # entry-point name of the plugin providing the device
    plugin_version: str = ""        # its distribution's version
    max_num_seqs: int = 0           # the running batch's sequence cap (0: unknown)
    prompt_logprobs: bool = True    # False on a device whose steps have static shapes
    speculative_tokens: int = 0     # the engine's k (0: it does not speculate)
    max_loras: int = 0              # LoRA: adapters running at once (0: LoRA is off)
    max_lora_rank: int = 0
    kv_windows: tuple[int, ...] = (0,)   # the pool's block-table groups' windows (RequestLimits)
    step_tokens: int = 0            # max_num_batched_tokens (RequestLimits)


class StartupFailed(msgspec.Struct, tag=True):
    error: str


class CoreFailed(msgspec.Struct, tag=True):
    """The core loop itself raised (a bug): every open request has failed with it."""

    error: str


class Heartbeat(msgspec.Struct, tag=True):
    """Sent by the core's heartbeat thread when the step loop has sent nothing for a heartbeat
    interval (a long step): the process is alive, and its current step has run `step_age_s`."""

    step_age_s: float
    sent_at: float


class TokenDelta(msgspec.Struct, array_like=True):
    """One request's new tokens since its previous delta (and their logprobs, when asked).
    finish_reason "rejected": the core refused the request at admission (`error` says why;
    a 400 to the client, where an "error" is a failed step)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[TokenLogprobs] = []   # once, all of them (prompt tokens 1..)

    @classmethod
    def final(cls, request_id: str, finish_reason: str, error: str,
              num_prompt_tokens: int = 0, num_output_tokens: int = 0) -> TokenDelta:
        """A request's last delta with no new tokens: rejected at admission, or failed."""
        return cls(request_id=request_id, token_ids=[], logprobs=[], finished=True,
                   finish_reason=finish_reason, error=error,
                   num_prompt_tokens=num_prompt_tokens, num_output_tokens=num_output_tokens)


class CoreStats(msgspec.Struct, array_like=True):
    """The core's counters as of a report; CoreStats() is the state before any report."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_steps: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    host_syncs: int = 0
    stage_seconds: dict[str, float] = {}
    device_counters: dict[str, float] = {}   # DevicePlugin.runtime_counters() (xla: compiles)
    running_by_priority: list[int] = []  # [i]: running requests of priority class i
    waiting_by_priority: list[int] = []  # [i]: waiting (incl. preempted) ones of class i
    num_overlapped_steps: int = 0        # launched while the previous step was in flight
    # speculative decoding (tessellm.speculative.stats.SpecStats; method "" when off)
    spec_method: str = ""
    spec_proposals: int = 0
    spec_refused_proposals: int = 0
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # LoRA: per adapter name, [requests, prompt tokens, generated tokens] since start
    lora_counts: dict[str, list[int]] = {}


class StepOutputs(msgspec.Struct, tag=True):
    deltas: list[TokenDelta]
    stats: CoreStats
    first_scheduled: list[tuple[str, float]]  # (request id, seconds it waited), new ones
    sent_at: float                            # core's time.time() when sent (IPC time)
    # a core that publishes its prefix cache (EngineCoreLoop(publish_blocks=True)): the block
    # hashes cached and evicted since its previous StepOutputs (CachedBlockMap.take_changes)
    stored_blocks: list[bytes] = []
    removed_blocks: list[bytes] = []


ToCore = AddRequest | FinishRequests | UnloadAdapter | Shutdown
FromCore = Ready | StartupFailed | CoreFailed | StepOutputs | Heartbeat


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def params_from_wire(fields: dict[str, Any]) -> SamplingParams:
    """Rebuild (and so re-validate) SamplingParams; unknown fields are an error."""
    return SamplingParams(**fields)


class Codec:
    """One encoder and one decoder per direction (msgspec reuses their buffers)."""

    def __init__(self, decode_type: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)

    def encode(self, message: Any) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes) -> Any:
        return self._decoder.decode(data)
