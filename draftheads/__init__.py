"""draftheads: light draft heads + lossless tree speculative decoding for HF causal LMs."""
from __future__ import annotations

from pathlib import Path as _Path

# Running from a source checkout without installing: the sub-packages live in the top-level
# folders heads/, decoding/, training/ (setuptools maps them to draftheads.* on install).
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "decoding" / "__init__.py").is_file():
    __path__.append(str(_root))  # type: ignore[name-defined]

from .decoding import DraftHeadsModel, load_base  # noqa: E402
from .heads import HeadConfig, MedusaHeads, load_heads  # noqa: E402
from .heads.protocol import DRAFTHEADS_VERSION as __version__  # noqa: E402

__all__ = ["DraftHeadsModel", "HeadConfig", "MedusaHeads", "load_base", "load_heads", "__version__"]
