"""``replay-fsm demo``: a small off-policy trainer on an embedded default.

``run(DemoConfig(...))`` runs it; the pieces (environment, collector, learner) are
modules of their own so tests and the distributed launcher can reuse them.
"""

from .collector import collect
from .config import DemoConfig
from .env import PointMass
from .learner import Critic, Learner
from .runner import format_summary, run

__all__ = ["Critic", "DemoConfig", "Learner", "PointMass", "collect", "format_summary",
           "run"]
