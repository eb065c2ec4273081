"""The tokenizer of a model source, without torch (the server's front end loads it too):
a GGUF file's own, built from its metadata once and then read from the tokenizer cache
(tessellm.models.gguf_tokenizer), or an HF directory's, read by transformers.AutoTokenizer.
Offline only."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tessellm.errors import ModelLoadError
from tessellm.models.source import ModelSource

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_source_tokenizer(source: ModelSource, opened: Any = None,
                          cache_dir: Path | None = None, core_only: bool = False) -> Any:
    """`opened`: the source's open_source() result, if the caller has it; `cache_dir`: where
    a GGUF file's built tokenizer is kept (None: built every time); `core_only`: what an
    engine core reads of a tokenizer is enough (a CoreTokenizer, where a cache entry has
    one: tessellm.models.core_tokenizer)."""
    if core_only and source.kind == "gguf" and cache_dir is not None:
        from tessellm.models.core_tokenizer import load_core_tokenizer
        from tessellm.models.tokenizer_cache import cache_entry, is_complete
        entry = cache_entry(source.path, cache_dir)
        light = load_core_tokenizer(entry) if is_complete(entry) else None
        if light is not None:
            return light
    if source.kind == "gguf":
        from tessellm.models.gguf_tokenizer import load_gguf_tokenizer
        return load_gguf_tokenizer(source.path, opened, cache_dir)
    return load_tokenizer(source.path)


def load_tokenizer(model_dir: str | Path) -> Any:
    """The directory's tokenizer (transformers.AutoTokenizer, offline only)."""
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist or is not a "
                             "directory")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"no tokenizer in {str(path)!r}: expected one of {', '.join(TOKENIZER_FILES)}")
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is needed
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {str(path)!r}: {exc}") from exc
