"""What the server answers about itself, whatever the transport: its health (GET /health,
gRPC Health), whether it takes new requests (/v1/* and gRPC Generate while draining: 503),
and the models it serves (GET /v1/models, gRPC Models)."""
from __future__ import annotations

from typing import Any

from tessellm.server.errors import APIError
from tessellm.server.state import ServerState


def health_error(state: ServerState) -> APIError | None:
    """None while the engine core runs and reports in time; a 503 once it died, while it is
    unresponsive (CoreLiveness), or while the server is draining."""
    engine = state.engine
    if state.draining:
        return APIError(503, "the server is shutting down", type="service_unavailable",
                        code="shutting_down")
    if not engine.is_alive:
        return APIError(503, f"the engine core is not running: {engine.fatal_error or 'exited'}",
                        type="service_unavailable", code="engine_unavailable")
    reason = engine.unresponsive_reason
    if reason is not None:
        return APIError(503, f"the engine core is unresponsive: {reason}",
                        type="service_unavailable", code="engine_unresponsive")
    return None


def draining_error(state: ServerState) -> APIError | None:
    """The 503 a new generation request gets while the server drains (SIGTERM), else None."""
    if state.draining:
        return APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
    return None


def model_cards(state: ServerState) -> list[dict[str, Any]]:
    """The entries of /v1/models' `data`: the base model, then its LoRA adapters."""
    return [{"id": state.model_name, "object": "model", "created": state.created,
             "owned_by": "tessellm", "max_model_len": state.max_model_len},
            *state.adapters.cards(state.model_name, state.created, state.max_model_len)]
