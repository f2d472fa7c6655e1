"""rollfleet: the inference side of LLM reinforcement learning, without Ray."""

import importlib as _importlib
from typing import TYPE_CHECKING

# Subpackages and modules are imported when first named (``rollfleet.errors`` with only
# ``rollfleet`` imported): importing the package itself costs a worker's start nothing.
_SUBMODULES = frozenset({"actors", "cli", "demo", "engines", "errors", "fielddoc", "serve", "transport", "weights"})

if not TYPE_CHECKING:  # (to a type checker, a module not imported stays an error)
    def __getattr__(name):
        if name in _SUBMODULES:
            return _importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
