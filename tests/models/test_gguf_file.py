"""tessellm.models.gguf_file against GGUF files: the real stories260K.gguf, files written from
random-weight transformers models (tests/models/gguf_fixtures.py converts them as llama.cpp's
convert_hf_to_gguf.py does), quantized files, and damaged ones.

- stories260K.gguf (llama.cpp's F32 conversion, Q/K rows in llama.cpp's permuted order) holds
  the same numbers as stories260K-hf: loading it gives the HF tensors bit for bit (so the
  un-permutation is exact) and greedy decoding gives reference_greedy.json.
- A GGUF written from an HF model (llama, qwen2, qwen3, gpt2; float32) gives transformers'
  greedy tokens and its prefill logits within FP32_LOGITS_ATOL.
- Q8_0 / Q4_0 / Q4_1 files: quantization="auto" keeps the matrices packed, "none" expands them
  at load; both agree with each other and with transformers run on the dequantized numbers.
- Damaged files raise ModelLoadError / UnsupportedModelError naming the problem, through
  load_gguf and through LLM(...), and nothing else escapes.
"""
from __future__ import annotations

import copy
import functools
import json
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from safetensors.torch import load_file

from gguf_fixtures import (NONE_ID, STORIES_GGUF, default_tokenizer_gguf,
                           dequantized_state_dict, patched_copy, small_bpe_vocab_gguf,
                           tensor_type_offset, truncated_copy, vocab_of, write_gguf)
from hf_fixtures import (GPT2_GGUF, STORIES_260K, ModelCase, _gpt2_config, _llama_config,
                         _qwen2_config, _qwen3_config, build_hf_model)
from logits_probe import recorded_logits
import tessellm
from tessellm import LLM, SamplingParams
from tessellm.errors import ModelLoadError, UnsupportedModelError
from tessellm.models.gguf_config import gguf_config
from tessellm.models.gguf_file import load_gguf, open_gguf
from tessellm.models.gguf_tokenizer import load_gguf_tokenizer
from tessellm.quant.formats import FORMATS_BY_NAME, PackedWeight, dequantize, quantize

pytestmark = pytest.mark.skipif(not STORIES_GGUF.is_file() or not GPT2_GGUF.is_file(),
                                reason="../shared models/tokenizers not available")

NUM_GREEDY = 16
FP32_LOGITS_ATOL = 1e-4   # as test_hf_parity: float32, hidden 64, logits std ~1
PROMPT_TEXTS = ("Once upon a time, there was a little girl", "The cat sat on the mat. It was")
ENGINE_OPTIONS = dict(max_num_seqs=4, block_size=16, num_kv_blocks=64)
GREEDY = SamplingParams(max_tokens=NUM_GREEDY, temperature=0.0, ignore_eos=True)
LOAD_ERRORS = (ModelLoadError, UnsupportedModelError)


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class GGUFCase:
    """An HF model of `arch` with the vocabulary of a GGUF tokenizer (`vocab`: "stories" =
    stories260K.gguf's 512-token SentencePiece; "gpt2-512" = GPT-2's BPE cut to 512 tokens;
    "gpt2" = GPT-2's full 50257)."""

    name: str
    arch: str
    config: Callable[[Any], Any]
    seed: int
    vocab: str


CASES = {c.name: c for c in (
    GGUFCase("llama", "llama", _llama_config, 21, "stories"),      # GQA 4/2, Q/K permuted
    GGUFCase("qwen2", "qwen2", _qwen2_config, 22, "stories"),      # qkv bias, tied head
    GGUFCase("qwen3", "qwen3", _qwen3_config, 23, "stories"),      # q/k norm, head_dim 32
    GGUFCase("gpt2", "gpt2", _gpt2_config, 24, "gpt2-512"),        # fused qkv, LayerNorm
    GGUFCase("gpt2_full_vocab", "gpt2", _gpt2_config, 25, "gpt2"),
)}


