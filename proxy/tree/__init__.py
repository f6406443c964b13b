"""Pure DDTree data structures and algorithms: no I/O, no model code."""

from proxy.tree.build import build_chain, build_tree
from proxy.tree.tree import DraftDistribution, DraftTree, WalkResult, walk

__all__ = [
    "DraftDistribution",
    "DraftTree",
    "WalkResult",
    "build_chain",
    "build_tree",
    "walk",
]
