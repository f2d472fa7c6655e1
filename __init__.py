"""rollfleet: the inference side of LLM reinforcement learning, without Ray."""

import importlib as _importlib
from typing import TYPE_CHECKING

# Subpackages and modules are imported when first named (``rollfleet.errors`` with only
# ``rollfleet`` imported): importing the package itself costs a worker's start nothing.
# They are read from the package's directory, once, when a name is first missed.
_submodules = None


def _submodule_names():
    global _submodules
    if _submodules is None:
        import pkgutil

        # Not __main__: importing it runs the command line.
        _submodules = frozenset(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return _submodules


if not TYPE_CHECKING:  # (to a type checker, a module not imported stays an error)
    def __getattr__(name):
        if name in _submodule_names():
            return _importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
