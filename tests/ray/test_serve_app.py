"""`tessellm.ray.serve_app`: tessellm as a Ray Serve application (one Serve replica on a
local Ray cluster of 2 CPUs for the module), and its queue-depth autoscaling policy."""
from __future__ import annotations

import json
import urllib.request
from types import SimpleNamespace

import pytest
from tessellm.errors import ConfigError

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tessellm[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed "
                            "(pip install 'tessellm[ray]')")

from tessellm.ray.serve_app import QUEUE_DEPTH_METRIC, queue_depth_policy, serve_app  # noqa: E402


def _ctx(depths: dict, target: float = 4, low: int = 1, high: int = 4) -> SimpleNamespace:
    return SimpleNamespace(aggregated_metrics={QUEUE_DEPTH_METRIC: depths} if depths else {},
                           config=SimpleNamespace(target_ongoing_requests=target),
                           target_num_replicas=2, capacity_adjusted_min_replicas=low,
                           capacity_adjusted_max_replicas=high, policy_state={})


def test_queue_depth_policy_sizes_by_the_engines_queues():
    assert queue_depth_policy(_ctx({"a": 6, "b": 5}))[0] == 3        # ceil(11 / 4)
    assert queue_depth_policy(_ctx({"a": 0, "b": 0}))[0] == 1        # the floor
    assert queue_depth_policy(_ctx({"a": 40}))[0] == 4               # the ceiling
    assert queue_depth_policy(_ctx({}))[0] == 2                      # no metric yet: unchanged


def test_serve_app_refuses_options_it_owns():
    with pytest.raises(ConfigError, match="chooses host and port"):
        serve_app("m", port=9000)
    with pytest.raises(ConfigError, match="not both"):
        serve_app("m", num_replicas=2, autoscaling_config={"max_replicas": 2})
    with pytest.raises(ConfigError, match="unknown key"):
        serve_app("m", no_such_option=1)


def test_serve_app_answers_like_tessellm_serve(stories_dir):
    from tessellm import LLM, SamplingParams
    offline = LLM(str(stories_dir), dtype="float32", kernel_selection="first",
                  load_progress=False)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        serve.run(serve_app(str(stories_dir), num_threads=1, dtype="float32",
                            kernel_selection="first", api_key="k"), route_prefix="/")
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8,
                           "temperature": 0}).encode()
        req = urllib.request.Request("http://127.0.0.1:8000/v1/completions", data=body,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": "Bearer k"})
        out = json.loads(urllib.request.urlopen(req, timeout=60).read())
        expected = offline.generate(["Once upon a time"],
                                    SamplingParams(max_tokens=8, temperature=0))[0]
        assert out["choices"][0]["text"] == expected.outputs[0].text
        req = urllib.request.Request("http://127.0.0.1:8000/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:   # the server's own API key check
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 401
    finally:
        serve.shutdown()
        ray.shutdown()