@dataclass
class Written:
    case: GGUFCase
    hf: torch.nn.Module          # float32, eval, generation never stops at EOS
    path: Path                   # its float32 GGUF
    tokenizer_gguf: Path
    files: dict[str, Path] = field(default_factory=dict)   # qtype name -> GGUF
    llms: dict[tuple[str, str], LLM] = field(default_factory=dict)

    def quantized(self, qtype: str) -> Path:
        if qtype not in self.files:
            self.files[qtype] = write_gguf(self.path.with_name(f"{self.case.name}-{qtype}.gguf"),
                                           self.hf, self.case.arch, qtype=qtype,
                                           tokenizer_gguf=self.tokenizer_gguf)
        return self.files[qtype]

    def llm(self, cache_dir: Path, qtype: str = "F32", quantization: str = "auto") -> LLM:
        key = (qtype, quantization)
        if key not in self.llms:
            path = self.path if qtype == "F32" else self.quantized(qtype)
            options: dict[str, Any] = {"quantization": quantization}
            if qtype != "F32" and quantization == "auto" and native_packed_linear():
                # pinned to the C kernel, which is offered up to 256 tokens a step
                options["kernel_selection"] = {"linear_packed": "linear_packed_native"}
                options["max_num_batched_tokens"] = 256
            self.llms[key] = make_llm(path, cache_dir, **options)
        return self.llms[key]


@functools.cache
def native_packed_linear() -> bool:
    """Whether the CPU plugin's C packed-linear kernel builds here: packed engines pin it (it
    is the kernel whose arithmetic differs from dequantize-then-matmul; pinning also skips
    profiling)."""
    try:
        from tessellm_cpu.native_linear import NativePackedLinear
        NativePackedLinear()
    except Exception:   # no compiler, no plugin: let the engine choose
        return False
    return True


def make_llm(path: Path, cache_dir: Path, **options: Any) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", load_progress=False,
               cache_dir=str(cache_dir), **{**ENGINE_OPTIONS, **options})


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tessellm-cache")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def written_cases(gguf_dir: Path) -> Iterator[Callable[[str], Written]]:
    """written_cases(name): the case's HF model and GGUF, made on first use in this module."""
    cache: dict[str, Written] = {}

    def get(name: str) -> Written:
        if name not in cache:
            case = CASES[name]
            if case.vocab == "gpt2-512":
                tok_path = gguf_dir / "gpt2-512-vocab.gguf"
                if not tok_path.is_file():
                    small_bpe_vocab_gguf(tok_path, 512)
            else:
                tok_path = default_tokenizer_gguf(case.arch)
            vocab = vocab_of(tok_path)
            hf = build_hf_model(ModelCase(name, lambda: vocab, case.config, case.seed), vocab)
            hf.generation_config.eos_token_id = None   # HF greedy must not stop or mask EOS
            path = write_gguf(gguf_dir / f"{name}.gguf", hf, case.arch, tokenizer_gguf=tok_path)
            cache[name] = Written(case, hf, path, tok_path)
        return cache[name]

    yield get
    cache.clear()


@pytest.fixture
def written(request: pytest.FixtureRequest, written_cases: Callable[[str], Written]) -> Written:
    return written_cases(request.param)


# --------------------------------------------------------------------------- helpers


def prefill_logits_and_greedy(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The logits at the prompt's last position (the sampler's first call) and the greedy
    continuation of NUM_GREEDY tokens."""
    with recorded_logits(llm) as seen:
        out = llm.generate([ids], GREEDY)[0]
    assert seen and seen[0].shape[0] == 1, [tuple(t.shape) for t in seen]
    return seen[0][0], out.token_ids


@torch.inference_mode()
def hf_logits_and_greedy(hf: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    prompt = torch.tensor([ids])
    logits = hf(prompt).logits[0, -1]
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                      max_new_tokens=NUM_GREEDY, min_new_tokens=NUM_GREEDY)
    return logits, out[0, len(ids):].tolist()


def prompts_of(llm: LLM, vocab: int) -> list[list[int]]:
    """The text prompts through the file's tokenizer, and random ids ending the vocabulary."""
    rng = random.Random(3)
    return [llm.encode(t) for t in PROMPT_TEXTS] + [
        [vocab - 1] + [rng.randrange(vocab) for _ in range(23)]]


def assert_matches_hf(llm: LLM, hf: torch.nn.Module, prompts: list[list[int]]) -> list[int]:
    """Greedy tokens equal, prefill logits within FP32_LOGITS_ATOL; returns the tokens."""
    tokens: list[int] = []
    for ids in prompts:
        ours, got = prefill_logits_and_greedy(llm, ids)
        theirs, want = hf_logits_and_greedy(hf, ids)
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=FP32_LOGITS_ATOL, rtol=0)
        assert got == want, ids
        tokens += got
    return tokens


