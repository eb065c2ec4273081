"""The offline API a vLLM user expects: stop strings, n in SamplingParams, RequestOutput.outputs
and LLM.chat (stories260K, float32, CPU)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tessellm import LLM, SamplingParams
from tessellm.errors import InvalidRequestError
from tessellm.llm import CompletionOutput
from tessellm.sampling_params import MAX_STOP_STRINGS

PROMPT = "Once upon a time"
GREEDY = SamplingParams(max_tokens=30, temperature=0)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def llm(stories_dir) -> LLM:
    return LLM(str(stories_dir), device="cpu", dtype="float32", load_progress=False)


@pytest.fixture(scope="module")
def full(llm):
    """Greedy PROMPT without stop strings: it runs to max_tokens."""
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens
    return out


def test_stop_string_trims_the_text_and_stops_the_generation(llm, full):
    stop = " little"
    assert stop in full.text
    out = llm.generate([PROMPT], replace(GREEDY, stop=[stop]))[0]
    assert out.text == full.text[:full.text.index(stop)]
    assert out.finish_reason == "stop" and out.outputs[0].finish_reason == "stop"
    k = len(out.token_ids)
    assert k < GREEDY.max_tokens and out.token_ids == full.token_ids[:k]
    # it stopped at the token that completed the stop string, not later
    assert stop in llm.decode(out.token_ids, out.prompt_token_ids)
    assert stop not in llm.decode(out.token_ids[:-1], out.prompt_token_ids)
    assert not llm.engine.has_unfinished()


def test_first_stop_string_to_appear_wins_and_a_single_string_is_a_list(llm, full):
    first, later = full.text.split()[1], full.text.split()[-1]
    out = llm.generate([PROMPT], replace(GREEDY, stop=[later, first]))[0]
    assert out.text == full.text[:full.text.index(first)]
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b", "a")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []


def test_stop_string_never_seen_keeps_the_whole_text(llm, full):
    out = llm.generate([PROMPT], replace(GREEDY, stop=["@@@", "zebra"]))[0]
    assert out.text == full.text and out.token_ids == full.token_ids
    assert out.finish_reason == "length"


def test_stop_strings_only_apply_to_their_own_prompt(llm, full):
    outs = llm.generate([PROMPT, PROMPT], [replace(GREEDY, stop=[" little"]), GREEDY])
    assert outs[0].finish_reason == "stop" and outs[1].text == full.text


@pytest.mark.parametrize("kwargs, match", [
    ({"stop": [""]}, "non-empty"),
    ({"stop": ["ok", 3]}, "non-empty strings"),
    ({"stop": 5}, "string or a list"),
    ({"n": 0}, "n must be"),
    ({"n": True}, "n must be"),
    ({"n": 1.5}, "n must be"),
])
def test_invalid_stop_and_n_are_refused(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_stop_strings_up_to_the_one_limit_are_taken(llm):
    """MAX_STOP_STRINGS (16) is the limit of SamplingParams, the matcher and the server."""
    many = [f"#{i}#" for i in range(MAX_STOP_STRINGS)]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, stop=many))[0]
    assert out.outputs[0].finish_reason == "length"
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_STRINGS} stop strings"):
        SamplingParams(stop=[*many, "one more"])
    assert not llm.engine.has_unfinished()


def test_outputs_hold_one_completion_output_per_sample(llm, full):
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.prompt == PROMPT and out.prompt_token_ids == llm.encode(PROMPT)
    assert out.outputs == [CompletionOutput(0, full.text, full.token_ids, "length")]
    assert out.samples == []  # n == 1: as before
    by_ids = llm.generate([llm.encode(PROMPT)], GREEDY)[0]
    assert by_ids.prompt is None and by_ids.outputs == out.outputs


def test_n_in_sampling_params_gives_n_outputs_like_the_n_argument(llm):
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    out = llm.generate([PROMPT], replace(p, n=3))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert [o.token_ids for o in out.outputs] == [s.token_ids for s in out.samples]
    assert [o.text for o in out.outputs] == [s.text for s in out.samples]
    assert (out.token_ids, out.text) == (out.outputs[0].token_ids, out.outputs[0].text)
    for i, o in enumerate(out.outputs):  # sample i is the prompt alone with seed + i
        assert o.token_ids == llm.generate([PROMPT], replace(p, seed=5 + i))[0].token_ids
    by_arg = llm.generate([PROMPT], p, n=3)[0]
    assert by_arg.outputs == out.outputs
    assert llm.generate([PROMPT], replace(p, n=3), n=3)[0].outputs == out.outputs


def test_n_per_prompt_and_conflicting_n_is_refused(llm):
    p = SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    outs = llm.generate(["A", "B"], [replace(p, n=2), p])
    assert [len(o.outputs) for o in outs] == [2, 1]
    with pytest.raises(InvalidRequestError, match="n=3 but SamplingParams.n=2"):
        llm.generate([PROMPT], replace(p, n=2), n=3)
    with pytest.raises(InvalidRequestError, match="n must be"):
        llm.generate([PROMPT], p, n=0)
    assert not llm.engine.has_unfinished()


def test_stop_strings_apply_to_every_sample(llm):
    p = SamplingParams(max_tokens=30, temperature=0.8, seed=3, n=3)
    free = llm.generate([PROMPT], p)[0]
    stop = "."
    outs = llm.generate([PROMPT], replace(p, stop=[stop]))[0]
    assert any(o.finish_reason == "stop" for o in outs.outputs)
    assert len({tuple(o.token_ids) for o in free.outputs}) > 1  # the samples differ
    for f, o in zip(free.outputs, outs.outputs):
        if stop in f.text:
            assert o.text == f.text[:f.text.index(stop)] and o.finish_reason == "stop"
            assert o.token_ids == f.token_ids[:len(o.token_ids)]
        else:
            assert (o.text, o.token_ids) == (f.text, f.token_ids)


# ---- chat ------------------------------------------------------------------------------

def test_chat_renders_the_template_once_with_one_bos(llm):
    messages = [{"role": "user", "content": "Tell me a story."}]
    out = llm.chat(messages, GREEDY, chat_template=TEMPLATE)
    assert len(out) == 1
    rendered = "<s>user: Tell me a story.\nassistant:"
    assert out[0].prompt == rendered
    bos = llm.tokenizer.bos_token_id
    ids = out[0].prompt_token_ids
    assert ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == bos and ids[1] != bos  # the template's BOS, none added on top
    same = llm.generate([ids], GREEDY)[0]
    assert out[0].token_ids == same.token_ids and out[0].text == same.text


def test_chat_over_several_conversations_and_without_generation_prompt(llm):
    convs = [[{"role": "user", "content": "Hi"}],
             [{"role": "system", "content": "Be kind."},
              {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                           {"type": "text", "text": "there"}]}]]
    outs = llm.chat(convs, SamplingParams(max_tokens=4, temperature=0), chat_template=TEMPLATE)
    assert [o.prompt for o in outs] == ["<s>user: Hi\nassistant:",
                                       "<s>system: Be kind.\nuser: Hello\nthere\nassistant:"]
    bare = llm.chat(convs[0], SamplingParams(max_tokens=4, temperature=0),
                    chat_template=TEMPLATE, add_generation_prompt=False)
    assert bare[0].prompt == "<s>user: Hi\n"


def test_chat_with_stop_strings_and_n(llm):
    p = SamplingParams(max_tokens=20, temperature=0.8, seed=2, n=2, stop=["."])
    out = llm.chat([{"role": "user", "content": "Hi"}], p, chat_template=TEMPLATE)[0]
    assert len(out.outputs) == 2
    assert all("." not in o.text for o in out.outputs)


def test_chat_without_a_template_is_refused(llm):
    assert not getattr(llm.tokenizer, "chat_template", None)  # stories260K has none
    with pytest.raises(InvalidRequestError, match="no chat template; pass chat_template="):
        llm.chat([{"role": "user", "content": "Hi"}])
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ("hello", "conversation"),
    ([{"content": "no role"}], "string 'role'"),
    ([{"role": "user", "content": 5}], "content must be"),
])
def test_bad_messages_are_refused(llm, messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.chat(messages, chat_template=TEMPLATE)


def test_a_template_that_raises_is_an_invalid_request(llm):
    with pytest.raises(InvalidRequestError, match="chat template failed.*nope"):
        llm.chat([{"role": "user", "content": "Hi"}],
                 chat_template="{{ raise_exception('nope') }}")
