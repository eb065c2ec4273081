"""The offline API: greedy text, sampled variants, token ids in, a chat turn.

    python docs/examples/offline/generate.py [MODEL]   # default ../shared/models/stories260K-hf
"""
import sys

from tessellm import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "../shared/models/stories260K-hf"

# kernel_selection="first": start at once; the default ("profile") first ranks every kernel
# for every token bucket (a minute on a small CPU; the decisions are cached on disk)
with LLM(model, dtype="float32", kernel_selection="first", load_progress=False) as llm:
    # greedy: the same text on every run and every device
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=24, temperature=0))[0]
    print(out.text, out.finish_reason)

    # two seeded samples of one prompt (they share the prompt's KV blocks), cut at a newline
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1, n=2,
                            stop=["\n"])
    for sample in llm.generate(["The little dog"], params)[0].outputs:
        print(sample.index, repr(sample.text), len(sample.token_ids), sample.finish_reason)

    # prompts may be token ids; one params per prompt
    ids = llm.encode("Lily saw a cat")
    outs = llm.generate([ids, "Tom had a ball"],
                        [SamplingParams(max_tokens=8, temperature=0),
                         SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)])
    print([o.token_ids for o in outs])

    # a chat turn, with a template of our own (stories260K has none)
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "assistant:")
    reply = llm.chat([{"role": "user", "content": "Tell me a story."}],
                     SamplingParams(max_tokens=16, temperature=0), chat_template=template)[0]
    print(repr(reply.prompt), reply.text)
