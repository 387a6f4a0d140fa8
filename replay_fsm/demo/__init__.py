"""``replay-fsm demo``: a small off-policy trainer on an embedded default."""

from .trainer import Critic, Learner, PointMass, collect, format_summary, run

__all__ = ["Critic", "Learner", "PointMass", "collect", "format_summary", "run"]
