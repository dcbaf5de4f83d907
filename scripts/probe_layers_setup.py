"""scripts/probe_layers.py's constants (the probe is three files: scripts are capped at 400 lines)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUM_HEADS = 4
DRAFT_VOCAB = 8192
RANK_CAP = 16
CACHE = REPO / "data_cache" / "probe_layers"
TRAIN_DATA = REPO / "recipes" / "data" / "selfdistill-smollm2"
SHARED_EVAL_JOB = REPO / "data_cache" / "eval-clean-smollm2"

#: the feature sets compared (HF hidden_states indices, L = 30 = last_hidden_state), in order;
#: "last" is the reference every difference is taken against
FEATURE_SETS = {
    "last": (30,),
    "eagle3": (2, 15, 27),       # EAGLE-3's rule: inputs of zero-based layers 2, L//2, L-3
    "low-mid-final": (3, 15, 30),
    "mid-final": (15, 30),
    "8-22-final": (8, 22, 30),
}


# ---------------------------------------------------------------------------------------------
# capture
