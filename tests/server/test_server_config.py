"""ServerConfig and the `serve` YAML file: key split, precedence, errors naming the key."""
from __future__ import annotations

import pytest
from tessellm.cli.main import main
from tessellm.errors import ConfigError
from tessellm.server.server_config import ServerConfig, build_configs, load_configs


def test_the_yaml_file_holds_engine_and_server_keys(tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("model: /models/x\nmax_num_seqs: 8\nport: 9001\nmax_queue: 3\n"
                 "kernel_selection: first\n")
    engine, server = load_configs(f, environ={})
    assert (engine.model, engine.max_num_seqs, engine.kernel_selection) == ("/models/x", 8,
                                                                           "first")
    assert (server.port, server.max_queue, server.host) == (9001, 3, "127.0.0.1")


def test_cli_flags_override_the_file_and_none_means_unset(tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("port: 9001\ndevice: cpu\nmax_n: 4\n")
    engine, server = load_configs(f, {"port": 9002, "device": None, "max_n": None}, environ={})
    assert (server.port, server.max_n, engine.device) == (9002, 4, "cpu")


@pytest.mark.parametrize("text,needle", [
    ("prot: 80\n", "'prot'"),
    ("max_queue: many\n", "max_queue"),
    ("max_num_seqs: 0\n", "max_num_seqs"),
    ("- a\n- b\n", "mapping"),
    ("port: [\n", "YAML"),
])
def test_bad_files_are_errors_that_name_the_problem(tmp_path, text, needle):
    f = tmp_path / "serve.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_configs(f, environ={})


def test_the_api_key_comes_from_the_environment_unless_given_and_is_not_printed():
    _, server = build_configs({}, {}, environ={"TESSELLM_API_KEY": "from-env"})
    assert server.api_key.get_secret_value() == "from-env"
    _, server = build_configs({"api_key": "from-file"}, {}, environ={"TESSELLM_API_KEY": "e"})
    assert server.api_key.get_secret_value() == "from-file"
    _, server = build_configs({"api_key": "from-file"}, {"api_key": "from-cli"}, environ={})
    assert server.api_key.get_secret_value() == "from-cli"
    assert "from-cli" not in repr(server) and "from-cli" not in str(server.model_dump())
    assert build_configs({}, {}, environ={})[1].api_key is None
    with pytest.raises(ConfigError, match="api_key"):
        build_configs({"api_key": ""}, {}, environ={})


def test_defaults_are_safe():
    c = ServerConfig()
    assert c.host == "127.0.0.1" and c.api_key is None and c.max_body_bytes == 1 << 20


def test_serve_command_builds_the_configs_from_file_and_flags(tmp_path, monkeypatch):
    seen = {}

    def fake_run_server(engine, server):
        seen["engine"], seen["server"] = engine, server
        return 0

    monkeypatch.setattr("tessellm.server.serve.run_server", fake_run_server)
    monkeypatch.delenv("TESSELLM_API_KEY", raising=False)
    f = tmp_path / "serve.yaml"
    f.write_text("device: cpu\ndtype: float32\nport: 7000\nmax_queue: 5\n")
    assert main(["serve", "--config", str(f), "--port", "7001", "--api-key", "k",
                 "--max-num-seqs", "3", "--drain-timeout", "2.5"]) == 0
    engine, server = seen["engine"], seen["server"]
    assert (engine.device, engine.dtype, engine.max_num_seqs, engine.model) == (
        "cpu", "float32", 3, None)
    assert (server.port, server.max_queue, server.drain_timeout_s) == (7001, 5, 2.5)
    assert server.api_key.get_secret_value() == "k"
    f.write_text("bogus_key: 1\n")
    assert main(["serve", "--config", str(f)]) == 2  # a clear error, not a traceback
