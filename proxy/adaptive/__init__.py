"""Adaptive speculation: measure what a round costs and what it returns while serving,
and choose each round's tree -- or plain generation -- by the tokens per second it is
expected to give.

* `costs.CostModel` -- per target (upstream): an online fit of a verification call's
  latency, and plain generation's time per token.
* `calibration.Calibration` -- per drafter and target: how often a node the drafter
  gives path probability p is really accepted.
* `controller.Controller` -- the decisions: how many of the best-first heap's nodes to
  verify this round, and when to step aside for plain generation and come back.
"""

from proxy.adaptive.calibration import Calibration
from proxy.adaptive.controller import AdaptiveState, Controller
from proxy.adaptive.costs import CostModel

__all__ = ["AdaptiveState", "Calibration", "Controller", "CostModel"]
