"""``python -m replay_fsm ...``: the ``replay-fsm`` command."""

from .cli import main

if __name__ == "__main__":  # as a script only, never on import
    raise SystemExit(main())
