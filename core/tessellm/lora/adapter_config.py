"""A PEFT adapter's directory and its adapter_config.json, read without torch (the server's
front end checks an adapter it is asked to load with these; tessellm.lora.adapter reads the
weights in the engine core).

`read_adapter_config` refuses, naming the adapter: a missing or unreadable file, a peft_type
other than LORA, `modules_to_save`, per-module rank or alpha patterns, DoRA, biases, and an
`r` or `lora_alpha` that is not a positive number.
"""
from __future__ import annotations

import json
from pathlib import Path

from tessellm.errors import TessellmError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRAError(TessellmError, ValueError):
    """An adapter cannot be used with this engine (the message names the adapter and why)."""


def adapter_directory(path: str) -> Path:
    """A local directory, or the snapshot of a hub repo id (downloaded unless offline)."""
    local = Path(path).expanduser()
    if local.exists():
        return local
    from tessellm.models.hub import hub_offline, looks_like_repo_id
    if not looks_like_repo_id(path):
        raise LoRAError(f"adapter path {path!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(path, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE],
                                      local_files_only=hub_offline(), library_name="tessellm"))
    except Exception as e:   # any hub failure is this adapter's load error
        raise LoRAError(f"adapter {path!r}: cannot get it from the Hugging Face Hub "
                        f"({type(e).__name__}: {e})") from None


def read_adapter_config(directory: Path, name: str) -> dict:
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRAError(f"adapter {name!r}: {directory / CONFIG_FILE} not found") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"adapter {name!r}: cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type {peft_type!r} is not LORA")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoRAError(f"adapter {name!r}: {key} is not supported")
    if config.get("use_dora"):
        raise LoRAError(f"adapter {name!r}: use_dora (DoRA) is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r}: bias={config['bias']!r} is not supported "
                        "(only 'none')")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} needs a positive {key!r}, "
                            f"got {value!r}")
    return config
