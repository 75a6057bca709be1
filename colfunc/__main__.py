"""``python -m colfunc ...`` is the ``colfunc`` command (how ``colfunc run`` starts its ranks)."""

from colfunc.cli import main

if __name__ == "__main__":  # (not when a spawned process imports it: the engine's, say)
    raise SystemExit(main())
