"""The engine: model runner, engine loop, sampling and output processing."""
