"""The built-in demo model: a tiny, deterministic, untrained Llama in Hugging Face layout.

It lets the engine, server and CLI run end to end with no download. Its weights are random
(torch.Generator seeded with 0), so its output is gibberish by design.

Invariants:
- The files are a pure function of DEMO_FORMAT_VERSION and the installed torch/safetensors:
  two writes produce a byte-identical model.safetensors.
- The directory appears atomically: everything is written into a temporary sibling directory
  that is then renamed into place, so a reader never sees a half-written model. A directory is
  "complete" when its marker file carries the current DEMO_FORMAT_VERSION and every file exists.
- A non-empty directory that is not a demo model written by us is never modified or deleted.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any


from tessellm.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

DEMO_NOTICE = "demo model: random, untrained weights — output is gibberish by design"
DEMO_FORMAT_VERSION = 1
MARKER_FILE = "tessellm_demo.json"
CACHE_ENV_VAR = "TESSELLM_CACHE_DIR"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    MARKER_FILE,
)

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
BOS_ID = 256  # ids 0..255 are the bytes themselves
EOS_ID = 257
VOCAB_SIZE = 258

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
MAX_POSITIONS = 512
INIT_STD = 0.02
SEED = 0


def default_demo_dir() -> Path:
    """`$TESSELLM_CACHE_DIR/demo-model`, else `~/.cache/tessellm/demo-model`."""
    root = os.environ.get(CACHE_ENV_VAR)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tessellm"
    return base / "demo-model"


def demo_config() -> dict[str, Any]:
    """The HF config.json of the demo model (LlamaForCausalLM)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "initializer_range": INIT_STD,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "use_cache": True,
    }


def demo_weights() -> dict[str, torch.Tensor]:
    """The demo model's tensors under their HF Llama names, drawn in a fixed order."""
    import torch
    gen = torch.Generator(device="cpu").manual_seed(SEED)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * INIT_STD

    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = normal(q_out, HIDDEN)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_out, HIDDEN)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_out, HIDDEN)
        weights[p + "self_attn.o_proj.weight"] = normal(HIDDEN, q_out)
        weights[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        weights[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        weights[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
        weights[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    weights["model.norm.weight"] = torch.ones(HIDDEN)
    weights["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN)
    return weights


def _byte_symbols() -> list[str]:
    """The 256 printable symbols the ByteLevel pre-tokenizer maps bytes 0..255 to (GPT-2's
    table: printable Latin-1 bytes stand for themselves, the rest move to U+0100 upwards)."""
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    symbols: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in keep:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(0x100 + shifted))
            shifted += 1
    return symbols


def _write_tokenizer(out_dir: Path) -> None:
    """Byte-level BPE without merges: one token per byte, plus <s> and </s>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    vocab[BOS_TOKEN], vocab[EOS_TOKEN] = BOS_ID, EOS_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (BOS_TOKEN, EOS_TOKEN)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    # Name the class every transformers version knows (v5 writes its new backend name).
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(config_path, tok_config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_demo_model(out_dir: Path) -> None:
    _write_json(out_dir / "config.json", demo_config())
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    _write_json(out_dir / "generation_config.json", generation)
    from safetensors.torch import save_file
    save_file(demo_weights(), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(out_dir)
    (out_dir / "README.md").write_text(
        f"# tessellm demo model\n\n{DEMO_NOTICE}.\n\n"
        "This tiny Llama (2 layers, hidden size 64, byte-level tokenizer) is untrained: its "
        "weights are random numbers drawn from a generator seeded with 0. It exists so tessellm "
        "can run end to end without downloading anything. Do not expect meaningful text.\n",
        encoding="utf-8",
    )
    _write_json(out_dir / MARKER_FILE, {"format_version": DEMO_FORMAT_VERSION})  # last: "done"


def _marker_version(path: Path) -> int | None:
    try:
        data = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    version = data.get("format_version") if isinstance(data, dict) else None
    return version if isinstance(version, int) else None


def _is_complete(path: Path) -> bool:
    return _marker_version(path) == DEMO_FORMAT_VERSION and all(
        (path / name).is_file() for name in REQUIRED_FILES
    )


def _check_replaceable(path: Path) -> None:
    """Refuse a target we did not write: only absent, empty or stale demo dirs may be replaced."""
    if not path.exists():
        return
    if not path.is_dir():
        raise ModelLoadError(f"demo model path {str(path)!r} exists and is not a directory")
    if any(path.iterdir()) and not (path / MARKER_FILE).exists():
        raise ModelLoadError(
            f"directory {str(path)!r} is not empty and holds no tessellm demo model; "
            "refusing to overwrite it (choose another cache dir)"
        )


def _publish(tmp: Path, target: Path) -> None:
    """Rename `tmp` onto `target`; on a lost race keep the winner's complete copy."""
    for _ in range(2):
        try:
            os.rename(tmp, target)  # atomic; succeeds when target is absent or an empty dir
            return
        except OSError:
            if _is_complete(target):
                return  # another writer finished first
            _check_replaceable(target)
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            try:
                os.rename(target, stale / "old")  # a stale demo dir of ours: move it aside
            except FileNotFoundError:
                pass  # someone else removed it meanwhile
            except OSError as exc:
                raise ModelLoadError(f"cannot replace stale demo model {str(target)!r}: {exc}")
            finally:
                shutil.rmtree(stale, ignore_errors=True)
    raise ModelLoadError(f"could not move the demo model into {str(target)!r}")


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """Return the directory holding the demo model, writing it there first if needed.

    `cache_dir` is the model directory itself (default: `default_demo_dir()`). A complete
    model already there is reused as is.
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_demo_dir()
    target = target.absolute()
    if _is_complete(target):
        return target
    _check_replaceable(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as e:
        raise ModelLoadError(f"cannot write the demo model into {str(target.parent)!r}: {e} "
                             "(set TESSELLM_CACHE_DIR to a writable directory)") from None
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        _write_demo_model(tmp)
        _publish(tmp, target)
    except ModelLoadError:
        raise
    except OSError as e:
        raise ModelLoadError(f"cannot write the demo model into {str(target)!r}: {e}") \
            from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
