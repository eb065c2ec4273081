"""The offline API, shaped as a vLLM user expects: `LLM(model=DIR, device=..., dtype=...,
**engine_options)`, then `.generate(prompts, params)` or `.chat(messages, params)`.

Outputs use the server's definitions: a sample's text is what it adds to its prompt (a
SentencePiece word start keeps its space), ends right before its first stop string, and a stop
string finishes the request in the engine as soon as it appears (finish_reason "stop").
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tessellm.config import EngineConfig
from tessellm.engine.builder import build_engine_parts
from tessellm.engine.chat_template import (chat_template_of, encode_chat, render_chat,
                                           template_messages)
from tessellm.engine.detokenizer import decode_continuation
from tessellm.engine.kernel_warmup import prepare_kernels
from tessellm.engine.startup_progress import StartupProgress
from tessellm.engine.llm_engine import LLMEngine
from tessellm.engine.delta_tracker import DeltaTracker
from tessellm.engine.output_processor import OutputProcessor
from tessellm.errors import InvalidRequestError
from tessellm.lora.request import LoRARequest
from tessellm.plugins import PluginManager
from tessellm.request import FinishReason, Request
from tessellm.sampling_params import SamplingParams
from tessellm.tools.tool_plan import ToolPlan, plan_tools, tool_setup

Messages = Sequence[Mapping[str, Any]]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a prompt (vLLM's CompletionOutput): `index` in 0..n-1; `text` ends
    before a stop string; `token_ids` are every token generated (the one that completed a stop
    string included)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    tool_calls: list[Any] | None = None   # LLM.chat with tools: the calls parsed from text


@dataclass(slots=True)
class RequestOutput:
    """One prompt's result. `outputs`: its n samples in index order (vLLM's shape). The flat
    fields token_ids / text / finish_reason are the first sample's; `samples` holds all n as
    RequestOutputs when n > 1 (empty when n == 1). `prompt`: the prompt text when it was given
    as text (for chat, the rendered template), else None."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    samples: list[RequestOutput] = field(default_factory=list)  # n > 1: all n, first one too
    prompt: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    prompt_logprobs: list[Any] | None = None


class _StopStringWatch:
    """The stop strings of one generate call, checked after every step through the server's
    OutputProcessor. A request whose text shows a stop string is finished in the engine at
    once (reason stop, blocks freed), so it does not run on to max_tokens. Only requests with
    stop strings are watched; the others are detokenized once, at the end."""

    def __init__(self, engine: LLMEngine, tokenizer: Any, requests: list[Request]) -> None:
        self._engine = engine
        self._outputs = OutputProcessor(tokenizer)
        self._new = DeltaTracker()   # tokens not yet fed, per watched request
        self._texts: dict[str, list[str]] = {}
        self._reasons: dict[str, str] = {}
        self._lengths: dict[str, int] = {}   # output tokens up to the one completing a stop
        for r in requests:
            if r.params.stop:
                self._outputs.track(r.request_id, r.prompt_token_ids, r.params.stop)
                self._new.track(r)
                self._texts[r.request_id] = []

    def update(self) -> None:
        """Feed every watched request's new tokens; finish those that hit a stop string."""
        stopped = []
        for raw in self._new.deltas():
            delta, stop_now = self._outputs.process(raw)
            if delta is not None:
                self._texts[raw.request_id].append(delta.text)
                if delta.finished:
                    self._reasons[raw.request_id] = (delta.finish_reason or raw.finish_reason
                                                     or "stop")
                    self._lengths[raw.request_id] = delta.num_output_tokens
            if stop_now:
                stopped.append(raw.request_id)
        if stopped:
            self._engine.finish_requests(stopped, FinishReason.STOP)

    def result(self, request_id: str) -> tuple[str, str, int] | None:
        """(text, finish_reason, output tokens kept) of a watched request once finished
        (a step that gave several tokens, speculation, may have run past the stop string's
        token: they are not kept); None if not watched."""
        if request_id not in self._reasons:
            return None
        return ("".join(self._texts[request_id]), self._reasons[request_id],
                self._lengths[request_id])


