"""`FILE.py:FUNCTION`: a user's own train step for `hlomap run`.

The function takes no arguments and returns `(train_step, example_args)`: the step as
`parallelize` takes it and a tuple of real arguments (params, opt_state, batch, ...).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from hlomap.run.errors import RunError

__all__ = ["load_step_file"]


def load_step_file(spec: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(train_step, example_args) from `FILE.py:FUNCTION` (module docstring)."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text.endswith(".py") or not name.isidentifier():
        raise RunError(f"--source {spec}: expected zoo:NAME or FILE.py:FUNCTION")
    path = Path(path_text)
    if not path.is_file():
        raise RunError(f"--source {spec}: {path} is not a file")
    module_name = f"hlomap_user_step_{abs(hash(str(path.resolve())))}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise RunError(f"--source {spec}: cannot import {path}")
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    # As `python FILE.py` would: the file's folder first on the path, so its own modules import
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        loader.loader.exec_module(module)
    except Exception as err:  # the user's file: report its error in one line
        raise RunError(f"--source {spec}: importing {path} failed: {type(err).__name__}: {err}") from None
    function = getattr(module, name, None)
    if function is None:
        raise RunError(f"--source {spec}: {path} has no function {name!r}")
    if not callable(function):
        raise RunError(f"--source {spec}: {path}'s {name!r} is not a function (it is {type(function).__name__})")
    try:
        result = function()
    except Exception as err:
        raise RunError(f"--source {spec}: {name}() failed: {type(err).__name__}: {err}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and callable(result[0])
            and isinstance(result[1], (tuple, list))):
        got = (f"a tuple of {', '.join(type(x).__name__ for x in result)}" if isinstance(result, tuple)
               else type(result).__name__)
        raise RunError(f"--source {spec}: {name}() must return (train_step, example_args), a function and a tuple "
                       f"of its arguments; it returned {got}")
    return result[0], tuple(result[1])
