"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's shapes), routed only with
`--allow-runtime-lora` (else 404, as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING); behind
the API key like every /v1 route.

load: `{"lora_name", "lora_path"}` -> 200 once the adapter's directory and config are read
(ServedAdapters.add: 400 for an unusable one, 409 for a name already served); the engine core
reads its weights when a request first names it. unload: `{"lora_name"}` -> 200, and the
core drops the adapter (running requests finish with it); 404 for a name not loaded.
"""
from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from tessellm.server.requests import STATE_KEY, read_body


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None   # vLLM's field; the name decides here


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_body(request, LoadLoRARequest)
    adapter = state.adapters.add(body.lora_name, body.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{adapter.name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_body(request, UnloadLoRARequest)
    adapter = state.adapters.remove(body.lora_name)
    state.engine.unload_adapter(adapter.int_id)
    return web.Response(text=f"Success: LoRA adapter '{adapter.name}' removed successfully.")


def add_lora_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