def packed_in_plan(llm: LLM) -> list[PackedWeight]:
    return [w for w in llm.engine.parts.plan.constants.values() if isinstance(w, PackedWeight)]


# --------------------------------------------------------------------------- stories260K.gguf


def test_stories260k_gguf_holds_the_hf_checkpoint_numbers() -> None:
    """Every tensor of stories260K.gguf, loaded, equals stories260K-hf's exactly: the Q/K rows
    llama.cpp permuted (8 query, 4 KV heads) are put back in HF's order."""
    hf = load_file(str(STORIES_260K / "model.safetensors"))
    raw = {t.name: np.asarray(t.data) for t in open_gguf(STORIES_GGUF).tensors}
    q0 = hf["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(raw["blk.0.attn_q.weight"], q0)   # stored permuted
    gg = load_gguf(STORIES_GGUF, torch.float32, keep_packed=True)
    # stories260K-hf ties its head; the llama2.c export wrote the same numbers as `output`
    assert set(gg.weights) == set(hf) | {"lm_head.weight"}
    assert torch.equal(gg.weights["lm_head.weight"], hf["model.embed_tokens.weight"])
    for name, want in hf.items():
        got = gg.weights[name]
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, name
        assert torch.equal(got, want), name
    assert not gg.packed_types and not gg.dequantized_types   # F32 stays F32
    hf_config = json.loads((STORIES_260K / "config.json").read_text(encoding="utf-8"))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size"):
        assert gg.config[key] == hf_config[key], key
    assert gg.config["rms_norm_eps"] == pytest.approx(hf_config["rms_norm_eps"])
    assert gg.config["tie_word_embeddings"] is False


def test_stories260k_gguf_reference_greedy(cache_dir: Path) -> None:
    ref = json.loads((STORIES_260K / "reference_greedy.json").read_text(encoding="utf-8"))
    llm = LLM(model=str(STORIES_GGUF), device="cpu", dtype="float32", load_progress=False,
              cache_dir=str(cache_dir))
    n = ref["max_new_tokens"]
    prompt_ids = llm.encode(ref["prompt"])
    assert ref["add_bos"] and prompt_ids == ref["token_ids"][:-n]
    out = llm.generate([ref["prompt"]], SamplingParams(max_tokens=n, temperature=0.0,
                                                       ignore_eos=True))[0]
    assert out.token_ids == ref["token_ids"][len(prompt_ids):]
    assert llm.decode(prompt_ids + out.token_ids) == ref["text"]


def test_loading_a_gguf_parses_its_header_once(monkeypatch: pytest.MonkeyPatch,
                                               cache_dir: Path) -> None:
    """Config, weights and tokenizer share one parsed header (tessellm's own reader); the
    `gguf` package's reader (seconds for a large vocabulary) is never used, nor is
    transformers' parse of the header for a config."""
    from tessellm.models import gguf_reader
    from transformers import modeling_gguf_pytorch_utils
    calls: list[str] = []
    real = gguf_reader.read_gguf

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(str(args[0]))
        return real(*args, **kwargs)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a slow GGUF header parse")

    monkeypatch.setattr(gguf_reader, "read_gguf", counting)
    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(modeling_gguf_pytorch_utils, "load_gguf_checkpoint", refuse)
    LLM(model=str(STORIES_GGUF), device="cpu", dtype="float32", load_progress=False,
        cache_dir=str(cache_dir))
    assert calls == [str(STORIES_GGUF)]


def test_stories260k_gguf_tokenizer_with_none_special_ids() -> None:
    """stories260K.gguf says "no padding / separator token" with id 2**32 - 1 (llama.cpp's
    convention); the tokenizer still loads, without those tokens."""
    reader = open_gguf(STORIES_GGUF)
    assert reader.fields["tokenizer.ggml.padding_token_id"].contents() == NONE_ID
    assert reader.fields["tokenizer.ggml.seperator_token_id"].contents() == NONE_ID
    tok = load_gguf_tokenizer(STORIES_GGUF)
    assert len(tok) == 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    assert tok.pad_token_id is None
    assert tok("Once upon a time").input_ids == [1, 403, 407, 261, 378]


# --------------------------------------------------------------------------- written, float32

FLOAT_CASES = ["llama", "qwen2", "qwen3", "gpt2",
               pytest.param("gpt2_full_vocab", marks=pytest.mark.slow)]


@pytest.mark.parametrize("written", FLOAT_CASES, indirect=True)
def test_written_gguf_matches_transformers(written: Written, cache_dir: Path) -> None:
    """Greedy tokens equal transformers' on the HF model the file was written from; prefill
    logits (last position) within FP32_LOGITS_ATOL."""
    hf_config = written.hf.config
    config = gguf_config(open_gguf(written.path))
    assert config["vocab_size"] == hf_config.vocab_size
    if written.case.arch != "gpt2":
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size"):
            assert config[key] == getattr(hf_config, key), key
        head_dim = getattr(hf_config, "head_dim", None)   # Qwen2Config has none
        assert config["head_dim"] == (head_dim or hf_config.hidden_size
                                      // hf_config.num_attention_heads)
        assert config["tie_word_embeddings"] == hf_config.tie_word_embeddings
    llm = written.llm(cache_dir)
    assert not packed_in_plan(llm)
    tokens = assert_matches_hf(llm, written.hf, prompts_of(llm, hf_config.vocab_size))
    assert len(set(tokens)) >= 4, tokens   # not a degenerate model


@pytest.mark.parametrize("written", ["llama", "qwen2", "qwen3"], indirect=True)
def test_written_gguf_weights_are_the_hf_tensors(written: Written) -> None:
    """The Llama family's GGUF weights arrive under HF's names with HF's numbers (llama's Q/K
    un-permuted, qwen2/qwen3's never permuted)."""
    gg = load_gguf(written.path, torch.float32, keep_packed=True)
    state = {k: v for k, v in written.hf.state_dict().items()
             if not (k == "lm_head.weight" and written.hf.config.tie_word_embeddings)}
    assert set(gg.weights) == set(state)
    for name, want in state.items():
        assert torch.equal(gg.weights[name], want), name


def test_written_tokenizers_are_the_sources(written_cases: Callable[[str], Written],
                                            cache_dir: Path) -> None:
    """The copied tokenizer metadata tokenizes as the source file does."""
    llama = written_cases("llama").llm(cache_dir)
    assert llama.encode("Once upon a time") == [1, 403, 407, 261, 378]   # reference_greedy
    gpt2 = written_cases("gpt2").llm(cache_dir)
    ids = gpt2.encode("Once upon a time, there was a little girl")
    assert all(i < 511 for i in ids) and len(ids) > 8
    assert gpt2.decode(ids) == "Once upon a time, there was a little girl"


def test_gpt2_without_output_tensor_ties_the_head(written_cases: Callable[[str], Written],
                                                  gguf_dir: Path, cache_dir: Path) -> None:
    """convert_hf_to_gguf.py writes GPT-2's tied head out as `output`; a file without it
    reads the head from token_embd (GPT-2 ties them), so it still equals transformers."""
    w = written_cases("gpt2")
    path = write_gguf(gguf_dir / "gpt2-no-output.gguf", w.hf, "gpt2", omit=["output.weight"],
                      tokenizer_gguf=w.tokenizer_gguf)
    assert "output.weight" not in {t.name for t in open_gguf(path).tensors}
    llm = make_llm(path, cache_dir)
    assert_matches_hf(llm, w.hf, prompts_of(llm, w.hf.config.vocab_size)[:1])


# --------------------------------------------------------------------------- quantized


QUANT_CASES = [("llama", "Q8_0"), ("llama", "Q4_1"), ("llama", "Q4_0"), ("qwen2", "Q4_1"),
               ("gpt2", "Q8_0")]


@pytest.mark.parametrize("name, qtype", QUANT_CASES)
def test_quantized_gguf_auto_equals_none(name: str, qtype: str,
                                         written_cases: Callable[[str], Written],
                                         cache_dir: Path) -> None:
    """quantization="auto" runs the file's packed matrices in place (PackedWeight, pinned to the
    CPU plugin's C packed-linear kernel where it builds); "none" dequantizes them to float32
    at load. Both compute with the same numbers: a weight is d * q (+ m), an fp16 scale times a
    small integer (plus an fp16 offset), and the loader's expansion is bit for bit the
    kernels' dequantizer (checked below). What differs is only how the dot products are summed:
    the C kernel regroups each 32-weight block as d * (q . x) + m * sum(x) and adds blocks in
    its own order, where "none" runs one float32 matmul over d * q + m. In float32 that moves
    the logits by ~1e-6 (rounding only), far below the top-2 margins of these models: greedy
    tokens are equal and logits agree within FP32_LOGITS_ATOL. "none" in turn equals
    transformers run on the dequantized weights (same check)."""
    w = written_cases(name)
    path = w.quantized(qtype)
    fmt = FORMATS_BY_NAME[qtype.lower()]

    packed = load_gguf(path, torch.float32, keep_packed=True)
    dense = load_gguf(path, torch.float32, keep_packed=False)
    matrices = {n for n, t in packed.weights.items() if isinstance(t, PackedWeight)}
    assert matrices and all(packed.weights[n].format is fmt for n in matrices)
    assert all(len(packed.weights[n].shape) == 2 for n in matrices)
    assert all(not isinstance(t, PackedWeight) and (t.dim() == 1 or n == "wpe.weight")
               for n, t in packed.weights.items() if n not in matrices)   # norms, biases
    assert packed.packed_types == Counter({qtype: sum(packed.packed_types.values())})
    assert not packed.dequantized_types
    assert not any(isinstance(t, PackedWeight) for t in dense.weights.values())
    assert dense.dequantized_types == packed.packed_types
    for n in matrices:   # the same numbers: the loader's expansion is the kernels' dequantizer
        assert torch.equal(dense.weights[n], dequantize(packed.weights[n])), n

    auto, none = w.llm(cache_dir, qtype, "auto"), w.llm(cache_dir, qtype, "none")
    assert packed_in_plan(auto) and not packed_in_plan(none)
    hf_deq = copy.deepcopy(w.hf)
    hf_deq.load_state_dict(dequantized_state_dict(path, w.hf, w.case.arch))
    for ids in prompts_of(none, w.hf.config.vocab_size):
        a_logits, a_tokens = prefill_logits_and_greedy(auto, ids)
        n_logits, n_tokens = prefill_logits_and_greedy(none, ids)
        assert a_tokens == n_tokens, ids
        torch.testing.assert_close(a_logits, n_logits, atol=FP32_LOGITS_ATOL, rtol=0)
        h_logits, h_tokens = hf_logits_and_greedy(hf_deq, ids)
        assert n_tokens == h_tokens, ids
        torch.testing.assert_close(n_logits, h_logits, atol=FP32_LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_packed_tensors_are_llama_cpp_bytes(qtype: str,
                                            written_cases: Callable[[str], Written]) -> None:
    """The gguf package's reference quantizer (llama.cpp's bytes) and tessellm's quantizer give
    the same bytes; tessellm's dequantizer gives gguf's numbers; a packed Q/K keeps its rows
    un-permuted like the dense one (row permutation commutes with row-wise blocks)."""
    w = written_cases("llama")
    fmt = FORMATS_BY_NAME[qtype.lower()]
    dense = {t.name: torch.from_numpy(np.array(t.data)) for t in open_gguf(w.path).tensors}
    n_checked = 0
    for t in open_gguf(w.quantized(qtype)).tensors:
        if int(t.tensor_type) == 0:   # F32 (norms)
            continue
        assert int(t.tensor_type) == fmt.ggml_type, t.name
        stored = torch.from_numpy(np.array(t.data))
        ours = quantize(dense[t.name], fmt)
        assert torch.equal(ours.data, stored), t.name
        ref = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), QT[qtype]))
        assert torch.equal(dequantize(ours), ref), t.name
        n_checked += 1
    assert n_checked == 2 + 7 * 2   # embedding, head, 7 matrices a layer
    gg = load_gguf(w.quantized(qtype), torch.float32, keep_packed=True)
    for proj in ("q_proj", "k_proj"):
        hf_w = w.hf.state_dict()[f"model.layers.1.self_attn.{proj}.weight"]
        assert torch.equal(gg.weights[f"model.layers.1.self_attn.{proj}.weight"].data,
                           quantize(hf_w, fmt).data), proj


