"""lzero's root error, :class:`ZeroError`, and the error types that several modules raise: the configuration's (every
section of lzero/config/ checks its own fields) and the engine's (the modules that set a model up for sharding).
Every error class of lzero derives from :class:`ZeroError` and keeps its builtin base (a ``ValueError``, a
``RuntimeError``...), so ``except lzero.ZeroError`` catches any of lzero's refusals and an ``except ValueError``
written before still catches the ones it caught."""


class ZeroError(Exception):
    """Any error lzero raises on purpose; the message says what was wrong and ends with a HINT on how to fix it."""


class ZeroEngineError(ZeroError, RuntimeError):
    """A model or optimizer setup that the engine cannot shard; the message says how to fix it."""


class ZeroConfigError(ZeroError, ValueError):
    """A configuration value that lzero cannot run with; the message names the value and the fix."""
