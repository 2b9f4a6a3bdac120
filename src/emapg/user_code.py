"""Functions of the user's own code named by import path (reward functions, an advantage).

`module:function` imports from sys.path (the current directory included, as `python -m` has it);
`path/to/file.py:function` loads that file, once, under a name derived from its path.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

from emapg.errors import EmapgError


def load_function(spec: str, field: str) -> Callable:
    """The function `spec` names: `module:function` or `path/to/file.py:function`; errors name `field`."""
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name:
        raise EmapgError(f"{field}: {spec!r}: expected module:function or path/to/file.py:function")
    if where.endswith(".py"):
        file = Path(where).expanduser().resolve()
        if not file.is_file():
            raise EmapgError(f"{field}: {spec!r}: no such file {where!r}")
        # A module name derived from the path, so the same file always gives the same module.
        module_name = "emapg_user_rewards_" + hashlib.sha256(str(file).encode()).hexdigest()[:12]
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            try:
                loader_spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[module_name]
                raise EmapgError(
                    f"{field}: {spec!r}: importing {where} raised {type(e).__name__}: {e}"
                ) from None
    else:
        if os.getcwd() not in sys.path:  # the `emapg` script's path lacks it; `python -m` has it
            sys.path.append(os.getcwd())  # last: a module of the current directory shadows nothing
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise EmapgError(
                f"{field}: {spec!r}: cannot import {where!r} ({type(e).__name__}: {e})"
            ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise EmapgError(f"{field}: {spec!r}: {where} has no function {name!r}")
    return fn