# --------------------------------------------------------------------------- damaged files


@pytest.fixture(scope="module")
def good(written_cases: Callable[[str], Written]) -> Written:
    return written_cases("llama")


def _llm_error(path: Path, cache_dir: Path) -> BaseException:
    with pytest.raises(LOAD_ERRORS) as info:
        make_llm(path, cache_dir)
    return info.value


def _load_error(path: Path) -> BaseException:
    with pytest.raises(LOAD_ERRORS) as info:
        load_gguf(path, torch.float32, keep_packed=True)
    return info.value


def _assert_names(exc: BaseException, *words: str, path: Path | None = None) -> None:
    """Each word is in the message (outside the file's path, which names the test)."""
    message = str(exc).replace(str(path), "<file>") if path else str(exc)
    for word in words:
        assert word in message, (word, message)


def _written_variant(good: Written, tmp_path: Path, **options: Any) -> Path:
    return write_gguf(tmp_path / "variant.gguf", good.hf, "llama",
                      tokenizer_gguf=good.tokenizer_gguf, **options)


def test_bad_magic(good: Written, tmp_path: Path, cache_dir: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + good.path.read_bytes()[4:])
    for exc in (_load_error(bad), _llm_error(bad, cache_dir)):
        assert isinstance(exc, ModelLoadError)
        _assert_names(exc, "magic", "GGUX")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _assert_names(_load_error(empty), "magic")


