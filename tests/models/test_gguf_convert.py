"""`tessellm convert HF_DIR OUT.gguf`: the written file loads (float32, dequantized) and equals
transformers on the HF checkpoint it came from: greedy tokens, and the file's tokenizer
encodes as the directory's. Cases: Mistral with Llama 2's SentencePiece tokenizer (arch
`llama`, Q/K rows permuted), Llama with Llama 3's BPE tokenizer and rope_type llama3 (written
as `rope_freqs`); Qwen3 (BPE, q/k norms) is checked on its weights and config only (building
its 151k-token tokenizer from the file takes ~30 s; the BPE path is the Llama 3 case's)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hf_fixtures import CASES, TOKENIZERS, build_hf_model, save_model_dir
from tessellm import LLM, SamplingParams
from tessellm.cli.main import main as cli_main
from tessellm.errors import UnsupportedModelError
from tessellm.models.gguf_convert import convert_hf_to_gguf
from tessellm.models.gguf_config import gguf_config
from tessellm.models.gguf_file import load_gguf, open_gguf

LLAMA2_SPM = TOKENIZERS / "llama2" / "tokenizer.model"
TEXTS = ["Hello, my name is", "The capital of France is Paris. The capital of Germany is",
         "naïve café: 3.14159 + 2 = 5.14159 — 東京 🙂\n\tdef f(x): return x**2"]
# (not a leading run of spaces: transformers' tokenizer built from a SentencePiece GGUF, the
# one tessellm uses for every such file, splits "  x" as "▁" "▁x" where sentencepiece gives
# "▁▁" "x", since Llama 2 scores "▁▁" at -1e9)
N = 20


@pytest.mark.parametrize("name", ["mistral", "mistral_spm", "llama_rope3", "qwen3"])
def test_converted_file_equals_transformers(name: str, tmp_path: Path, capsys) -> None:
    """mistral: the tokenizer as transformers saves it (tokenizer.json only: SentencePiece BPE
    with byte fallback); mistral_spm: with Llama 2's tokenizer.model beside it (read by
    sentencepiece: pieces, scores, types)."""
    case = CASES[name.removesuffix("_spm")]
    tok = case.tokenizer()
    hf = build_hf_model(case, tok)
    hf.generation_config.eos_token_id = None
    model_dir = save_model_dir(hf, tok, tmp_path / name)
    if name.endswith("_spm"):
        shutil.copy(LLAMA2_SPM, model_dir / "tokenizer.model")
    out = tmp_path / f"{name}.gguf"
    assert cli_main(["convert", str(model_dir), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    config = gguf_config(open_gguf(out))
    if name == "llama_rope3":
        assert config["rope_scaling"]["rope_type"] == "freq_factors"
    gg = load_gguf(out, torch.float32, keep_packed=True)
    state = {k: v for k, v in hf.state_dict().items()
             if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)
             and not k.endswith("inv_freq")}
    for k, v in state.items():   # F16 matrices: the HF numbers rounded to half precision
        assert torch.equal(gg.weights[k], v.half().float() if v.dim() == 2 else v), k
    if name == "qwen3":
        assert config["architectures"] == ["Qwen3ForCausalLM"]
        assert config["vocab_size"] == hf.config.vocab_size
        return
    llm = LLM(model=str(out), device="cpu", dtype="float32", quantization="none",
              load_progress=False, num_kv_blocks=64, max_num_seqs=4)
    half = type(hf).from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():   # transformers on the same F16-rounded matrices
        for p in half.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    half.generation_config.eos_token_id = None
    for text in TEXTS:
        ids = tok(text).input_ids
        assert llm.encode(text) == ids, text
        want = half.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=N, min_new_tokens=N)[0, len(ids):].tolist()
        got = llm.generate([ids], SamplingParams(max_tokens=N, temperature=0.0,
                                                 ignore_eos=True))[0].token_ids
        assert got == want, text


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GemmaForCausalLM"]}')
    with pytest.raises(UnsupportedModelError, match="GemmaForCausalLM"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")


def test_converted_mixtral_stacks_experts_and_equals_transformers(tmp_path: Path) -> None:
    """Mixtral (`llama` with expert_count): the per-expert w1/w3/w2 tensors become
    llama.cpp's stacked ffn_*_exps; greedy tokens equal transformers on the F16-rounded
    weights (every matrix, the 3-D expert stacks included)."""
    case = CASES["mixtral"]
    tok = case.tokenizer()
    hf = build_hf_model(case, tok)
    model_dir = save_model_dir(hf, tok, tmp_path / "mixtral")
    out = convert_hf_to_gguf(model_dir, tmp_path / "mixtral.gguf")
    names = {t.name for t in open_gguf(out).tensors}
    assert "blk.0.ffn_gate_exps.weight" in names and "blk.1.ffn_down_exps.weight" in names
    assert not any(".ffn_gate.0." in n for n in names)
    config = gguf_config(open_gguf(out))
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.copy_(p.half().float())
    hf.generation_config.eos_token_id = None
    llm = LLM(model=str(out), device="cpu", dtype="float32", quantization="none",
              load_progress=False, num_kv_blocks=64, max_num_seqs=4)
    for text in TEXTS[:2]:
        ids = tok(text).input_ids
        want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           do_sample=False, max_new_tokens=N, min_new_tokens=N)[0, len(ids):].tolist()
        got = llm.generate([ids], SamplingParams(max_tokens=N, temperature=0.0,
                                                 ignore_eos=True))[0].token_ids
        assert got == want, text


def test_converting_moe_llama_cpp_cannot_express_is_refused(tmp_path: Path) -> None:
    """qwen2_moe's case keeps layer 1 dense (mlp_only_layers): llama.cpp routes every layer."""
    case = CASES["qwen2_moe"]
    tok = case.tokenizer()
    model_dir = save_model_dir(build_hf_model(case, tok), tok, tmp_path / "qwen2_moe")
    with pytest.raises(UnsupportedModelError, match="dense layers"):
        convert_hf_to_gguf(model_dir, tmp_path / "x.gguf")
