"""Hugging Face Hub repo ids ("org/name") -> a local model directory or .gguf file.

Invariants:
- Only what tessellm loads is fetched: the config files, the tokenizer files and the
  safetensors shards the loader would open (the index's shards, else model.safetensors, else
  every top-level *.safetensors) — never pickles, READMEs or a second copy of the weights
  (e.g. a repo's `consolidated.safetensors` next to its sharded files).
- Where files live and whether the network may be used is huggingface_hub's own setting
  (HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE, read into `huggingface_hub.constants`): nothing
  here passes a cache_dir, endpoint or token. HF_HUB_OFFLINE set in the environment after
  huggingface_hub was imported still keeps this module offline (it only ever restricts).
- Offline, or when the Hub cannot be reached, the cached snapshot of the revision is used
  (refs/<revision> -> snapshots/<commit>); a commit hash is looked up in snapshots/ directly.
- Every failure is a ModelLoadError naming the repo, the revision and the file when one is to
  blame; no huggingface_hub or HTTP exception escapes.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tessellm.errors import ModelLoadError
from tessellm.models.hf_files import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    SINGLE_WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja",
                   "added_tokens.json")
META_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE, WEIGHTS_INDEX_FILE, *TOKENIZER_FILES)

_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"  # the Hub's rule for one name
_REPO_ID = re.compile(rf"{_PART}/{_PART}")
_MAX_REPO_ID_LEN = 96
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin", ".pt", ".pth")
_TRUE = {"1", "on", "yes", "true"}


def looks_like_repo_id(model: str) -> bool:
    """True for "org/name" (one slash, Hub characters, no "--" or "..", at most 96 chars)
    that is not an existing local path and does not end like a file name (".gguf", ...)."""
    if not isinstance(model, str) or len(model) > _MAX_REPO_ID_LEN:
        return False
    if not _REPO_ID.fullmatch(model) or "--" in model or ".." in model:
        return False
    if model.lower().endswith(_FILE_SUFFIXES):
        return False
    return not Path(model).expanduser().exists()


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE is set (huggingface_hub's constant or the environment now)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or env.strip().lower() in _TRUE


def hub_cache_dir() -> str:
    """The cache huggingface_hub uses (HF_HUB_CACHE, else HF_HOME/hub); for messages."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_hub_model(repo_id: str, *, revision: str | None = None,
                      gguf_file: str | None = None) -> Path:
    """The local path of a Hub model: the snapshot directory of a safetensors repo, or with
    `gguf_file` that one file of the repo. Downloads what is missing unless offline.

    `revision`: a branch, tag or commit (None: the default branch). A repo with .gguf files
    but no safetensors needs `gguf_file`; the error lists the repo's .gguf files."""
    if not isinstance(repo_id, str) or not _REPO_ID.fullmatch(repo_id) \
            or "--" in repo_id or ".." in repo_id or len(repo_id) > _MAX_REPO_ID_LEN:
        raise ModelLoadError(f"{repo_id!r} is not a Hugging Face repo id (expected 'org/name')")
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise ModelLoadError(f"revision must be a non-empty string, got {revision!r}")
    if gguf_file is not None and (not isinstance(gguf_file, str)
                                  or not gguf_file.lower().endswith(".gguf")):
        raise ModelLoadError(f"gguf_file must name a .gguf file of the repo, got {gguf_file!r}")
    offline = hub_offline()
    with _hub_errors(repo_id, revision, gguf_file, offline):
        if gguf_file is not None:
            return _gguf_file(repo_id, revision, gguf_file, offline)
        return _safetensors_snapshot(repo_id, revision, offline)


def _where(repo_id: str, revision: str | None) -> str:
    return f"{repo_id!r} (revision {revision or 'main'!r})"


def _safetensors_snapshot(repo_id: str, revision: str | None, offline: bool) -> Path:
    from huggingface_hub import snapshot_download

    listing = None if offline else _list_files(repo_id, revision)
    local = listing is None  # offline, or the Hub is unreachable: the cache alone
    if listing is not None and not any(_is_top_level_safetensors(f) for f in listing):
        raise _no_safetensors(repo_id, revision, [f for f in listing if f.endswith(".gguf")],
                              "the repo")
    # Locally, ask only for config.json: huggingface_hub checks the patterns against its
    # cached tree listing, and a tokenizer file never fetched must not make it refuse.
    snapshot = Path(snapshot_download(
        repo_id, revision=revision, allow_patterns=[CONFIG_FILE] if local else list(META_FILES),
        local_files_only=local, library_name="tessellm"))
    shards = _shards(snapshot, listing)
    if not shards:
        ggufs = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf"))
        raise _no_safetensors(repo_id, revision, ggufs, "the cached snapshot")
    if not local:
        snapshot = Path(snapshot_download(
            repo_id, revision=revision, allow_patterns=[*META_FILES, *shards],
            library_name="tessellm"))
    missing = [f for f in (CONFIG_FILE, *shards) if not (snapshot / f).is_file()]
    if missing:
        raise ModelLoadError(
            f"the cached snapshot of {_where(repo_id, revision)} in {hub_cache_dir()} is "
            f"incomplete (missing: {', '.join(missing)})"
            + ("; run once without HF_HUB_OFFLINE to complete it" if offline else ""))
    return snapshot


def _is_top_level_safetensors(name: str) -> bool:
    return "/" not in name and name.endswith(".safetensors")


