"""Tree speculative decoding: base wrapper, trees, acceptance, KV bookkeeping, the loop."""
from .accept import Acceptance, greedy_accept
from .base import BaseFingerprint, fingerprint, load_base
from .generate import DecodingStats, DraftHeadsModel, FixedTree, TreePolicy, default_tree, tree_for_budget
from .tree import Tree, chain_tree, tree_from_paths, tree_from_ranks

__all__ = ["Acceptance", "BaseFingerprint", "DecodingStats", "DraftHeadsModel", "FixedTree", "Tree", "TreePolicy",
           "chain_tree", "default_tree", "fingerprint", "greedy_accept", "load_base", "tree_for_budget",
           "tree_from_paths", "tree_from_ranks"]
