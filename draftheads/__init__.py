"""draftheads: light draft heads + lossless tree speculative decoding for HF causal LMs.

The sub-packages live in the checkout's top-level folders ``core/``, ``heads/``, ``decoding/``
and ``training/``; the install (``pip install -e .`` or a wheel) maps them to ``draftheads.core``,
``draftheads.heads``, ``draftheads.decoding`` and ``draftheads.training``
(``[tool.setuptools.package-dir]`` in pyproject.toml). Nothing else in the checkout is part of the package."""
from __future__ import annotations

from .custom_generate import custom_generate
from .decoding import DraftHeadsModel, load_base
from .decoding.config import DecodingConfig
from .decoding.processors import PrefixOnly
from .heads import DraftheadsError, HeadConfig, MedusaHeads, load_heads
from .heads.head_config import DRAFTHEADS_VERSION as __version__

__all__ = ["DecodingConfig", "DraftHeadsModel", "DraftheadsError", "HeadConfig", "MedusaHeads", "PrefixOnly", "custom_generate", "load_base",
           "load_heads", "__version__"]
