"""tessellm: a hardware-neutral LLM inference engine with device plugins."""
__version__ = "0.1.0"

from tessellm.llm import LLM, CompletionOutput, RequestOutput  # noqa: E402
from tessellm.constraints.structured_outputs import StructuredOutputs  # noqa: E402
from tessellm.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputs",
           "__version__"]