def _cut_points(path: Path) -> dict[str, int]:
    reader = gguf.GGUFReader(path)
    start = min(t.data_offset for t in reader.tensors)
    size = path.stat().st_size
    return {"after_magic": 4, "in_header": 20, "in_metadata": start // 3,
            "before_data": start - 1, "at_data": start, "in_data": (start + size) // 2,
            "last_byte": size - 1}


CUTS = ["after_magic", "in_header", "in_metadata", "before_data", "at_data", "in_data",
        "last_byte"]


@pytest.mark.parametrize("cut", CUTS)
def test_truncated_file_is_a_load_error(cut: str, good: Written, tmp_path: Path,
                                        cache_dir: Path) -> None:
    short = truncated_copy(good.path, tmp_path / "short.gguf", _cut_points(good.path)[cut])
    for exc in (_load_error(short), _llm_error(short, cache_dir)):
        assert isinstance(exc, ModelLoadError)
        _assert_names(exc, str(short))


@pytest.mark.parametrize("cut", ["in_data", "last_byte"])
def test_truncated_file_message_says_truncated(cut: str, good: Written, tmp_path: Path) -> None:
    short = truncated_copy(good.path, tmp_path / "short.gguf", _cut_points(good.path)[cut])
    _assert_names(_load_error(short), "truncated", path=short)


