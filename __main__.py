"""``python -m rollfleet``: the same as the ``rollfleet`` command."""

from .cli import main

raise SystemExit(main())
