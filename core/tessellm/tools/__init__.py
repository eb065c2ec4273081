"""Tool calling: the model's output as OpenAI tool calls, and tool calls it must make.

- json_spans.py: where a JSON value in a growing text ends (or that it has not ended yet);
- call_format.py: CallFormat, how one model family writes tool calls (markers, a JSON object
  or array per call, the arguments' key), with the one incremental parser used for whole
  outputs and for streams (so a streamed call reassembles to the whole one by construction) and
  the Lark grammar that forces a valid call of listed tools (`tool_choice` required or named);
- formats.py: the built-in formats (hermes, llama3_json, mistral), the one a chat template
  implies, and third-party ones from the `tessellm_tool_call_formats` plugin hook;
- tool_prompt.py: tools and tool turns in the prompt: the model's own chat template when it
  renders tools, else a generic Hermes-style system prompt;
- tool_plan.py: what tools and tool_choice mean for one chat request (the history to render,
  the format to parse, the grammar of a forced call), shared by the server and LLM.chat.
"""
