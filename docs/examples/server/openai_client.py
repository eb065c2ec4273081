"""The server through the official `openai` client: models, chat (whole and streamed),
completions with logprobs, tessellm's extensions, /health and /metrics.

    tessellm serve --model ../shared/models/stories260K-hf --chat-template TEMPLATE &
    python docs/examples/server/openai_client.py [BASE_URL]   # default http://127.0.0.1:8000
"""
import sys
import urllib.request

from openai import OpenAI

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
client = OpenAI(base_url=base + "/v1", api_key="unused")   # any key unless --api-key is set

model = client.models.list().data[0].id
print("model:", model)

# a chat turn, greedy
chat = client.chat.completions.create(
    model=model, temperature=0, max_tokens=16,
    messages=[{"role": "user", "content": "Tell me a story."}])
print("chat:", chat.choices[0].message.content, chat.choices[0].finish_reason, chat.usage)

# the same turn streamed: the deltas concatenate to the whole answer
stream = client.chat.completions.create(
    model=model, temperature=0, max_tokens=16, stream=True,
    stream_options={"include_usage": True},
    messages=[{"role": "user", "content": "Tell me a story."}])
text = ""
for chunk in stream:
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
    elif chunk.usage:                     # the last chunk: usage only
        print("streamed usage:", chunk.usage)
print("streamed:", text)
assert text == chat.choices[0].message.content

# a completion: two seeded samples, a stop string, the top-2 logprobs of each token, and
# tessellm's extensions (top_k, repetition_penalty, priority) through extra_body
done = client.completions.create(
    model=model, prompt="Once upon a time", max_tokens=12, temperature=0.8, seed=7, n=2,
    stop=["."], logprobs=2,
    extra_body={"top_k": 40, "repetition_penalty": 1.1, "priority": 0})
for choice in done.choices:
    print("completion", choice.index, repr(choice.text), choice.finish_reason,
          choice.logprobs.tokens[:3], choice.logprobs.top_logprobs[0])

# plain HTTP: liveness and Prometheus metrics
with urllib.request.urlopen(base + "/health") as r:
    print("health:", r.status, r.read().decode())
with urllib.request.urlopen(base + "/metrics") as r:
    lines = [l for l in r.read().decode().splitlines() if l.startswith("tessellm:generation_tokens")]
    print("metrics:", lines)
