"""The generated reference pages (configuration, request fields, metrics) are current, and the
generator refuses a field without a description and a note for a field that does not exist."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from docs_paths import DOCS


@pytest.fixture()
def gen(on_sys_path):
    on_sys_path(DOCS)
    import reference_gen
    return reference_gen


def test_committed_pages_equal_a_fresh_generation(gen) -> None:
    for path, text in gen.pages().items():
        committed = (DOCS / path).read_text(encoding="utf-8")
        assert committed == text, (f"docs/{path} is stale: run "
                                   "`.venv/bin/python docs/reference_gen.py`")


def test_every_option_and_metric_is_on_its_page(gen) -> None:
    from tessellm.config import EngineConfig
    from tessellm.server.protocol import ChatCompletionRequest, CompletionRequest
    from tessellm.server.server_config import ServerConfig
    pages = gen.pages()
    config = pages["reference/configuration.md"]
    for name in [*EngineConfig.model_fields, *ServerConfig.model_fields]:
        assert f"| `{name}` |" in config
    requests = pages["reference/requests.md"]
    for name in [*ChatCompletionRequest.model_fields, *CompletionRequest.model_fields]:
        assert f"| `{name}` |" in requests
    metrics = pages["reference/metrics.md"]
    for name in ("tessellm:num_requests_running", "tessellm:kv_cache_usage_perc",
                 "tessellm:time_to_first_token_seconds", "tessellm:request_finished_total"):
        assert f"| `{name}` |" in metrics
    assert "`stage`: " in metrics and "detokenize" in metrics
    assert "`finished_reason`: stop, length, abort, error" in metrics


def test_a_row_carries_type_default_bounds_and_meaning(gen) -> None:
    class Options(BaseModel):
        size: int = Field(4, ge=1, le=8, description="how many")
        mode: str | None = None

    table = gen.field_table(Options, {"mode": "which mode"})
    assert "| `size` | `int` | `4` | >= 1, <= 8 | how many |" in table
    assert "| `mode` | `str \\| None` | `None` |  | which mode |" in table


def test_an_undocumented_field_or_a_stale_note_is_an_error(gen) -> None:
    class Options(BaseModel):
        size: int = 4

    with pytest.raises(gen.MissingDescription, match="Options.size has no description"):
        gen.field_table(Options, {})
    with pytest.raises(gen.MissingDescription, match="'gone'"):
        gen.field_table(Options, {"size": "how many", "gone": "a removed field"})


def test_metrics_are_read_from_what_the_server_renders(gen) -> None:
    text = ("# HELP tessellm:x_total Things\n# TYPE tessellm:x_total counter\n"
            'tessellm:x_total{kind="a b"} 1.0\ntessellm:x_total{kind="c"} 2.0\n')
    [family] = gen.exposed_metrics(text)
    assert family == {"name": "tessellm:x_total", "type": "counter", "help": "Things",
                      "samples": ["tessellm:x_total"], "labels": {"kind": ["a b", "c"]}}
