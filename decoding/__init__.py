"""Tree speculative decoding: base wrapper, trees, acceptance, KV bookkeeping, the loop."""
from .accept import Acceptance, greedy_accept
from .base.loading import load_base
from .base.fingerprint import BaseFingerprint, fingerprint
from .head_state import HeadState
from .generate import DraftHeadsModel
from .calibration import calibrate
from .cost import CostModel, load_cost_surface
from .loop import DecodingStats
from .policy import AdaptivePolicy, FixedTree, TreePolicy, default_tree, tree_for_budget
from .tree import Tree, chain_tree, tree_from_paths, tree_from_ranks

__all__ = ["Acceptance", "AdaptivePolicy", "BaseFingerprint", "CostModel", "DecodingStats", "DraftHeadsModel", "FixedTree",
           "HeadState", "Tree", "TreePolicy", "calibrate", "chain_tree", "default_tree", "fingerprint", "greedy_accept", "load_base", "load_cost_surface", "tree_for_budget",
           "tree_from_paths", "tree_from_ranks"]
