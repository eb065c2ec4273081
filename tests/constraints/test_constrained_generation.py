"""Constrained decoding end to end (offline LLM on a random-weight Qwen3 with the real 152k
vocabulary, at temperature 1, where only the constraint keeps the output in shape): outputs of
hypothesis-generated JSON schemas parse and validate (jsonschema is the judge), regexes
fullmatch, choices are one of the choices; greedy, sampled, n > 1, preemption on a tiny KV
pool, swap, prefix-cache hits, and unconstrained requests mixed into the same batches keep
their tokens exactly."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessellm import LLM, SamplingParams
from tessellm.constraints.structured_outputs import StructuredOutputs

PROMPTS = ["Write JSON:", "The answer is", "Hello there", "{"]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def llm(qwen3_random_dir):
    return LLM(str(qwen3_random_dir), dtype="float32", kernel_selection="first",
               load_progress=False, max_num_seqs=8, max_num_batched_tokens=256)


# ---- schemas: every construct bounded, so a random model finishes within MAX_TOKENS ------

NAMES = st.text("abcdefghij_", min_size=1, max_size=6)
SMALL_INT = st.integers(-1000, 1000)


@st.composite
def _int_range(draw, kind: str) -> dict:
    lo = draw(SMALL_INT)
    return {"type": kind, "minimum": lo, "maximum": lo + draw(st.integers(0, 500))}


@st.composite
def _string(draw) -> dict:
    hi = draw(st.integers(0, 6))
    out = {"type": "string", "maxLength": hi, "minLength": draw(st.integers(0, hi))}
    if draw(st.booleans()):
        out["pattern"] = "^[a-z0-9 ]*$"
    return out


LEAVES = st.one_of(
    _string(), _int_range("integer"), _int_range("number"),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.lists(st.one_of(st.text("xyz", max_size=3), SMALL_INT, st.booleans()), min_size=1,
             max_size=4, unique_by=lambda v: (type(v), v)).map(lambda vs: {"enum": vs}),
)


@st.composite
def _object(draw, children) -> dict:
    names = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
    props = {n: draw(children) for n in names}
    required = draw(st.lists(st.sampled_from(names), unique=True))
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


@st.composite
def _array(draw, children) -> dict:
    hi = draw(st.integers(0, 3))
    return {"type": "array", "items": draw(children), "maxItems": hi,
            "minItems": draw(st.integers(0, hi))}


SCHEMAS = st.recursive(LEAVES, lambda children: _object(children) | _array(children),
                       max_leaves=6).map(
    lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"v": s},
                                                   "required": ["v"],
                                                   "additionalProperties": False})


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, compact=st.booleans())
def test_json_schema_outputs_parse_and_validate(llm, schema, compact):
    spec = StructuredOutputs(json=schema, disable_any_whitespace=compact)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=2,
                            structured_outputs=spec)
    for out in llm.generate(PROMPTS[:2], params):
        for choice in out.outputs:
            assert choice.finish_reason == "stop", (schema, choice.text)
            jsonschema.validate(json.loads(choice.text), schema)
            if compact:
                assert "\n" not in choice.text and ": " not in choice.text


REGEXES = ["[0-9]{3}-[0-9]{4}", "(yes|no|maybe)", "[a-c]+x?", r"\w{2,5}@example\.(com|org)",
           "(ab|cd){1,3}e", "[A-Z][a-z]{0,8}( [A-Z][a-z]{0,8}){0,2}"]


@pytest.mark.parametrize("regex", REGEXES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_outputs_fullmatch(llm, regex, temperature):
    params = SamplingParams(max_tokens=64, temperature=temperature, seed=3, n=3,
                            structured_outputs=StructuredOutputs(regex=regex))
    for out in llm.generate(PROMPTS, params):
        for choice in out.outputs:
            assert re.fullmatch(regex, choice.text), (regex, choice.text)
            assert choice.finish_reason == "stop"


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(choices=st.lists(st.text("abcdefgh ,.!?xyz", min_size=1, max_size=12), min_size=1,
                        max_size=6, unique=True))
def test_choice_outputs_are_one_of_the_choices(llm, choices):
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=5, n=3,
                            structured_outputs=StructuredOutputs(choice=choices))
    for choice in llm.generate([PROMPTS[0]], params)[0].outputs:
        assert choice.text in choices and choice.finish_reason == "stop"


GBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "zz"'
LARK = 'start: item ("+" item)*\nitem: /[0-9]{1,2}/'


@pytest.mark.parametrize("grammar,pattern", [(GBNF, r"\(([a-c]|zz)(,([a-c]|zz))*\)"),
                                             (LARK, r"[0-9]{1,2}(\+[0-9]{1,2})*")])
def test_gbnf_and_lark_grammars(llm, grammar, pattern):
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=11, n=4,
                            structured_outputs=StructuredOutputs(grammar=grammar))
    for choice in llm.generate([PROMPTS[1]], params)[0].outputs:
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            assert re.fullmatch(pattern, choice.text), choice.text


OBJECT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


def _mixed(llm: LLM, constrained_temperature: float) -> tuple[list, list]:
    """Unconstrained requests alone, then the same interleaved with constrained ones."""
    free = SamplingParams(max_tokens=24, temperature=0.8, seed=9, ignore_eos=True)
    alone = llm.generate(PROMPTS, free)
    bound = SamplingParams(max_tokens=MAX_TOKENS, temperature=constrained_temperature, seed=2,
                           structured_outputs=StructuredOutputs(json=OBJECT))
    mixed = llm.generate([p for p in PROMPTS for _ in (0, 1)],
                         [q for _ in PROMPTS for q in (free, bound)])
    return alone, mixed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_unconstrained_rows_in_the_same_batch_keep_their_tokens(llm, temperature):
    alone, mixed = _mixed(llm, temperature)
    assert [o.token_ids for o in alone] == [o.token_ids for o in mixed[0::2]]
    for o in mixed[1::2]:
        jsonschema.validate(json.loads(o.text), OBJECT)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_constraint(qwen3_random_dir, mode):
    """A KV pool of 12 blocks for 6 requests of up to ~10 blocks each: requests are preempted
    (recomputed, or swapped to the host) mid-output, and every output still validates and
    equals the run with room enough."""
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=4,
                            structured_outputs=StructuredOutputs(json=OBJECT))
    prompts = [f"Record {i}: " + "x " * 20 for i in range(6)]
    roomy = LLM(str(qwen3_random_dir), dtype="float32", kernel_selection="first",
                load_progress=False, block_size=16)
    tight = LLM(str(qwen3_random_dir), dtype="float32", kernel_selection="first",
                load_progress=False, block_size=16, num_kv_blocks=12, preemption_mode=mode,
                **({"num_host_kv_blocks": 64} if mode == "swap" else {}))
    want = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert tight.engine.stats.num_preemptions > 0
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        jsonschema.validate(json.loads(b.text), OBJECT)


def test_prefix_cache_hits_and_forks(llm):
    shared = "The quick brown fox jumps over the lazy dog. " * 6
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=8, n=3,
                            structured_outputs=StructuredOutputs(json=OBJECT))
    first = llm.generate([shared + "A"], params)[0]
    hits = llm.engine.scheduler.prefix_cache_stats.hits
    second = llm.generate([shared + "B"], params)[0]
    assert llm.engine.scheduler.prefix_cache_stats.hits > hits
    for out in (first, second):
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1   # the forks differ
        for c in out.outputs:
            jsonschema.validate(json.loads(c.text), OBJECT)


def test_a_constraint_that_does_not_fit_max_tokens_ends_with_length(llm):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40,
                                                     "maxLength": 40}},
              "required": ["s"], "additionalProperties": False}
    out = llm.generate([PROMPTS[0]], SamplingParams(
        max_tokens=5, temperature=1.0, seed=1,
        structured_outputs=StructuredOutputs(json=schema)))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(out.text)
