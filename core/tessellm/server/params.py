"""From a validated HTTP request to the engine's SamplingParams, with the limits that need
the server's configuration or the prompt's length (the schema alone cannot check them)."""
from __future__ import annotations

from tessellm.constraints.structured_outputs import StructuredOutputs
from tessellm.errors import InvalidRequestError
from tessellm.sampling_params import SamplingParams
from tessellm.server.errors import APIError, bad_request
from tessellm.server.protocol import SamplingFields
from tessellm.server.server_config import ServerConfig


def check_limits(req: SamplingFields, config: ServerConfig, num_prompts: int = 1) -> None:
    """n and the number of prompts against the server's limits; a request with more
    sequences than may ever wait at once (n x prompts > max_queue) can never be taken: a 400,
    not a 503 its client would retry forever."""
    max_n = config.max_n
    if req.n > max_n:
        raise bad_request(f"n is {req.n}; this server allows at most {max_n}", "n")
    if num_prompts > max_n:
        raise bad_request(f"{num_prompts} prompts in one request; this server allows at most "
                          f"{max_n}", "prompt")
    if req.n * num_prompts > config.max_queue:
        raise bad_request(f"the request asks for {req.n * num_prompts} sequences (n x prompts); "
                          f"this server queues at most {config.max_queue} at once", "n")


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       param: str = "max_tokens") -> int:
    """The number of tokens to generate: `requested`, or what the context leaves when None.
    Raises a 400 when the prompt alone fills the context or prompt + max_tokens exceeds it."""
    if prompt_len >= max_model_len:
        raise bad_request(f"the prompt has {prompt_len} tokens; this model's maximum context "
                          f"length is {max_model_len} tokens, and at least one must be left "
                          f"for the completion", "prompt")
    if requested is None:
        return max_model_len - prompt_len
    if requested > max_model_len:
        raise bad_request(f"{param} is {requested}; this model's maximum context length is "
                          f"{max_model_len} tokens", param)
    if prompt_len + requested > max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens, but "
                          f"{prompt_len + requested} were requested ({prompt_len} in the "
                          f"prompt, {requested} for the completion); lower {param}", param)
    return requested


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None,
                    choice: int, constraint: StructuredOutputs | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """Params of choice `choice` (0..n-1): a given seed becomes seed + choice, so the n
    choices differ yet the whole request is reproducible. `constraint`: the request's
    structured output (server.structured), already checked."""
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
            top_p=req.top_p, min_p=req.min_p,
            seed=None if req.seed is None else req.seed + choice,
            stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logprobs=logprobs,
            logit_bias=dict(req.logit_bias) if req.logit_bias else None,
            structured_outputs=constraint, prompt_logprobs=prompt_logprobs,
            num_speculative_tokens=req.num_speculative_tokens)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param) from None
