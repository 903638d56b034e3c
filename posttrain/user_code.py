"""User code named by a ``"package.module:name"`` string (a reward function, an environment class)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def import_named(path: str, *, what: str, malformed: str, error: type[Exception]) -> Any:
    """The attribute ``name`` of ``package.module``, imported as ``python -m`` would from the working
    directory (a console script such as ``posttrain`` does not put it on ``sys.path`` by itself).

    Every failure is an ``error`` naming ``what`` and ``path``: ``malformed`` when the string has
    no ``module:name`` shape, a missing module, a module that raises or calls ``sys.exit`` on
    import (its exception, not a traceback into importlib), a missing attribute."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise error(malformed)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as cause:
        raise error(f"{what} {path!r}: cannot import module {module_name!r} ({cause})") from None
    except SystemExit as cause:  # a script's sys.exit at import: the run would end "successfully", having done nothing
        raise error(
            f"{what} {path!r}: importing {module_name!r} called sys.exit({cause.code!r}); keep a script's top-level "
            "code under `if __name__ == '__main__':`"
        ) from None
    except Exception as cause:  # the user's module is broken: say where
        raise error(f"{what} {path!r}: importing {module_name!r} raised {type(cause).__name__}: {cause}") from cause
    if not hasattr(module, attr):
        raise error(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)
