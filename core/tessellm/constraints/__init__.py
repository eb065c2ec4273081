"""Constrained decoding: a request may carry a constraint on its output (a JSON schema, any JSON
object, a regex, a choice among strings, a Lark or GBNF grammar), kept as per-request state in
the engine core and applied on the device as an ordinary op.

- structured_outputs.py: StructuredOutputs, what a request asks for (in its SamplingParams);
- compiler.py: GrammarCompiler, the constraint as a validated llguidance grammar (an LRU per
  canonical text: a burst of requests with one schema compiles once);
- guidance_tokenizer.py: the model's tokenizer as llguidance sees it (the logits' width);
- request_constraint.py: RequestConstraint, one request's matcher (it follows preemption, forks
  and aborts because it lives on the Request);
- step_masks.py: StepMasks, the token bitmask of a step's constrained rows, computed on a worker
  thread while the forward pass runs; the sampler applies it with the `apply_token_bitmask` op.
"""
