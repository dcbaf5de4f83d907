"""Draft-head families behind one interface (see :mod:`.protocol`)."""
from .errors import DraftheadsError
from .protocol import (CheckpointError, DraftHeads, HeadConfig, REGISTRY, TreeSpec, build_heads, cartesian_tokens,
                       display_name, load_heads, read_config, register)
from .medusa import MedusaHeads, ResBlock
from .hydra import HydraHeads
from .amphista import AmphistaHeads

__all__ = ["AmphistaHeads", "CheckpointError", "DraftHeads", "DraftheadsError", "HeadConfig", "HydraHeads", "MedusaHeads", "REGISTRY",
           "ResBlock", "TreeSpec", "build_heads", "cartesian_tokens", "display_name", "load_heads", "read_config",
           "register"]
