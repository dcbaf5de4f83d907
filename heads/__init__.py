"""Draft-head families behind one interface (see :mod:`.protocol`), their typed options
(:mod:`.family_options`), config (:mod:`.head_config`) and checkpoint format (:mod:`.checkpoint`)."""
from ..core.errors import DraftheadsError
from .head_config import REGISTRY, HeadConfig, build_heads, display_name, read_config, register
from ..core.errors import CheckpointError
from .family_options import FamilyOptions, KoalaOptions, OptionError
from .protocol import DraftHeads, TreeSpec, cartesian_tokens
from .checkpoint.io import load_heads
from .medusa import MedusaHeads, MedusaOptions, ResBlock
from .hydra import HydraHeads, HydraOptions, HydraPlusPlusOptions
from .amphista import AmphistaHeads, AmphistaOptions
from .eagle3 import Eagle3Heads, Eagle3Options

__all__ = ["AmphistaHeads", "AmphistaOptions", "Eagle3Heads", "Eagle3Options", "CheckpointError", "DraftHeads", "DraftheadsError", "FamilyOptions",
           "HeadConfig", "HydraHeads", "HydraOptions", "HydraPlusPlusOptions", "KoalaOptions", "MedusaHeads",
           "MedusaOptions", "OptionError", "REGISTRY", "ResBlock", "TreeSpec", "build_heads", "cartesian_tokens",
           "display_name", "load_heads", "read_config", "register"]
