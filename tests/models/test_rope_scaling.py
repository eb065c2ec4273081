"""tessellm.models.rope_scaling's longrope table against transformers (Phi-3 configs read by
tessellm.models.phi3.phi3_spec): transformers' rope init function and its Phi-3 rotary module
give, for every position of the table, the same cos and sin to the bit, long factors when the
table (the context) is longer than original_max_position_embeddings, short ones otherwise."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tessellm.errors import UnsupportedModelError
from tessellm.models.phi3 import phi3_spec
from tessellm.models.rope_scaling import rope_cos_sin

SHORT = [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6]
LONG = [1.0, 1.4, 2.0, 3.0, 4.5, 7.0, 11.0, 17.0]


def _hf_config(max_pos: int, orig: int, **rope: Any) -> Any:
    from transformers import Phi3Config
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT,
              "long_factor": LONG, **rope}
    return Phi3Config(vocab_size=32, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_pos, original_max_position_embeddings=orig,
                      rope_parameters=params, architectures=["Phi3ForCausalLM"])


def _table_of_init_function(config: Any, positions: int) -> torch.Tensor:
    """transformers' longrope init function for a sequence of `positions` tokens, expanded as
    its rotary forward does (position * inv_freq, cos and sin times the attention factor)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=positions)
    freqs = torch.arange(positions).float()[:, None] * inv_freq.float()
    return torch.cat((freqs.cos() * attention, freqs.sin() * attention), dim=-1)


def _table_of_rotary_module(config: Any, positions: int) -> torch.Tensor:
    """Phi3RotaryEmbedding on one forward call over positions 0 .. positions - 1 (its
    longrope update picks the factors by that call's length)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    rotary = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, positions, 16)
    cos, sin = rotary(x, torch.arange(positions)[None])
    half = cos.shape[-1] // 2
    return torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1)


CASES = {
    # context past the original length: long factors, attention factor from 128 / 4
    "long": (dict(max_pos=128, orig=4), True),
    # context within it, an explicit factor: short factors, sqrt(1 + ln 8 / ln 64)
    "short_with_factor": (dict(max_pos=64, orig=64, factor=8.0), False),
    # factor 1 (max == original): short factors, no attention scaling
    "short_unscaled": (dict(max_pos=64, orig=64), False),
    # an explicit attention factor wins over the computed one
    "long_attention_factor": (dict(max_pos=256, orig=16, attention_factor=1.3), True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_longrope_table_equals_transformers(name: str) -> None:
    kwargs, long = CASES[name]
    kwargs = dict(kwargs)
    max_pos, orig = kwargs.pop("max_pos"), kwargs.pop("orig")
    config = _hf_config(max_pos, orig, **kwargs)
    spec = phi3_spec(config.to_dict())
    assert spec.max_position_embeddings == max_pos
    ours = spec.rope_cos_sin()
    assert ours.shape == (max_pos, spec.head_dim)
    assert torch.equal(ours, _table_of_init_function(config, max_pos))
    assert torch.equal(ours, _table_of_rotary_module(config, max_pos))
    # which set it took: the other one gives another table
    other = dict(spec.rope_scaling)
    other["long_factor" if long else "short_factor"] = tuple(
        other["short_factor" if long else "long_factor"])
    assert not torch.equal(ours, rope_cos_sin(spec.head_dim, spec.rope_theta, max_pos, other))
    scale = float(ours[0, 0])   # cos(0) times the attention factor
    want = kwargs.get("attention_factor") or (
        1.0 if kwargs.get("factor", max_pos / orig) <= 1
        else math.sqrt(1 + math.log(kwargs.get("factor", max_pos / orig)) / math.log(orig)))
    assert scale == pytest.approx(want, rel=1e-6)


def test_old_su_config_reads_as_longrope() -> None:
    """Phi-3-mini-128k's config.json of 2024: rope_scaling {"type": "su"} and a top-level
    rope_theta and original length; transformers reads it as longrope, and so does tessellm."""
    old = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 32, "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 128,
           "original_max_position_embeddings": 4, "rope_theta": 10000.0,
           "rope_scaling": {"type": "su", "short_factor": SHORT, "long_factor": LONG},
           "sliding_window": 262144, "hidden_act": "silu", "rms_norm_eps": 1e-5}
    spec = phi3_spec(old)
    assert dict(spec.rope_scaling)["rope_type"] == "longrope"
    assert torch.equal(spec.rope_cos_sin(), _table_of_init_function(_hf_config(128, 4), 128))


@pytest.mark.parametrize("field, value, word", [
    ("short_factor", SHORT[:5], "short_factor"),
    ("long_factor", [1.0] * 7 + [0.0], "long_factor"),
    ("long_factor", None, "long_factor"),
])
def test_bad_longrope_factors_are_refused_by_name(field: str, value: Any, word: str) -> None:
    config = _hf_config(128, 4).to_dict()
    config["rope_parameters"] = {**config["rope_parameters"], field: value}
    with pytest.raises(UnsupportedModelError, match=word):
        phi3_spec(config)
