"""``python -m colfunc ...`` is the ``colfunc`` command (how ``colfunc run`` starts its ranks)."""

from colfunc.cli import main

raise SystemExit(main())
