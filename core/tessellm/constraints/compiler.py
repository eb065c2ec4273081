"""GrammarCompiler: a StructuredOutputs as a validated llguidance grammar, cached.

`compile(spec)` converts and validates (llguidance's own checks: the schema's keywords, the
regex, the grammar's rules; its message is the error's), and keeps the result in an LRU of
`capacity` entries keyed by the spec's canonical text, so a burst of requests with one schema
compiles it once; an invalid spec is cached too (its error is raised again). `matcher(spec)`
is a fresh LLMatcher for one request: a deep copy of a template matcher kept per grammar (a
copy costs about a microsecond; building one reads the grammar again).
The front end compiles without a tokenizer (validation needs none) to refuse a bad request
before admission; the engine core compiles with its tokenizer to build matchers. Counters
(`hits`, `misses`, `compile_seconds`) are for the benchmarks and the metrics.
Not thread-safe: one compiler per thread that uses it (`prefetch_tokenizer` builds the
tokenizer on a thread of its own; the first use waits for it).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tessellm.constraints.structured_outputs import StructuredOutputs
from tessellm.errors import InvalidRequestError

DEFAULT_CAPACITY = 512


class GrammarCompiler:
    def __init__(self, tokenizer: Callable[[], Any] | None = None,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        """`tokenizer`: returns the LLTokenizer (called once, when the first matcher is
        needed); None for a compiler that only validates."""
        self._tokenizer_source = tokenizer
        self._tokenizer: Any = None
        self._prefetch: threading.Thread | None = None
        self._prefetch_error: BaseException | None = None
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self.hits = self.misses = 0
        self.compile_seconds = 0.0

    def prefetch_tokenizer(self) -> None:
        """Start building the tokenizer on a daemon thread (it releases the interpreter lock
        for nearly all of it), so the first constrained request does not wait for it."""
        if self._tokenizer_source is None or self._tokenizer is not None or self._prefetch:
            return

        def build() -> None:
            try:
                self._tokenizer = self._tokenizer_source()   # type: ignore[misc]
            except BaseException as e:   # raised again where the tokenizer is needed
                self._prefetch_error = e

        self._prefetch = threading.Thread(target=build, daemon=True,
                                          name="tessellm-guidance-tokenizer")
        self._prefetch.start()

    @property
    def tokenizer(self) -> Any:
        if self._prefetch is not None:
            self._prefetch.join()
            self._prefetch = None
            if self._prefetch_error is not None:
                error, self._prefetch_error = self._prefetch_error, None
                raise error
        if self._tokenizer is None:
            if self._tokenizer_source is None:
                raise RuntimeError("this GrammarCompiler validates only: it has no tokenizer")
            self._tokenizer = self._tokenizer_source()
        return self._tokenizer

    def compile(self, spec: StructuredOutputs) -> str:
        """The validated llguidance grammar of `spec`; InvalidRequestError naming the problem."""
        key = spec.key()
        entry = self._entries.get(key)
        if entry is not None:
            self.hits += 1
            self._entries.move_to_end(key)
        else:
            self.misses += 1
            t0 = time.perf_counter()
            entry = self._build(spec)
            self.compile_seconds += time.perf_counter() - t0
            self._entries[key] = entry
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        grammar, error = entry
        if error is not None:
            raise InvalidRequestError(error, f"structured_outputs.{spec.kind}")
        return grammar  # type: ignore[return-value]

    def _build(self, spec: StructuredOutputs) -> tuple[str | None, str | None]:
        from llguidance import LLMatcher
        try:
            grammar = spec.to_grammar()
        except InvalidRequestError as e:
            return None, str(e)
        except ValueError as e:   # llguidance: not a JSON object, etc.
            return None, f"invalid {spec.kind} constraint: {e}"
        message = LLMatcher.validate_grammar(grammar, self._tokenizer)
        if message and not message.startswith("WARNING"):
            return None, f"invalid {spec.kind} constraint: {message.strip()}"
        return grammar, None

    def matcher(self, spec: StructuredOutputs) -> Any:
        """A fresh LLMatcher for one request (InvalidRequestError if the spec is invalid)."""
        from llguidance import LLMatcher
        grammar = self.compile(spec)
        key = spec.key()
        template = self._templates.get(key)
        if template is None:
            template = LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise InvalidRequestError(
                    f"invalid {spec.kind} constraint: {template.get_error().strip()}",
                    f"structured_outputs.{spec.kind}")
            self._templates[key] = template
            if len(self._templates) > self.capacity:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
        return template.deep_copy()
