"""The tokenizer of a GGUF file, built by transformers from the file's metadata (offline) once,
then loaded from its saved copy (tessellm.models.tokenizer_cache).

llama.cpp writes 2**32 - 1 for a special token that does not exist ("none"); transformers'
GGUF reader indexes the vocabulary with such an id and fails, so a file that has one is read
through a vocab-only copy without those fields (in a temporary directory).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tessellm.errors import ModelLoadError
from tessellm.models.gguf_reader import metadata_field
from tessellm.models.tokenizer_cache import cached_tokenizer

log = logging.getLogger(__name__)


_SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
                    "seperator_token_id")


def _invalid_special_ids(reader: Any) -> list[str]:
    """Special-token fields whose id is outside the vocabulary (llama.cpp writes 2**32 - 1
    for "none"; transformers' GGUF tokenizer reader indexes the vocabulary with it)."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    size = len(tokens.data) if tokens is not None else 0
    return [f"tokenizer.ggml.{k}" for k in _SPECIAL_ID_KEYS
            if (v := metadata_field(reader, f"tokenizer.ggml.{k}")) is not None and not 0 <= v < size]


def _write_vocab_only(reader: Any, skip: list[str], out: Path) -> None:
    """A tensor-less GGUF holding the file's tokenizer metadata minus the `skip` fields."""
    import gguf
    writer = gguf.GGUFWriter(out, metadata_field(reader, "general.architecture"))
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.") and key not in skip:
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, f.contents(), f.types[0], sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def load_gguf_tokenizer(path: str | Path, reader: Any = None,
                        cache_dir: Path | None = None) -> Any:
    """The file's tokenizer: from its cache entry under `cache_dir` when there is one, else
    built by transformers from the GGUF metadata (offline) and saved there. `reader`: the
    file's open_gguf result when the caller has one."""
    p = Path(path)
    return cached_tokenizer(p, cache_dir, lambda: _build(p, reader))


def _build(p: Path, reader: Any) -> Any:
    """A special-token id outside the vocabulary means "none": transformers cannot read such a
    file, so it reads a vocab-only copy without those fields (in a temporary directory)."""
    import tempfile

    from transformers import AutoTokenizer

    from tessellm.models.gguf_config import GGUF_ARCHITECTURES
    from tessellm.models.gguf_file import open_gguf
    reader = reader if reader is not None else open_gguf(p)
    skip = _invalid_special_ids(reader)
    arch = metadata_field(reader, "general.architecture")
    # AutoTokenizer parses the whole header for a config only to pick the tokenizer class by
    # model type (seconds for a large vocabulary with the `gguf` package); the class it would pick
    # is called directly for the architectures tessellm runs
    loader = AutoTokenizer
    if arch in GGUF_ARCHITECTURES:
        from transformers.models.auto.tokenization_auto import (TOKENIZER_MAPPING_NAMES,
                                                                tokenizer_class_from_name)
        loader = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(arch)
                                           or "TokenizersBackend")
    try:
        if not skip:
            return loader.from_pretrained(str(p.parent), gguf_file=p.name,
                                          local_files_only=True)
        log.info("GGUF %s: ignoring special-token ids outside the vocabulary: %s", p.name,
                 ", ".join(skip))
        with tempfile.TemporaryDirectory(prefix="tessellm-vocab-") as tmp:
            _write_vocab_only(reader, skip, Path(tmp) / "vocab.gguf")
            return loader.from_pretrained(tmp, gguf_file="vocab.gguf",
                                          local_files_only=True)
    except (OSError, ValueError, KeyError, IndexError, ImportError, TypeError) as exc:
        raise ModelLoadError(f"cannot build the tokenizer of GGUF file {p}: "
                             f"{type(exc).__name__}: {exc}") from exc