def _shards(snapshot: Path, listing: list[str] | None) -> list[str]:
    """The shard files the loader opens, in its order of preference: the index's shards,
    model.safetensors, else every top-level *.safetensors (of the listing, or on disk)."""
    index = snapshot / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelLoadError(f"cannot read {index}: {exc}") from exc
        if not isinstance(weight_map, dict) or not weight_map \
                or not all(isinstance(s, str) for s in weight_map.values()):
            raise ModelLoadError(f"{index} has no valid 'weight_map' object")
        return sorted(set(weight_map.values()))
    names = ([f for f in listing if _is_top_level_safetensors(f)] if listing is not None
             else [p.name for p in snapshot.glob("*.safetensors")])
    return [SINGLE_WEIGHTS_FILE] if SINGLE_WEIGHTS_FILE in names else sorted(names)


def _no_safetensors(repo_id: str, revision: str | None, ggufs: list[str],
                    where: str) -> ModelLoadError:
    if ggufs:
        return ModelLoadError(
            f"{_where(repo_id, revision)} has no safetensors weights but GGUF files; pass "
            f"gguf_file= one of: {', '.join(sorted(ggufs))}")
    return ModelLoadError(f"{_where(repo_id, revision)} has no safetensors or .gguf weights "
                          f"in {where}")


def _gguf_file(repo_id: str, revision: str | None, gguf_file: str, offline: bool) -> Path:
    """The local path of `gguf_file`; for a part of a split file (`-0000i-of-0000N.gguf`)
    every part is fetched and the first one's path returned."""
    from tessellm.models.gguf_split import split_parts

    parts = split_parts(Path(gguf_file))
    if parts is None:
        return _repo_file(repo_id, revision, gguf_file, offline)
    return [_repo_file(repo_id, revision, str(part), offline) for part in parts][0]


def _repo_file(repo_id: str, revision: str | None, name: str, offline: bool) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, name, revision=revision,
                                    local_files_only=offline, library_name="tessellm"))
    except RemoteEntryNotFoundError:
        listing = _list_files(repo_id, revision) or []
        ggufs = sorted(f for f in listing if f.endswith(".gguf"))
        raise ModelLoadError(
            f"{_where(repo_id, revision)} has no file {name!r}; its .gguf files: "
            f"{', '.join(ggufs) or 'none'}") from None
    except LocalEntryNotFoundError:
        snapshot = _cached_snapshot(repo_id, revision)
        if snapshot is None:
            raise
        ggufs = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf"))
        raise ModelLoadError(
            f"{name!r} is not in the cached snapshot of {_where(repo_id, revision)} in "
            f"{hub_cache_dir()}" + (" and HF_HUB_OFFLINE is set" if offline else "")
            + f"; cached .gguf files: {', '.join(ggufs) or 'none'}") from None


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot directory of the revision, complete or not; None if there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=[],
                                      local_files_only=True, library_name="tessellm"))
    except IncompleteSnapshotError as exc:
        return Path(exc.snapshot_path) if getattr(exc, "snapshot_path", None) else None
    except LocalEntryNotFoundError:
        return None


def _list_files(repo_id: str, revision: str | None) -> list[str] | None:
    """The repo's files at `revision`; None when the Hub cannot be reached (use the cache)."""
    import httpx2
    from huggingface_hub import list_repo_files
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        return list_repo_files(repo_id, revision=revision)
    except (OfflineModeIsEnabled, httpx2.ConnectError, httpx2.TimeoutException):
        return None


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, filename: str | None,
                offline: bool) -> Iterator[None]:
    """Turn every huggingface_hub / HTTP failure inside into a ModelLoadError."""
    import httpx2
    from huggingface_hub import errors as hf

    where = _where(repo_id, revision)
    try:
        yield
    except ModelLoadError:
        raise
    except hf.IncompleteSnapshotError as exc:  # before LocalEntryNotFoundError: it is one
        raise ModelLoadError(f"the cached snapshot of {where} in {hub_cache_dir()} is "
                             f"incomplete: {exc}") from exc
    except hf.LocalEntryNotFoundError as exc:  # before EntryNotFoundError: it is one
        if offline:
            msg = (f"{where} is not in the local Hugging Face cache ({hub_cache_dir()}) and "
                   f"HF_HUB_OFFLINE is set; unset it to download the model")
        else:
            msg = (f"cannot reach the Hugging Face Hub for {where} and it is not in the local "
                   f"cache ({hub_cache_dir()}): {exc}")
        raise ModelLoadError(msg) from exc
    except hf.GatedRepoError as exc:  # before RepositoryNotFoundError: it is one
        raise ModelLoadError(
            f"{where} is gated: accept its terms on huggingface.co and log in "
            f"(`hf auth login` or HF_TOKEN)") from exc
    except hf.RepositoryNotFoundError as exc:
        raise ModelLoadError(
            f"no model repository {repo_id!r} on the Hugging Face Hub (if it is private, log "
            f"in with `hf auth login` or set HF_TOKEN)") from exc
    except hf.RevisionNotFoundError as exc:
        raise ModelLoadError(
            f"revision {revision!r} of {repo_id!r} does not exist (no such branch, tag or "
            f"commit)") from exc
    except hf.EntryNotFoundError as exc:
        raise ModelLoadError(f"{where} has no file {filename or ''!r}: {exc}") from exc
    except hf.HFValidationError as exc:
        raise ModelLoadError(f"invalid repo id or revision for {where}: {exc}") from exc
    except (hf.HfHubHTTPError, hf.OfflineModeIsEnabled, httpx2.HTTPError, OSError) as exc:
        raise ModelLoadError(
            f"fetching {where} from the Hugging Face Hub failed: {type(exc).__name__}: "
            f"{exc}") from exc
