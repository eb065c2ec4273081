"""Multi-LoRA serving: PEFT adapters over one base model, batched together.

One concept per module: `request` (LoRARequest, what a caller names), `adapter_config` (a
PEFT directory and its adapter_config.json, read without torch), `adapter` (the weights, read
and checked against the base model), `sites` (where the graph adds a low-rank term: the
`add_lora_sites` pass and the site table), `slots` (the device slot table of max_loras
entries), `manager` (the engine core's part: the host LRU of loaded adapters, slot assignment
per step, per-adapter counters).
"""
