"""Multi-LoRA serving: PEFT adapters over one base model, batched together.

One concept per module: `request` (LoRARequest, what a caller names), `adapter` (a PEFT
directory read and checked against the base model), `sites` (where the graph adds a low-rank
term: the `add_lora_sites` pass and the site table), `host_cache` (loaded adapters, LRU over
max_cpu_loras), `slots` (the device slot table of max_loras entries), `manager` (the engine
core's part: admission, slot assignment per step, per-adapter counters).
"""
