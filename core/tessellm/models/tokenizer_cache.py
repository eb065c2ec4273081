"""Tokenizers built once per file and kept as `tokenizer.json` (transformers' save_pretrained)
under the cache root: a GGUF file's tokenizer takes seconds to build from its metadata and a
small fraction of that to load from the saved copy.

Invariants: an entry is keyed by the source file's resolved path, size and modification time
and by the transformers and tessellm versions, so an edited file or an upgrade builds again;
an entry is written to a private directory and renamed into place whole, so a reader sees a
complete entry or none (two processes building at once both succeed, one entry survives); an
entry that cannot be read is rebuilt, and a cache that cannot be written costs only the
rebuild next time (a warning), never a failed load.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import tessellm

log = logging.getLogger(__name__)

COMPLETE_MARKER = "complete"


def cache_entry(source_file: Path, cache_dir: Path) -> Path:
    """The entry directory of `source_file` (which may not exist yet)."""
    from importlib.metadata import version   # not `import transformers`: slow to import
    st = source_file.stat()
    text = (f"{source_file.resolve()}|{st.st_size}|{st.st_mtime_ns}|"
            f"transformers={version('transformers')}|tessellm={tessellm.__version__}")
    return cache_dir / "tokenizers" / hashlib.sha256(text.encode()).hexdigest()[:24]


def is_complete(entry: Path) -> bool:
    return (entry / COMPLETE_MARKER).is_file()


def cached_tokenizer(source_file: Path, cache_dir: Path | None,
                     build: Callable[[], Any]) -> Any:
    """The tokenizer of `source_file`: loaded from its cache entry under `cache_dir`, else
    built by `build()` and saved there (no cache when cache_dir is None)."""
    if cache_dir is None:
        return build()
    from transformers import AutoTokenizer
    entry = cache_entry(source_file, cache_dir)
    if is_complete(entry):
        try:
            return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("cached tokenizer %s unreadable (%s: %s); building it again", entry,
                        type(exc).__name__, exc)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = build()
    _save(tokenizer, entry)
    return tokenizer


def _save(tokenizer: Any, entry: Path) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    except OSError as exc:
        log.warning("tokenizer cache %s not written: %s", entry.parent, exc)
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        (tmp / COMPLETE_MARKER).write_text("")
        os.rename(tmp, entry)   # fails if another process's entry is there already: keep it
    except OSError as exc:
        if not (entry / COMPLETE_MARKER).is_file():
            log.warning("tokenizer cache entry %s not written: %s", entry, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
