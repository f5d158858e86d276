"""The engine's error type, shared by the modules that set a model up for sharding."""


class ZeroEngineError(RuntimeError):
    """A model or optimizer setup that the engine cannot shard; the message says how to fix it."""