class LLM:
    def __init__(self, model: str | None = None, *, plugins: PluginManager | None = None,
                 **engine_options: Any) -> None:
        self.config = EngineConfig(model=model, **engine_options)
        self.engine = LLMEngine(build_engine_parts(self.config, plugins))
        self._plugins = plugins   # third-party tool-call formats come from them
        self.tokenizer = self.engine.parts.tokenizer
        if self.config.kernel_selection != "first":
            # every bucket chosen up front (cached on disk), as the server does: outputs do
            # not depend on which bucket came first, and weights convert to their kernels'
            # layout without a plain copy left beside them
            prepare_kernels(self.engine, StartupProgress() if self.config.load_progress else None)

    @property
    def is_demo(self) -> bool:
        return self.engine.parts.is_demo

    def close(self) -> None:
        """Release what outlives the object: a tensor-parallel engine's worker ranks (they
        also stop when this process exits)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def decode(self, token_ids: list[int], prompt_token_ids: list[int] | None = None) -> str:
        """Text of `token_ids`; after a prompt, the text they add to it (a SentencePiece word
        start keeps its space), exactly what the streaming server sends."""
        return decode_continuation(self.tokenizer, prompt_token_ids or [], token_ids, True)

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: int | Sequence[int] | None = None, n: int | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. Nothing is queued if
        any prompt, params or priority entry is invalid. `priority`: one for all prompts or
        one per prompt, 0 (most urgent, the default) .. priority_levels - 1.
        `n`: samples per prompt, else each params' own `n` (a params n other than 1 that
        differs from `n` is an error). Sample i is seeded with seed + i when params.seed is
        set; the samples share the prompt's KV blocks (copy-on-write). `params.stop`: see
        SamplingParams; the text is trimmed as the server trims it. `lora_request`: the LoRA
        adapter of every prompt, or one per prompt (None: the base model; needs
        enable_lora)."""
        if isinstance(prompts, str):
            raise InvalidRequestError("prompts must be a list of strings or of token-id lists")
        per_prompt, priorities, ns = self._per_prompt(len(prompts), params, priority, n)
        loras = _per_prompt_lora(len(prompts), lora_request)
        token_lists = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(token_lists, texts, per_prompt, priorities, ns, loras)

    def chat(self, messages: Messages | Sequence[Messages],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             priority: int | Sequence[int] | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None,
             parallel_tool_calls: bool = True, tool_call_parser: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of {"role", "content"}
        dicts) or to each of a list of them; one RequestOutput per conversation, whose
        `prompt` is the rendered template. The template is `chat_template` (a Jinja string),
        else the tokenizer's; with neither, InvalidRequestError. The rendered text is
        tokenized without special tokens: the template writes its own BOS.
        `tools` (OpenAI function tools), `tool_choice` ("none", "auto", "required" or
        {"type": "function", "function": {"name"}}), `parallel_tool_calls` and
        `tool_call_parser` as the server takes them (tessellm.tools.tool_plan): each output's
        `tool_calls` are the calls parsed from its text (finish_reason "tool_calls" when it
        ended with complete calls); a required or named call is forced by a grammar.
        `lora_request` as in `generate`."""
        conversations = _conversations(messages)
        per_prompt, priorities, ns = self._per_prompt(len(conversations), params, priority,
                                                      None)
        loras = _per_prompt_lora(len(conversations), lora_request)
        template = chat_template_of(self.tokenizer, chat_template)
        plans = [self._tool_plan(c, template, tools, tool_choice, parallel_tool_calls,
                                 tool_call_parser) for c in conversations]
        rendered = [encode_chat(self.tokenizer, p.messages, template, tools=p.template_tools,
                                add_generation_prompt=add_generation_prompt) for p in plans]
        per_prompt = [_with_forced(params, plan) for params, plan in zip(per_prompt, plans)]
        outputs = self._run([ids for _, ids in rendered], [text for text, _ in rendered],
                            per_prompt, priorities, ns, loras)
        for out, plan in zip(outputs, plans):
            if plan.format is not None:
                for sample in out.outputs:
                    _parse_tool_calls(sample, plan.format)
        return outputs

    def _tool_plan(self, conversation: Messages, template: str | None,
                   tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any,
                   parallel: bool, parser: str | None) -> ToolPlan:
        messages = template_messages(conversation)
        if not tools and tool_choice is None:
            return ToolPlan(None, messages, None, None)

        def render(msgs: list[dict[str, Any]], tool_defs: Any) -> str:
            return render_chat(self.tokenizer, msgs, template, tools=tool_defs)
        if self._plugins is None:
            self._plugins = PluginManager().load()
        renders, fmt = tool_setup(render, template, parser, self._plugins.tool_call_formats())
        return plan_tools(messages, tools, tool_choice, parallel, renders, fmt, self.tokenizer)

    @staticmethod
    def _per_prompt(count: int, params: SamplingParams | Sequence[SamplingParams] | None,
                    priority: int | Sequence[int] | None, n: int | None
                    ) -> tuple[list[SamplingParams], list[int], list[int]]:
        """Params, priority and number of samples of each of `count` prompts, validated."""
        params = params or SamplingParams()
        per_prompt = [params] * count if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != count:
            raise InvalidRequestError(f"{count} prompts but {len(per_prompt)} SamplingParams")
        if not all(isinstance(p, SamplingParams) for p in per_prompt):
            raise InvalidRequestError("params must be a SamplingParams or one per prompt")
        priority = 0 if priority is None else priority
        priorities = [priority] * count if isinstance(priority, int) else list(priority)
        if len(priorities) != count:
            raise InvalidRequestError(f"{count} prompts but {len(priorities)} priorities")
        if n is None:
            return per_prompt, priorities, [p.n for p in per_prompt]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {n!r}", "n")
        for p in per_prompt:
            if p.n != 1 and p.n != n:
                raise InvalidRequestError(
                    f"n={n} but SamplingParams.n={p.n}; give the number of samples once", "n")
        return per_prompt, priorities, [n] * count

    def _run(self, token_lists: list[list[int]], texts: list[str | None],
             per_prompt: list[SamplingParams], priorities: list[int], ns: list[int],
             loras: list[LoRARequest | None]) -> list[RequestOutput]:
        """Queue every group (or none), step until all finish, collect in prompt order."""
        groups: list[list[Request]] = []
        requests: list[Request] = []
        try:
            for ids, p, prio, n, lora in zip(token_lists, per_prompt, priorities, ns, loras):
                group = self.engine.add_request_group(ids, p, n, priority=prio,
                                                      lora_request=lora)
                groups.append(group)
                requests += group
        except Exception:
            for r in requests:
                self.engine.abort(r.request_id)
            raise
        stops = _StopStringWatch(self.engine, self.tokenizer, requests)
        try:
            while self.engine.has_unfinished():
                self.engine.step()
                stops.update()
        finally:  # on a failed step, the other requests of this call are aborted too
            for r in requests:
                if not r.is_finished:
                    self.engine.abort(r.request_id)
        return [self._output(group, text, stops) for group, text in zip(groups, texts)]

    def _output(self, group: list[Request], prompt: str | None,
                stops: _StopStringWatch) -> RequestOutput:
        samples = []
        for i, r in enumerate(group):
            watched = stops.result(r.request_id)
            text, reason, kept = watched if watched is not None else (
                self.decode(r.output_token_ids, r.prompt_token_ids), r.finish_reason.value,
                len(r.output_token_ids))
            out = CompletionOutput(i, text, r.output_token_ids[:kept], reason)
            samples.append(RequestOutput(r.request_id, r.prompt_token_ids, out.token_ids, text,
                                         reason, prompt=prompt, outputs=[out]))
        first = samples[0]
        head = group[0]
        prompt_lps = None if head.params.prompt_logprobs is None else \
            [None, *head.prompt_logprobs]
        return RequestOutput(first.request_id, first.prompt_token_ids, first.token_ids,
                             first.text, first.finish_reason,
                             samples if len(group) > 1 else [], prompt,
                             [s.outputs[0] for s in samples], prompt_lps)


def _per_prompt_lora(count: int, lora_request: Any) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: `lora_request` for all, or one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if isinstance(lora_request, (str, bytes)) or not isinstance(lora_request, Sequence):
        raise InvalidRequestError(f"lora_request must be a LoRARequest or one per prompt, got "
                                  f"{type(lora_request).__name__}", "lora_request")
    loras = list(lora_request)
    if len(loras) != count:
        raise InvalidRequestError(f"{count} prompts but {len(loras)} lora_request entries",
                                  "lora_request")
    for lora in loras:
        if lora is not None and not isinstance(lora, LoRARequest):
            raise InvalidRequestError(f"lora_request entries must be LoRARequest or None, got "
                                      f"{type(lora).__name__}", "lora_request")
    return loras


def _with_forced(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    if plan.forced is None:
        return params
    if params.structured_outputs is not None:
        raise InvalidRequestError("a forced tool call (tool_choice) and structured_outputs "
                                  "cannot both constrain one output", "tool_choice")
    return replace(params, structured_outputs=plan.forced)


def _parse_tool_calls(sample: CompletionOutput, fmt: Any) -> None:
    parsed = fmt.parse_calls(sample.text)
    if parsed.calls:
        sample.tool_calls = list(parsed.calls)
        if parsed.complete and sample.finish_reason == "stop":
            sample.finish_reason = "tool_calls"


def _conversations(messages: Messages | Sequence[Messages]) -> list[Messages]:
    """One conversation (its first item a message dict) or a list of conversations."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) \
            or not messages:
        raise InvalidRequestError("messages must be a conversation (a non-empty list of "
                                  "{'role', 'content'} dicts) or a list of conversations",
                                  "messages")
    if isinstance(messages[0], Mapping):
        return [messages]  # type: ignore[list-item]
    return list(messages)  # type: ignore[arg-type]
