"""One root for lzero's errors: every exception class lzero defines derives from ``lzero.ZeroError`` (and keeps its
builtin base), so a user catches any of lzero's refusals in one clause."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import lzero


def lzero_exception_classes() -> list[type]:
    """Every exception class defined in lzero, found after importing every module of the package."""
    for info in pkgutil.walk_packages(lzero.__path__, "lzero."):
        importlib.import_module(info.name)
    found, todo = [], [BaseException]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.split(".")[0] == "lzero" and cls not in found:
            found.append(cls)
    return found


def test_every_lzero_error_derives_from_zero_error() -> None:
    classes = lzero_exception_classes()
    assert len(classes) >= 15, [c.__qualname__ for c in classes]  # the walk reached the package
    outside = [f"{c.__module__}.{c.__qualname__}" for c in classes
               if issubclass(c, Exception) and not issubclass(c, lzero.ZeroError)]
    assert outside == [], f"lzero errors not derived from lzero.ZeroError: {outside}"
    # a signal, not an error: it carries a pipeline stage's output out of the user's step, past any `except Exception`
    signals = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, Exception)]
    assert signals == ["lzero.engine.pipeline.StageOutput"]


def test_a_config_error_is_caught_as_zero_error_and_as_its_builtin_base() -> None:
    caught = None
    try:
        lzero.ZeroConfig(stage=7)
    except lzero.ZeroError as err:  # one clause for every lzero error
        caught = err
    assert isinstance(caught, lzero.ZeroConfigError), caught
    assert isinstance(caught, ValueError), type(caught).__mro__  # an `except ValueError` written before still holds
    assert "stage" in str(caught), str(caught)
