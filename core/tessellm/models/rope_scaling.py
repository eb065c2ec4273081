"""Rotary position tables under the rope scalings of HF configs and GGUF files.

`rope_cos_sin(head_dim, theta, positions, scaling)` is the [positions, head_dim] float32 table
(cos | sin of each position's angles) that rotary_embedding reads, with the frequencies of
transformers' rope types:
- default; linear (positions / factor); llama3 (Llama 3.1: long wavelengths / factor, a smooth
  ramp between low_freq_factor and high_freq_factor);
- yarn (Qwen2.5 / DeepSeek long context: interpolation blended with extrapolation over the
  dimensions between beta_fast and beta_slow rotations, cos and sin scaled by the attention
  factor 0.1 ln(factor) + 1, or mscale / mscale_all_dim);
- dynamic (NTK): the base grows with the sequence length past the original one. transformers
  recomputes the frequencies for the longest position of each forward call; the table gives
  position p the frequencies of a sequence of p + 1 tokens, which is what transformers uses
  for every generated token (and for prompts no longer than the original length);
- freq_factors: GGUF's `rope_freqs` tensor (llama.cpp's Llama 3.1 files), frequency i divided
  by factor i;
- longrope (Phi-3 / Phi-3.5 long context; "su" in old configs): frequency i divided by
  short_factor[i] or long_factor[i], cos and sin scaled by the attention factor
  sqrt(1 + ln(factor) / ln(original)) (factor = max_position_embeddings / original unless
  given; 1 when factor <= 1). transformers picks the set per forward call: long when the call's
  longest position reaches past original_max_position_embeddings, else short, and its Phi-3
  `generate` drops the KV cache once to recompute the whole sequence with long factors when it
  crosses that length. A per-position table cannot follow a choice that rewrites earlier
  positions, so the table takes one set for all its rows as vLLM and llama.cpp do: long when
  the table (the model's context) is longer than the original length, else short. Equal to
  transformers for every sequence longer than the original length and, when the context is not,
  for every sequence; a context past it (Phi-3-mini-128k) gives sequences no longer than the
  original length long factors where transformers uses short ones.
`context_length` is how many positions a scaling allows (dynamic and yarn stretch the original
length by their factor, as vLLM does).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from tessellm.errors import UnsupportedModelError

SUPPORTED = ("default", "linear", "llama3", "yarn", "dynamic", "freq_factors", "longrope")


def scaling_type(scaling: dict[str, Any]) -> str:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED:
        raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported "
                                    f"(supported: {', '.join(SUPPORTED)})")
    return kind


def _base_inv_freq(theta: float | torch.Tensor, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if isinstance(theta, torch.Tensor):   # one base per row
        return 1.0 / (theta.unsqueeze(-1) ** exponents)
    return 1.0 / (theta ** exponents)


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low_ff, high_ff = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low_ff, old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, head_dim: int, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])
    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all
                     else _yarn_mscale(factor))
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        """The dimension whose wavelength makes `rotations` turns over the original length."""
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low),
                       0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp       # share of the unscaled frequency, per dimension pair
    inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
                + (1.0 / pos_freqs) * extrapolation)
    return inv_freq, float(attention)


def _dynamic_inv_freq(theta: float, head_dim: int, positions: int,
                      s: dict[str, Any]) -> torch.Tensor:
    """[positions, head_dim / 2]: row p the frequencies of a sequence of max(p + 1, orig)."""
    factor, orig = float(s["factor"]), int(s["original_max_position_embeddings"])
    seq_len = torch.clamp(torch.arange(1, positions + 1), min=orig).float()
    base = theta * ((factor * seq_len / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return _base_inv_freq(base, head_dim)


def longrope_factors(scaling: dict[str, Any], head_dim: int) -> dict[str, list[float]]:
    """short_factor and long_factor of a longrope scaling, checked: head_dim / 2 finite
    positive numbers each, or an UnsupportedModelError naming the field."""
    out = {}
    for key in ("short_factor", "long_factor", "original_max_position_embeddings", "factor"):
        if scaling.get(key) is None:
            raise UnsupportedModelError(f"rope scaling longrope needs {key!r}")
    for key in ("short_factor", "long_factor"):
        values = scaling[key]
        if (not isinstance(values, (list, tuple)) or len(values) != head_dim // 2
                or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                           for v in values)):
            raise UnsupportedModelError(
                f"rope scaling longrope: {key} must be {head_dim // 2} finite positive "
                f"numbers (head_dim / 2), got {values!r}")
        out[key] = [float(v) for v in values]
    return out


def _longrope(theta: float, head_dim: int, positions: int,
              s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """One factor set for the whole table (see the module docstring for why): long when the
    table is longer than the original length."""
    factors = longrope_factors(s, head_dim)
    orig, factor = int(s["original_max_position_embeddings"]), float(s["factor"])
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(factors["long_factor" if positions > orig else "short_factor"],
                       dtype=torch.float32)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * theta ** exponents), float(attention)   # transformers' rounding order


def rope_cos_sin(head_dim: int, theta: float, positions: int,
                 scaling: dict[str, Any]) -> torch.Tensor:
    """[positions, head_dim] float32: cos | sin of each position's angles."""
    kind = scaling_type(scaling)
    t = torch.arange(positions, dtype=torch.float32)
    attention = 1.0
    if kind == "dynamic":
        freqs = t.unsqueeze(-1) * _dynamic_inv_freq(theta, head_dim, positions, scaling)
    else:
        if kind == "yarn":
            inv_freq, attention = _yarn(theta, head_dim, scaling)
        elif kind == "longrope":
            inv_freq, attention = _longrope(theta, head_dim, positions, scaling)
        else:
            inv_freq = _base_inv_freq(theta, head_dim)
            if kind == "linear":
                inv_freq = inv_freq / float(scaling["factor"])
            elif kind == "llama3":
                inv_freq = _llama3(inv_freq, scaling)
            elif kind == "freq_factors":
                factors = torch.tensor(scaling["factors"], dtype=torch.float32)
                if factors.shape != inv_freq.shape:
                    raise UnsupportedModelError(
                        f"rope_freqs holds {factors.numel()} factors, the head's rotary "
                        f"dims need {inv_freq.numel()}")
                inv_freq = inv_freq / factors
        freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos() * attention, freqs.sin() * attention), dim=-1)


def context_length(max_position_embeddings: int, scaling: dict[str, Any]) -> int:
    """Positions the model may use: dynamic and yarn stretch their original length by their
    factor (never below the config's max_position_embeddings)."""
    kind = scaling_type(scaling)
    if kind in ("dynamic", "yarn"):
        original = float(scaling["original_max_position_embeddings"])
        stretched = int(original * float(scaling["factor"]))
        return max(max_position_embeddings, stretched)
    return max_position_embeddings