def test_missing_tensor(good: Written, tmp_path: Path, cache_dir: Path) -> None:
    path = _written_variant(good, tmp_path, omit=["blk.0.attn_q.weight"])
    for exc in (_load_error(path), _llm_error(path, cache_dir)):
        assert isinstance(exc, ModelLoadError)
        _assert_names(exc, "blk.0.attn_q.weight")


def test_missing_layer_and_metadata(good: Written, tmp_path: Path, cache_dir: Path) -> None:
    more = _written_variant(good, tmp_path, metadata={"llama.block_count": (3, VT.UINT32)})
    _assert_names(_load_error(more), "blk.2.attn_q.weight")
    no_key = write_gguf(tmp_path / "nokey.gguf", good.hf, "llama",
                        tokenizer_gguf=good.tokenizer_gguf,
                        metadata={"llama.embedding_length": None})
    for exc in (_load_error(no_key), _llm_error(no_key, cache_dir)):
        assert isinstance(exc, ModelLoadError)
        _assert_names(exc, "llama.embedding_length")


def test_unknown_architecture(good: Written, tmp_path: Path, cache_dir: Path) -> None:
    path = _written_variant(good, tmp_path, architecture="mamba9")
    assert open_gguf(path).fields["mamba9.block_count"].contents() == 2
    for exc in (_load_error(path), _llm_error(path, cache_dir)):
        assert isinstance(exc, UnsupportedModelError)
        _assert_names(exc, "mamba9")
    with pytest.raises(UnsupportedModelError, match="mamba9"):
        gguf_config(open_gguf(path))


def test_unknown_tensor_type_id(good: Written, tmp_path: Path, cache_dir: Path) -> None:
    offset = tensor_type_offset(good.path, "blk.0.attn_k.weight")
    path = patched_copy(good.path, tmp_path / "type99.gguf", offset, (99).to_bytes(4, "little"))
    with open(path, "rb") as fh:
        fh.seek(offset)
        assert fh.read(4) == b"\x63\x00\x00\x00"
    for exc in (_load_error(path), _llm_error(path, cache_dir)):
        assert isinstance(exc, ModelLoadError)
        _assert_names(exc, "99")


