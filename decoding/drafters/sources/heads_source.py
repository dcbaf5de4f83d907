"""The heads as a draft source of the registry: they need a head checkpoint and draft from
hidden states, so the merged drafter calls them itself
(:class:`~draftheads.decoding.drafters.heads_drafter.HeadsDrafter`) and there is no per-row
source to start."""
from __future__ import annotations

from ..registry import SourceSpec


def heads_prior(bucket: int) -> float:
    """The heads' probabilities start at face value (their calibration is learned per depth)."""
    return 1.0


#: the heads as a draft source: they need a head checkpoint and draft from hidden states (the
#: merged drafter calls them itself, so no per-row source)
HEADS = SourceSpec("heads", heads_prior, needs=("heads",))
