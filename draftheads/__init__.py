"""draftheads: light draft heads + lossless tree speculative decoding for HF causal LMs.

The sub-packages live in the checkout's top-level folders; why and how they install as
``draftheads.*``: docs/architecture.md ("The floors and the import direction")."""
from __future__ import annotations

from .custom_generate import custom_generate
from .decoding import DraftHeadsModel, load_base
from .decoding.config import DecodingConfig
from .decoding.processors import PrefixOnly
from .heads import DraftheadsError, HeadConfig, MedusaHeads, load_heads
from .heads.head_config import DRAFTHEADS_VERSION as __version__

__all__ = ["DecodingConfig", "DraftHeadsModel", "DraftheadsError", "HeadConfig", "MedusaHeads", "PrefixOnly", "custom_generate", "load_base",
           "load_heads", "__version__"]
