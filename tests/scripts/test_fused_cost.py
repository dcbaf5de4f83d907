"""scripts/fused_cost.py on a tiny random base (2 layers: the rule reads layer 1 beside the final
state): B — A's heads reading a base layer through a fusion at its start — decodes exactly as A,
its forwards really keep the tapped layer, and one tiny run through ``main()`` writes the
fields a reader looks for."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import load_script, random_heads, save_tiny_base
from draftheads.decoding import DraftHeadsModel, load_base
from draftheads.heads import load_heads

TREES = {"1": [[0]], "3": [[0], [1], [0, 0]],
         "8": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny base and random Hydra heads (final state only) with stored trees."""
    tmp = tmp_path_factory.mktemp("fused_cost")
    base = save_tiny_base(tmp / "base")
    heads = random_heads("hydra", base, seed=3)
    heads.config.trees = dict(TREES)
    heads.save_pretrained(tmp / "heads", dtype=None)
    return tmp


@pytest.fixture(scope="module")
def ran(tiny):
    script = load_script("fused_cost")
    out = tiny / "out"
    code = script.main(["--heads", str(tiny / "heads"), "--base", str(tiny / "base"), "--dtype", "float32",
                        "--prompts", "2", "--max-new-tokens", "8", "--reps", "1", "--batch-size", "2",
                        "--batch-tree", "3", "--max-batches", "1", "--out", str(out)])
    return code, json.loads((out / "fused_cost.json").read_text()), out


def test_b_decodes_as_a_and_its_forward_keeps_the_taps(tiny, monkeypatch):
    import draftheads.decoding.step as step

    script = load_script("fused_cost")
    base, tokenizer = load_base(str(tiny / "base"), dtype="float32")
    heads_a = load_heads(tiny / "heads", dtype=torch.float32)
    heads_b = script.fused_twin(heads_a, [1])
    assert heads_a.feature_layers == () and heads_b.feature_layers == (1,)
    taps_asked = []
    verify = step.verify

    def recording(*args):
        taps_asked.append(tuple(args[-1]))
        return verify(*args)

    monkeypatch.setattr(step, "verify", recording)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 22]])
    outs = {}
    for side, heads in (("A", heads_a), ("B", heads_b)):
        taps_asked.clear()
        model = DraftHeadsModel(base, heads, tokenizer, tree=8, sources="heads")
        outs[side] = model.generate(ids, max_new_tokens=12)
        outs[side + "_steps"] = model.last_stats.steps
        assert taps_asked and set(taps_asked) == ({()} if side == "A" else {(1,)})
    assert torch.equal(outs["A"], outs["B"]) and outs["A_steps"] == outs["B_steps"]
    with pytest.raises(SystemExit, match="already read"):
        script.fused_twin(heads_b, [1])


def test_a_tiny_run_through_main_writes_its_fields(ran):
    code, result, out = ran
    assert code == 0
    meta = result["meta"]
    for key in ("command", "device", "threads", "date", "dtype", "layers", "reads", "tree", "batch_tree"):
        assert key in meta, key
    assert meta["dtype"] == "float32" and meta["layers"] == {"A": [], "B": [1]}
    assert meta["reads"]["A"] == {"taps": [], "feature_widths": [32]}
    assert meta["reads"]["B"] == {"taps": [1], "feature_widths": [64]}
    for name, units in (("bs1", 2), ("batched", 1)):
        summary = result[name]["summary"]
        assert summary["units"] == units and summary["same_tokens"] == units
        assert all(u["same_tokens"] for u in result[name]["units"])
        for side in ("A", "B"):
            for key in ("steps", "new_tokens", "tau", "verify_ms_per_step", "step_ms_per_step",
                        "decode_ms_per_step", "decode_tokens_per_second", "phases_ms_per_step"):
                assert key in summary[side], (name, side, key)
            assert summary[side]["verify_ms_per_step"] > 0
        assert summary["A"]["tau"] == summary["B"]["tau"] and summary["A"]["steps"] == summary["B"]["steps"]
        for t in ("verify", "step", "decode"):
            low, high = summary["b_over_a"][t]["ci95"]
            assert summary["b_over_a"][t]["b_over_a"] > 0 and low <= high
    assert result["batched"]["batch_size"] == 2 and result["bs1"]["batch_size"] == 1
    assert (out / "fused_cost.png").stat().st_size > 0
