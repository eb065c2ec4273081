"""tessellm: a hardware-neutral LLM inference engine with device plugins.

The public names are imported on first use (PEP 562), so `import tessellm` (and the server's
front end, which never runs a model) does not pay for torch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # for type checkers and the API docs (mkdocstrings reads these statically)
    from tessellm.constraints.structured_outputs import StructuredOutputs
    from tessellm.llm import LLM, CompletionOutput, RequestOutput
    from tessellm.lora.request import LoRARequest
    from tessellm.sampling_params import SamplingParams

__version__ = "0.1.0"

_PUBLIC = {"LLM": "tessellm.llm", "CompletionOutput": "tessellm.llm",
           "RequestOutput": "tessellm.llm", "SamplingParams": "tessellm.sampling_params",
           "StructuredOutputs": "tessellm.constraints.structured_outputs",
           "LoRARequest": "tessellm.lora.request"}

__all__ = ["LLM", "CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams",
           "StructuredOutputs", "__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'tessellm' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
