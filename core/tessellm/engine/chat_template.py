"""Chat messages -> the prompt a chat model expects, through its Jinja chat template.

Invariants:
- The template writes the special tokens of the conversation itself (BOS included), so the
  rendered text is encoded with `add_special_tokens=False`: never a second BOS.
- The template is the caller's override, else the tokenizer's own; with neither, an
  InvalidRequestError says so (with the caller's hint on how to give one), never a silent
  plain-text fallback.
- A template that raises on the messages is the caller's to fix: InvalidRequestError naming
  the exception, param "messages".
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tessellm.errors import InvalidRequestError

OFFLINE_HINT = "pass chat_template= (a Jinja template string) to LLM.chat"


def chat_template_of(tokenizer: Any, override: str | None = None) -> str | None:
    """The template to render with: `override`, else the tokenizer's; None when neither."""
    if override is not None:
        if not isinstance(override, str) or not override.strip():
            raise InvalidRequestError("chat_template must be a non-empty Jinja template string",
                                      "chat_template")
        return override
    return getattr(tokenizer, "chat_template", None) or None


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template reads them: every message a mapping with a string "role";
    "content" a string, None (""), or a list of {"type": "text", "text": ...} parts joined
    with newlines (as the server does). Other keys (name, ...) pass through."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} "
                                  "dicts", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"message {i} must be a dict with a string 'role', got "
                                      f"{m!r}", "messages")
        d = dict(m)
        d["content"] = _text(m.get("content"), i)
        out.append(d)
    return out


def _text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
            isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "\n".join(p["text"] for p in content)
    raise InvalidRequestError(f"message {i}: content must be a string or a list of text parts, "
                              f"got {content!r}", "messages")


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], template: str | None,
                *, add_generation_prompt: bool = True, hint: str = OFFLINE_HINT,
                tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The template's text for `messages` (validated by template_messages), ending with the
    assistant's generation prompt when `add_generation_prompt`. `hint`: how the caller's user
    gives a template, for the error when there is none. `tools`: OpenAI tool definitions for
    a template that renders them (tessellm.tools.tool_prompt decides)."""
    if template is None:
        raise InvalidRequestError(f"this model has no chat template; {hint}", "messages")
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise InvalidRequestError(
            f"this model's tokenizer ({type(tokenizer).__name__}) cannot render chat templates",
            "messages")
    msgs = template_messages(messages)
    try:
        text = tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             tools=list(tools) if tools else None)
    except Exception as e:  # a template raising on these messages: the caller's to fix
        raise InvalidRequestError(f"the chat template failed on these messages: "
                                  f"{type(e).__name__}: {e}", "messages") from None
    if not isinstance(text, str):
        raise InvalidRequestError(f"the chat template rendered {type(text).__name__}, not text",
                                  "messages")
    return text


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], template: str | None,
                *, add_generation_prompt: bool = True, hint: str = OFFLINE_HINT,
                tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, list[int]]:
    """The rendered prompt and its token ids, with no special tokens added on top."""
    text = render_chat(tokenizer, messages, template,
                       add_generation_prompt=add_generation_prompt, hint=hint, tools=tools)
    return text, list(tokenizer.encode(text, add_special_tokens=False))
