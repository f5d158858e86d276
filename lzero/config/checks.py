"""The checks that ZeroConfig's sections share: a whole number, a bool, an unknown name with its closest known one,
and the fields that may be "auto"."""

from __future__ import annotations

import difflib
from typing import Any, Sequence

from lzero.errors import ZeroConfigError

AUTO = "auto"
BY_HIDDEN_SIZE = ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")
"""The fields that may be "auto": sized from the model's hidden size at setup ([Note: sizes from the hidden size]
in auto_sizes.py), as the Hugging Face integration sizes DeepSpeed's keys."""


def whole_number(name: str, value: Any, least: int = 0, unit: str = "", hint: str = "") -> int:
    """``value`` of the option ``name`` as an int: a float that is a whole number becomes one (DeepSpeed configs
    write 5e8); a fraction, a bool, anything else, or a number below ``least`` is refused, naming ``name``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        what = f"a positive whole number{unit}" if least == 1 else f"a whole number{unit} >= {least}"
        raise ZeroConfigError(f"`{name}={value!r}` must be {what}." + (f" HINT: {hint}" if hint else ""))
    return value


def did_you_mean(name: Any, known: Sequence[str], what: str) -> str:
    """The HINT for an unknown ``name``: the closest of ``known`` (its ``what``: "keys", "options"), or all of them."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f"did you mean `{close[0]}`?" if close else f"the {what} are: {', '.join(known)}."


def true_or_false(name: str, value: Any) -> None:
    """Refuse a ``value`` of the option ``name`` that is not a bool (YAML's true/false)."""
    if not isinstance(value, bool):
        raise ZeroConfigError(f"`{name}={value!r}` must be true or false.")


def set_whole(section: Any, name: str, least: int = 0, unit: str = "", hint: str = "", label: str = "") -> None:
    """The field ``name`` of a frozen ``section`` checked by :func:`whole_number` and stored as an int."""
    object.__setattr__(section, name, whole_number(label or name, getattr(section, name), least, unit, hint))


def set_positive(section: Any, name: str) -> None:
    """A count of elements (or of collectives) > 0, with the field's default as the example."""
    default = type(section).__dataclass_fields__[name].default
    set_whole(section, name, 1, " of elements", f"e.g. `{name}={default or 32}`.")
