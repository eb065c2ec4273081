"""Typed errors raised by tessellm. Validation raises these, never `assert`."""


class TessellmError(Exception):
    """Base class of every error tessellm raises on purpose."""


class ConfigError(TessellmError, ValueError):
    """A configuration value is invalid or names something that does not exist."""


class UnsupportedModelError(TessellmError, ValueError):
    """The model's architecture or one of its features is not supported."""


class ModelLoadError(TessellmError, OSError):
    """A model directory is missing a file, or a file is malformed."""


class PluginError(TessellmError, RuntimeError):
    """A plugin failed to load, probe, or declared an incompatible API version."""


class DeviceUnavailableError(TessellmError, RuntimeError):
    """The requested device exists but cannot be used here (the message says why)."""


class KernelError(TessellmError, RuntimeError):
    """No kernel can run an op, or a requested kernel does not exist or is not supported."""


class InvalidRequestError(TessellmError, ValueError):
    """A request (prompt or sampling parameters) is invalid; `param` names the offending
    field when one is to blame (the server reports it in its error object)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
