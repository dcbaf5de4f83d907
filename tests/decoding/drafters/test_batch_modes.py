"""In a batch the merged drafter's modes (merged, lookups alone, heads alone) are chosen by their
measured speeds (decoding/drafters/modes.py), and every mode keeps the base's tokens."""
from __future__ import annotations

import pytest
import torch

from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.cost import CostModel
from draftheads.decoding.drafters import LookupSources, MergedDrafter, WidthChooser
from draftheads.decoding.drafters.modes import MODES, BatchModes, rows_bucket, speed
from draftheads.decoding.tree import tree_from_paths
from helpers import OracleHeads, tiny_llama


def step(modes: BatchModes, rows: int, speeds: dict[str, float]) -> str:
    """One step at ``rows`` live rows where each mode runs at ``speeds[mode]`` over plain decoding."""
    mode = modes.choose(rows)
    modes.started(rows, mode, plain_ms=10.0)
    modes.emitted(rows)  # one token a row ...
    modes.finished(10.0 / speeds[mode])  # ... in the time that makes the mode's speed
    return mode


def test_speed_is_tokens_per_row_against_a_plain_step():
    assert speed(tokens=16, rows=16, wall_ms=40.0, plain_ms=40.0) == pytest.approx(1.0)
    assert speed(tokens=32, rows=16, wall_ms=50.0, plain_ms=40.0) == pytest.approx(1.6)
    assert [rows_bucket(r) for r in (2, 3, 4, 7, 8, 16, 31)] == [2, 2, 3, 3, 4, 5, 5]


def test_each_mode_is_measured_first_then_the_fastest_runs():
    modes = BatchModes(first_steps=2, recheck_every=8)
    speeds = {"merged": 1.5, "lookups": 1.8, "heads": 2.4}
    first = [step(modes, 16, speeds) for _ in range(6)]
    assert first == ["merged"] * 2 + ["lookups"] * 2 + ["heads"] * 2
    run = [step(modes, 16, speeds) for _ in range(8)]
    assert run == ["heads"] * 8
    assert modes.speeds[(5, "heads")] == pytest.approx(2.4)


def test_rechecks_back_off_while_the_best_stays_and_reset_when_it_changes():
    modes = BatchModes(first_steps=1, recheck_every=4, recheck_most=16)
    speeds = {"merged": 1.0, "lookups": 1.2, "heads": 2.0}
    chosen = [step(modes, 8, speeds) for _ in range(3 + 4 + 1 + 8 + 1 + 16 + 1 + 16 + 1)]
    rechecks = [i for i, m in enumerate(chosen) if i >= 3 and m != "heads"]
    assert rechecks == [7, 16, 33, 50]  # after runs of 4, 8, 16, 16 steps on the best
    assert [chosen[i] for i in rechecks] == ["merged", "lookups", "merged", "lookups"]  # the least recently tried
    speeds["heads"] = 0.5  # the text changed: the heads stop paying
    after = "".join(step(modes, 8, speeds)[0] for _ in range(30))
    # one slow step of the heads weighs by its time: the lookups lead at once, and their runs start
    # again at 4 steps, then 8
    assert after == "h" + "llll" + "m" + "l" * 8 + "h" + "l" * 15


def test_buckets_of_live_rows_are_measured_apart_and_requests_keep_them():
    modes = BatchModes(first_steps=1)
    for _ in range(6):
        step(modes, 16, {"merged": 1.0, "lookups": 1.1, "heads": 2.0})
    assert step(modes, 16, {m: 1.0 for m in MODES}) == "heads"
    assert step(modes, 3, {m: 1.0 for m in MODES}) == "merged"  # 3 rows: nothing measured yet
    modes.abandon()  # a new request: what is measured stays
    assert modes.counts[(5, "heads")] >= 1
    counted = dict(modes.counts)
    unverified = modes.choose(16)
    modes.started(16, unverified, 10.0)
    modes.abandon()
    modes.finished(1.0)  # the step of the ended request is not measured
    assert modes.counts == counted


@pytest.mark.parametrize("speeds", [{"merged": 1.0, "lookups": 0.5, "heads": 0.5},
                                    {"merged": 0.5, "lookups": 1.0, "heads": 0.5},
                                    {"merged": 0.5, "lookups": 0.5, "heads": 1.0}], ids=lambda s: max(s, key=s.get))
def test_every_mode_in_a_batch_gives_the_base_own_tokens(speeds, monkeypatch):
    """A padded batch of four through the merged drafter, float64: the steps run every mode (the
    measured speeds made to favour each in turn) and the tokens are the base's greedy ones."""
    base = tiny_llama(3)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (9, 4, 7, 12)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    reference = base.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    continuations = reference[:, width:].tolist()
    heads = OracleHeads(continuations, vocab=96, error=0.3, seed=2)
    tree = tree_from_paths([[0], [1], [0, 0], [0, 0, 0]])
    model = DraftHeadsModel(base, heads, tree=tree, delegate_plain=False)
    drafter = MergedDrafter(heads, LookupSources(None, sources=("context",)),
                            WidthChooser(CostModel.from_table((1, 33), (10.0, 20.0))),
                            modes=BatchModes(first_steps=1, recheck_every=2))
    drafter_mode: list[str] = []

    def favoured(tokens, rows, wall_ms, plain_ms):  # a tiny base's wall time is noise: each mode's speed is given
        return speeds[drafter_mode[-1]]

    choose = drafter.modes.choose

    def remembering(rows):
        drafter_mode.append(choose(rows))
        return drafter_mode[-1]

    monkeypatch.setattr(drafter.modes, "choose", remembering)
    monkeypatch.setattr("draftheads.decoding.drafters.modes.speed", favoured)
    twin = model.with_decoding(drafter=drafter)
    ours = twin.generate(ids, attention_mask=mask, max_new_tokens=40, pad_token_id=0)
    assert ours.tolist() == reference.tolist()
    assert set(drafter.mode_steps) == set(MODES)  # each mode drafted steps of this batch
    assert twin.drafting_summary()["batch_modes"] == drafter.mode_steps
    favourite = max(speeds, key=speeds.get)
    assert drafter.mode_steps[favourite] > max(n for m, n in drafter.mode_steps.items() if m != favourite)


def test_a_mode_speed_weighs_each_step_by_its_time():
    """Tokens over time, as tokens/s is: a slow step counts for its length (decayed sums, not an
    average of step speeds)."""
    modes = BatchModes(decay=0.7)
    for tokens, wall_ms in ((8, 10.0), (4, 40.0)):  # speeds 2.0, then 0.25 over a 10 ms plain step of 4 rows
        modes.started(4, "heads", plain_ms=10.0)
        modes.emitted(tokens)
        modes.finished(wall_ms)
    assert modes.speeds[(3, "heads")] == pytest.approx((0.7 * 2.0 * 10 + 0.25 * 40) / (0.7 * 10 + 40))
