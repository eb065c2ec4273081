"""ServerState: what every handler of one app shares (engine, tokenizer, limits, metrics).

Tokenization and chat-template rendering run on one dedicated worker thread, never on the
event loop (one thread: a Hugging Face fast tokenizer must not be mutated concurrently, and
one worker keeps a burst of long prompts from taking every core from the engine). So do the
checks of structured-output constraints (the validate-only GrammarCompiler: an LRU, so one
schema is compiled once however many requests carry it) and, once, the tool setup: whether
the chat template renders tools, and the tool-call format to parse (tools.formats).
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from tessellm.constraints.compiler import GrammarCompiler
from tessellm.constraints.structured_outputs import StructuredOutputs
from tessellm.engine.async_engine import AsyncEngine, RequestStream
from tessellm.engine.chat_template import encode_chat, render_chat
from tessellm.errors import ConfigError, InvalidRequestError
from tessellm.models.source import ModelSource
from tessellm.sampling_params import SamplingParams
from tessellm.server.engine_history import EngineHistory
from tessellm.server.errors import APIError
from tessellm.server.logprobs import TokenTexts
from tessellm.server.lora_adapters import ServedAdapter, ServedAdapters, parse_lora_module
from tessellm.server.metrics import ServerMetrics
from tessellm.server.server_config import ServerConfig
from tessellm.tools.tool_plan import tool_setup

if TYPE_CHECKING:
    from tessellm.server.tracing.request_span import RequestTracer

NO_CHAT_TEMPLATE_HINT = ("start the server with --chat-template FILE (a Jinja template) or "
                         "use /v1/completions")


def model_aliases(model_option: str | None, source: ModelSource) -> frozenset[str]:
    """The names a client may pass as `model`: the source's name (a directory's basename, a
    GGUF file's stem, a repo id, "demo"), the --model text as given, and its paths."""
    names = {source.name, str(source.path), os.path.abspath(source.path)}
    if model_option is not None:
        names |= {model_option, os.path.normpath(model_option), os.path.abspath(model_option)}
    return frozenset(names)


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    config: ServerConfig
    model_name: str
    model_aliases: frozenset[str]
    max_model_len: int
    chat_template: str | None
    metrics: ServerMetrics
    texts: TokenTexts
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="tessellm-tokenize"))
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    grammars: GrammarCompiler = field(default_factory=GrammarCompiler)  # tokenizer thread only
    _tool_setup: tuple[bool, Any] | None = None
    history: EngineHistory = field(init=False)  # the dashboard's per-second samples
    tracer: RequestTracer | None = None   # --otlp-traces-endpoint: one span per request
    # LoRA adapters served by name (build() registers --lora-modules)
    adapters: ServedAdapters = field(default_factory=lambda: ServedAdapters(frozenset(), 0, 0))

    def __post_init__(self) -> None:
        self.history = EngineHistory(self.engine)

    @classmethod
    def build(cls, engine: AsyncEngine, tokenizer: Any, config: ServerConfig,
              source: ModelSource, model_option: str | None,
              chat_template: str | None = None) -> ServerState:
        """ConfigError when an adapter of --lora-modules cannot be served."""
        template = chat_template or getattr(tokenizer, "chat_template", None) or None
        aliases = model_aliases(model_option, source)
        state = cls(engine, tokenizer, config, source.name, aliases,
                    engine.info.max_model_len, template, ServerMetrics(engine),
                    TokenTexts(tokenizer))
        info = engine.info
        state.adapters = ServedAdapters(aliases | {source.name}, info.max_loras,
                                        info.max_lora_rank)
        for spec in config.lora_modules:
            name, path = parse_lora_module(spec)
            try:
                state.adapters.add(name, path)
            except APIError as e:
                raise ConfigError(f"--lora-modules {spec}: {e.message}") from None
        return state

    def check_model(self, model: str | None) -> ServedAdapter | None:
        """The LoRA adapter `model` names (None: the base model); a 404 for any other name."""
        if model is None or model in self.model_aliases:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            served = ", ".join(repr(n) for n in [self.model_name] +
                               [a.name for a in self.adapters.all])
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{served}", param="model", code="model_not_found")
        return adapter

    def response_model(self, model: str | None) -> str:
        """The `model` a response names: the adapter's name, else the base model's."""
        return model if model is not None and self.adapters.get(model) is not None \
            else self.model_name

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def encode(self, text: str) -> list[int]:
        """Prompt text -> token ids, exactly as the offline LLM.encode does."""
        return list(await self._off_loop(self.tokenizer.encode, text))

    async def decode(self, token_ids: list[int]) -> str:
        """Token ids -> text, as the prompt reads (special tokens kept)."""
        return await self._off_loop(self.tokenizer.decode, token_ids)

    async def encode_chat(self, messages: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Messages -> the chat template's text (with the generation prompt) -> token ids,
        exactly as the offline LLM.chat does (no special tokens added on top)."""
        render = partial(encode_chat, self.tokenizer, messages, self.chat_template,
                         hint=NO_CHAT_TEMPLATE_HINT, tools=tools)
        return (await self._off_loop(render))[1]

    async def check_constraint(self, spec: StructuredOutputs, param: str) -> None:
        """A 400 naming `param` if the constraint does not compile (cached per spec)."""
        try:
            await self._off_loop(self.grammars.compile, spec)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=param) from None

    def _setup_tools(self) -> tuple[bool, Any]:
        from tessellm.plugins import PluginManager

        def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
            return render_chat(self.tokenizer, messages, self.chat_template, tools=tools)
        return tool_setup(render, self.chat_template, self.config.tool_call_parser,
                          PluginManager().load().tool_call_formats())

    async def tool_setup(self) -> tuple[bool, Any]:
        """(whether the chat template renders tools, the tool-call format), found once."""
        if self._tool_setup is None:
            self._tool_setup = await self._off_loop(self._setup_tools)
        return self._tool_setup

    def submit(self, request_id: str, groups: Sequence[tuple[list[int], SamplingParams, int]],
               stop: list[str], priority: int = 0, model: str | None = None
               ) -> list[RequestStream]:
        """Add every (prompt, params of choice 0, n) group to the engine — n > 1 as
        copy-on-write siblings that compute the prompt once, choice i with seed + i — or
        none: on an error the ones already added are aborted and the error propagates.
        Streams come back prompt by prompt, choice by choice. `model`: the request's, which
        may name a LoRA adapter (check_model: a 404 for an unknown name)."""
        adapter = self.check_model(model)
        streams: list[RequestStream] = []
        try:
            for k, (ids, params, n) in enumerate(groups):
                rid = request_id if len(groups) == 1 else f"{request_id}-{k}"
                streams += self.engine.add_request_group(ids, params, n, rid, stop=stop or None,
                                                         priority=priority,
                                                         lora=None if adapter is None
                                                         else adapter.wire)
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams
