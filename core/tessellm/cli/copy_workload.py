"""W6 (../shared/bench/WORKLOAD.md): copy-heavy chat prompts for one-stream speculation.

Each prompt is a chat turn holding a ~400-token file (code, prose, a config) and the
instruction to give it back with one small edit, rendered with the model's chat template;
the reply reproduces most of the file, which is what prompt lookup predicts. The files are
written for this bench (no data is downloaded).
"""
from __future__ import annotations

from typing import Any

CODE = '''\
import time
from collections import OrderedDict


class ExpiringCache:
    """A least-recently-used cache whose entries also expire after a fixed time."""

    def __init__(self, capacity, ttl_seconds):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.ttl_seconds = ttl_seconds
        self.entries = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key, default=None):
        item = self.entries.get(key)
        if item is None:
            self.misses += 1
            return default
        value, stored_at = item
        if time.monotonic() - stored_at > self.ttl_seconds:
            del self.entries[key]
            self.misses += 1
            return default
        self.entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key, value):
        self.entries[key] = (value, time.monotonic())
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def remove_expired(self):
        now = time.monotonic()
        expired = [k for k, (_, t) in self.entries.items() if now - t > self.ttl_seconds]
        for key in expired:
            del self.entries[key]
        return len(expired)

    def hit_rate(self):
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
'''

PROSE = '''\
The harbour town of Wellmere sits at the end of a narrow road that follows the river down
from the hills. In the spring the fishing boats are painted blue and white, and the market
square fills with stalls that sell bread, cheese, rope, lanterns and smoked fish. The old
lighthouse on the northern cliff has not been used for forty years, but the town still
lights a lamp in its window on the first night of every summer, to remember the sailors who
did not come home.

Most families in Wellmere have lived there for generations. The children learn to swim in
the cold water of the bay before they learn to read, and every boy and girl can tie a dozen
knots by the age of ten. The school has one teacher, Mrs. Albury, who also runs the library
on Saturday mornings and keeps bees in the garden behind the chapel.

Visitors come in August, when the weather is calm and the evenings are long. They walk along
the cliffs, eat oysters at the inn by the harbour wall, and buy small wooden boats carved by
the old fisherman who sits on the steps of the customs house. In September they leave again,
the inn closes its upper rooms, and the town returns to its own slow rhythm of tides, nets,
weather and bread.
'''

CONFIG = '''\
{
  "service": "inventory-api",
  "version": "2.4.1",
  "listen": {"host": "0.0.0.0", "port": 8080, "read_timeout_s": 30, "write_timeout_s": 30},
  "database": {
    "driver": "postgres",
    "host": "db.internal",
    "port": 5432,
    "name": "inventory",
    "user": "inventory_service",
    "pool": {"min_connections": 2, "max_connections": 20, "idle_timeout_s": 300}
  },
  "cache": {"backend": "redis", "host": "cache.internal", "port": 6379, "ttl_s": 120},
  "logging": {"level": "info", "format": "json", "include_request_id": true},
  "features": {
    "bulk_import": true,
    "price_history": false,
    "low_stock_alerts": true,
    "alert_threshold": 5
  },
  "warehouses": [
    {"id": "north", "city": "Leeds", "capacity": 12000, "open": true},
    {"id": "south", "city": "Bristol", "capacity": 9000, "open": true},
    {"id": "east", "city": "Norwich", "capacity": 4000, "open": false}
  ]
}
'''

# (file, what it is, the edit asked for)
TASKS = [
    (CODE, "Python file", "rename the method `hit_rate` to `hit_ratio`"),
    (PROSE, "text", "change the teacher's name from Mrs. Albury to Mrs. Penrose"),
    (CONFIG, "JSON config", "change the port of the service from 8080 to 9090"),
    (CODE, "Python file", "make `remove_expired` return the list of expired keys"),
    (PROSE, "text", "replace the word August with July"),
    (CONFIG, "JSON config", "set `price_history` to true"),
]


def copy_messages(index: int) -> list[dict[str, str]]:
    """Chat turn `index` (cycling through TASKS)."""
    text, kind, edit = TASKS[index % len(TASKS)]
    return [{"role": "user", "content": f"Here is a {kind}:\n\n{text}\nReproduce the whole "
             f"{kind} exactly, with one change: {edit}. Output only the {kind}."}]


def copy_prompt_ids(llm: Any, index: int) -> list[int]:
    """Prompt `index` of W6 as token ids, through the model's chat template."""
    from tessellm.engine.chat_template import chat_template_of, encode_chat
    template = chat_template_of(llm.tokenizer, None)
    return encode_chat(llm.tokenizer, copy_messages(index), template,
                       add_generation_prompt=True)[1]
