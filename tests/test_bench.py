"""draftheads/bench: what every bench shares — the model comes back as it was (``model_state``),
runs interleave in a rotating order and keep the fastest repeat; τ over a run."""
from __future__ import annotations

import pytest

from draftheads.bench import keep_fastest, model_state, rotated
from draftheads.bench.summary import run_tau
from draftheads.decoding.loop import tau


class Model:
    finished_rows = "shrink"  # inherited from the class, as DraftHeadsModel's

    def __init__(self):
        self.policy, self.drafter, self.draft_sources = "pinned", None, ("heads",)


def test_model_state_puts_back_what_the_block_changed_even_on_error():
    model = Model()
    with pytest.raises(RuntimeError):
        with model_state(model):
            model.policy, model.drafter, model.draft_sources, model.finished_rows = "adaptive", object(), (), "mask"
            raise RuntimeError("a strategy failed")
    assert (model.policy, model.drafter, model.draft_sources) == ("pinned", None, ("heads",))
    assert "finished_rows" not in vars(model) and model.finished_rows == "shrink"


def test_strategies_rotate_and_the_fastest_repeat_counts():
    assert [rotated(["a", "b", "c"], k) for k in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                               ["a", "b", "c"]]
    best: dict = {}
    for run in (("x", 2.0), ("y", 1.0), ("z", 3.0)):
        keep_fastest(best, "hf", run)
    assert best == {"hf": ("y", 1.0)}


def test_tau_is_tokens_per_verification():
    assert tau(3, 3) == pytest.approx(2.0)  # (3 accepted + 3 bonus) / 3 steps
    assert tau(0, 0) == 0.0
    assert run_tau(new_tokens=13, prompts=1, steps=4) == 3.0  # after the prefill token
