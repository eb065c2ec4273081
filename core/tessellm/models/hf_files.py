"""Reading a Hugging Face model directory: config, safetensors weights, tokenizer, EOS ids.

Invariants:
- Only safetensors weights are ever loaded. Pickle checkpoints (`*.bin`, `*.pt`, `*.pth`,
  `*.ckpt`) can run arbitrary code when unpickled, so they are refused with a ModelLoadError,
  never opened.
- Shards are memory-mapped (`safe_open(..., framework="pt")`); a tensor whose dtype already
  matches the requested one is returned as the mapped view, without a copy.
- Every tensor name appears in exactly one shard; a name found twice is an error, never a
  silent "last one wins".
- Nothing here reaches the network: the tokenizer is loaded with `local_files_only=True`.
"""
from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from tessellm.errors import ModelLoadError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_KEY = "_generation_config"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    return path


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a key listed twice is an error (json.load would keep the last one)."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ModelLoadError(f"key {key!r} is listed twice")
        result[key] = value
    return result


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        with path.open(encoding="utf-8") as fh:
            data = json.load(fh, object_pairs_hook=_no_duplicate_keys)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """Return config.json as a dict; generation_config.json, when present, sits under
    the key "_generation_config" (its eos_token_id may be an int or a list of ints)."""
    path = _model_dir(model_dir)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ModelLoadError(
            f"{CONFIG_FILE} not found in model directory {str(path)!r}; "
            "is this a Hugging Face model directory?"
        )
    config = _read_json_object(config_path)
    generation_path = path / GENERATION_CONFIG_FILE
    if generation_path.is_file():
        config[GENERATION_CONFIG_KEY] = _read_json_object(generation_path)
    return config


def _shard_plan(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files to open, in a fixed order, and the index's weight_map (None when the
    directory has no index)."""
    index_path = path / WEIGHTS_INDEX_FILE
    if index_path.is_file():
        index = _read_json_object(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path} has no non-empty 'weight_map' object")
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise ModelLoadError(
                    f"{index_path}: tensor {name!r} maps to {shard!r}, not a file name"
                )
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(
                f"{index_path} names shard(s) missing from {str(path)!r}: {', '.join(missing)}"
            )
        return [path / s for s in shards], weight_map
    if (path / SINGLE_WEIGHTS_FILE).is_file():
        return [path / SINGLE_WEIGHTS_FILE], None
    # No index and no model.safetensors: any *.safetensors files there (duplicates are caught).
    found = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if found:
        return found, None
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"no safetensors weights in {str(path)!r}; found only pickle checkpoint(s) "
            f"({', '.join(pickles)}), which tessellm refuses to load for security "
            "(unpickling can run arbitrary code). Convert them to safetensors first."
        )
    raise ModelLoadError(
        f"no weights in {str(path)!r}: expected {SINGLE_WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}"
    )


def _shard_keys(shard: Path) -> list[str]:
    try:
        with safe_open(str(shard), framework="pt") as fh:
            return list(fh.keys())
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"cannot open safetensors file {shard}: {exc}") from exc


def _convert(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating tensors go to `dtype`; integer/bool tensors and matching dtypes stay as they are
    (the latter keeps the memory-mapped view)."""
    if tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor


def load_safetensors(
    model_dir: str | Path,
    dtype: torch.dtype,
    *,
    progress: bool = True,
    max_workers: int | None = None,
) -> dict[str, torch.Tensor]:
    """Load every tensor of the model directory, floating ones converted to `dtype`.

    Reads `model.safetensors.index.json` (sharded) or `model.safetensors` (single file).
    Shards load in parallel, one thread task per shard. The returned dict is ordered by shard
    file name, then by tensor name within a shard.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelLoadError(f"load dtype must be a floating torch.dtype, got {dtype!r}")
    if max_workers is not None and max_workers < 1:
        raise ModelLoadError(f"max_workers must be >= 1, got {max_workers}")
    path = _model_dir(model_dir)
    shards, weight_map = _shard_plan(path)

    # Headers only (cheap): check the layout before reading any data.
    keys_by_shard = {shard: _shard_keys(shard) for shard in shards}
    owner: dict[str, Path] = {}
    for shard, keys in keys_by_shard.items():
        for key in keys:
            if key in owner:
                raise ModelLoadError(
                    f"tensor {key!r} is listed twice: in {owner[key].name} and {shard.name}"
                )
            owner[key] = shard
    if weight_map is not None:
        for key, shard_name in weight_map.items():
            if key not in owner or owner[key].name != shard_name:
                found = f"found in {owner[key].name}" if key in owner else "found nowhere"
                raise ModelLoadError(
                    f"{WEIGHTS_INDEX_FILE} maps tensor {key!r} to {shard_name}, but it is {found}"
                )

    total = sum(len(keys) for keys in keys_by_shard.values())
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress)
    bar_lock = threading.Lock()

    def load_shard(shard: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        try:
            with safe_open(str(shard), framework="pt") as fh:
                for key in keys_by_shard[shard]:
                    out[key] = _convert(fh.get_tensor(key), dtype)
                    with bar_lock:
                        bar.update(1)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read safetensors file {shard}: {exc}") from exc
        return out

    workers = max_workers or min(len(shards), os.cpu_count() or 1)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tessellm-load") as pool:
            results = list(pool.map(load_shard, shards))
    finally:
        bar.close()

    tensors: dict[str, torch.Tensor] = {}
    for part in results:
        tensors.update(part)
    return tensors


def _as_id_set(value: Any, where: str) -> set[int]:
    if value is None:
        return set()
    items = value if isinstance(value, (list, tuple)) else [value]
    ids: set[int] = set()
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ModelLoadError(f"{where} eos_token_id must be ints >= 0, got {value!r}")
        ids.add(item)
    return ids


def eos_token_ids(config: dict[str, Any], tokenizer: Any | None) -> frozenset[int]:
    """Union of config.json's, generation_config.json's and the tokenizer's EOS ids.

    Each source may be absent; config values may be an int or a list of ints.
    """
    ids = _as_id_set(config.get("eos_token_id"), CONFIG_FILE)
    generation = config.get(GENERATION_CONFIG_KEY)
    if isinstance(generation, dict):
        ids |= _as_id_set(generation.get("eos_token_id"), GENERATION_CONFIG_FILE)
    if tokenizer is not None:
        ids |= _as_id_set(getattr(tokenizer, "eos_token_id", None), "tokenizer")
    return frozenset(ids)
