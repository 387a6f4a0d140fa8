"""``python -m replay_fsm ...``: the ``replay-fsm`` command."""

from .cli import main

if __name__ == "__main__":  # not in a spawned child, which imports this as __mp_main__
    raise SystemExit(main())