def test_tensor_type_tessellm_cannot_expand(good: Written, tmp_path: Path,
                                            cache_dir: Path) -> None:
    """A valid GGML type the gguf package cannot dequantize (I32, same 4 bytes per element)."""
    offset = tensor_type_offset(good.path, "blk.0.attn_k.weight")
    path = patched_copy(good.path, tmp_path / "i32.gguf", offset,
                        int(QT.I32).to_bytes(4, "little"))
    for exc in (_load_error(path), _llm_error(path, cache_dir)):
        assert isinstance(exc, ModelLoadError)
        _assert_names(exc, "blk.0.attn_k.weight", "I32")


@pytest.mark.parametrize("extra, shape", [("blk.0.attn_foo.weight", (4, 64)),
                                          ("blk.2.attn_q.weight", (64, 64)),
                                          ("rope_freqs_typo.weight", (8,))])
def test_unknown_tensor_name(extra: str, shape: tuple[int, ...], good: Written,
                             tmp_path: Path, cache_dir: Path) -> None:
    path = _written_variant(good, tmp_path,
                            extra_tensors={extra: np.zeros(shape, np.float32)})
    for exc in (_load_error(path), _llm_error(path, cache_dir)):
        assert isinstance(exc, ModelLoadError)
        _assert_names(exc, extra)


def test_not_a_gguf_file(good: Written, tmp_path: Path, cache_dir: Path) -> None:
    safetensors = STORIES_260K / "model.safetensors"
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        make_llm(safetensors, cache_dir)
    with pytest.raises(ModelLoadError, match="magic"):
        open_gguf(safetensors)
    renamed = tmp_path / "model.gguf"   # a .gguf name on safetensors bytes
    renamed.write_bytes(safetensors.read_bytes())
    for exc in (_load_error(renamed), _llm_error(renamed, cache_dir)):
        _assert_names(exc, "magic")
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_gguf(tmp_path / "absent.gguf")


BAD_METADATA = [
    pytest.param({"llama.block_count": ("two", VT.STRING)}, "llama.block_count",
                 id="block_count_string"),
    pytest.param({"llama.attention.head_count": (0, VT.UINT32)}, "head_count",
                 id="head_count_zero"),
    pytest.param({"llama.attention.head_count": (3, VT.UINT32)}, "head_count",
                 id="head_count_not_dividing"),
]


@pytest.mark.parametrize("metadata, word", BAD_METADATA)
def test_bad_metadata_is_a_load_error(metadata: dict[str, Any], word: str, good: Written,
                                      tmp_path: Path) -> None:
    path = _written_variant(good, tmp_path, metadata=metadata)
    _assert_names(_load_error(path), word)


@pytest.mark.parametrize("case, variant, word", [
    ("llama", dict(extra_tensors={"blk.0.attn_v.weight": np.zeros((16, 64), np.float32)}),
     "blk.0.attn_v.weight"),
    ("llama", dict(extra_tensors={"output_norm.weight": np.zeros((32,), np.float32)}),
     "output_norm.weight"),
    ("qwen2", dict(metadata={"qwen2.attention.head_count": (3, VT.UINT32)}), "head_count"),
], ids=["attn_v_rows", "output_norm_width", "qwen2_head_count"])
def test_tensor_shape_disagreeing_with_metadata_is_a_load_error(
        case: str, variant: dict[str, Any], word: str,
        written_cases: Callable[[str], Written], tmp_path: Path) -> None:
    w = written_cases(case)
    path = write_gguf(tmp_path / "shape.gguf", w.hf, w.case.arch,
                      tokenizer_gguf=w.tokenizer_gguf, **variant)
    _assert_names(_load_error(path), word)


# --------------------------------------------------------------------------- special token ids


def test_none_special_ids_load_tokenizer_and_engine(good: Written, tmp_path: Path,
                                                    cache_dir: Path) -> None:
    """BOS, EOS and UNK all 2**32 - 1 ("none"): the tokenizer loads without them (no BOS is
    added), and the engine loads and generates."""
    none = {f"tokenizer.ggml.{k}": (NONE_ID, VT.UINT32)
            for k in ("bos_token_id", "eos_token_id", "unknown_token_id")}
    path = _written_variant(good, tmp_path, metadata=none)
    tok = load_gguf_tokenizer(path)
    assert len(tok) == 512
    assert tok.bos_token_id is None and tok.eos_token_id is None
    assert tok("Once upon a time").input_ids == [403, 407, 261, 378]
    llm = make_llm(path, cache_dir)
    ids = llm.encode("Once upon a time")
    assert ids == [403, 407, 261, 378]
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
