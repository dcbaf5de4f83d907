"""The best drafting by default (decoding/drafters/choice.py: auto_sources; decoding/generate.py: calibrate_defaults;
decoding/drafters/merged.py: MergedDrafter skips the heads where a lookup match carries the step), and
``draftheads env``."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from draftheads.cli import main as cli_main
from draftheads.cli.generate_command import drafting_line
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.cost import CostModel
from draftheads.decoding.drafters import STORE_NAME, CandidateBatch, Candidates, HeadsDrafter, HeadsWorth, LookupSources, MergedDrafter, WidthChooser
from draftheads.decoding.drafters import source_id
from draftheads.decoding.drafters import auto_sources
from draftheads.decoding.base.plan import packing_available
from helpers import OracleHeads, saved_tree_heads, tiny_llama


def heads_in(folder, store: bool):
    """A stand-in for loaded heads: only where they were loaded from matters here."""
    folder.mkdir()
    if store:
        (folder / STORE_NAME).write_bytes(b"")
    return SimpleNamespace(checkpoint_dir=folder)


def test_auto_takes_the_heads_and_every_lookup_there_is_data_for(tmp_path):
    assert auto_sources(heads_in(tmp_path / "a", store=False)) == ("heads", "context")
    assert auto_sources(heads_in(tmp_path / "b", store=True)) == ("heads", "context", "store", "stats")
    assert auto_sources(None) == ("context",)
    assert auto_sources(None, lookup_store="some/store.safetensors") == ("context", "store", "stats")


def test_from_pretrained_drafts_with_heads_and_lookups_by_default_and_follows_the_base(tmp_path, monkeypatch):
    """The default: heads + context merged (no store shipped here), the tree and the width model
    priced by this machine's quick calibration (cached under DRAFTHEADS_CACHE), output the base's own."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    base = tiny_llama(0)
    model = DraftHeadsModel.from_pretrained(saved_tree_heads(tmp_path / "heads", base), base=base)
    assert model.sources == ("heads", "context")
    assert isinstance(model.drafter, MergedDrafter) and model.drafter.heads is model.heads
    assert model.step_costs.table is not None and model.drafter.width.cost is model.step_costs.table
    assert list((tmp_path / "cache" / "calibration").glob("*.json"))  # measured once, cached
    assert model.policy.tree.num_nodes in (1, 2, 4)  # one of the stored trees (or plain), as priced here
    prompt = torch.tensor([[5, 17, 33, 8, 9, 5, 17, 33, 8]])
    reference = base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False)
    assert model.generate(prompt, max_new_tokens=30).tolist() == reference.tolist()
    assert "heads + context" in drafting_line(model)
    only_heads = DraftHeadsModel.from_pretrained(tmp_path / "heads", base=base, sources="heads")
    assert only_heads.sources == ("heads",) and isinstance(only_heads.drafter, HeadsDrafter)


def chain(scores):
    n = len(scores)
    return Candidates.from_lists(list(range(-1, n - 1)), list(range(10, 10 + n)), scores, [source_id("context")] * n,
                                 [4] * n, [1.0] * n)


def merged(ms: float | None, gain: float | None) -> MergedDrafter:
    drafter = MergedDrafter(object(), LookupSources(None, sources=("context",)), WidthChooser(CostModel.from_table((1, 33), (10.0, 20.0))))
    drafter.worth.ms, drafter.worth.gain = ms, gain
    return drafter


def heads_pay(drafter: MergedDrafter, tries: CandidateBatch) -> bool:
    """Whether the drafter's heads propose this step (context 64)."""
    return drafter.worth.pays(tries, 64, drafter.width)


def test_the_heads_are_skipped_only_where_a_lookup_match_carries_the_step():
    confident = CandidateBatch.from_rows([chain([0.97, 0.95, 0.93, 0.9, 0.88, 0.85])])
    nothing = CandidateBatch.from_rows([Candidates.empty()])
    weak = CandidateBatch.from_rows([chain([0.2, 0.05])])
    assert heads_pay(merged(None, None), confident)  # not measured yet: the heads propose
    assert not heads_pay(merged(1.0, 1.0), confident)  # 0.03 of a chain to gain, 1 ms to pay
    assert heads_pay(merged(1.0, 1.0), nothing)  # the heads are all there is
    assert heads_pay(merged(1.0, 1.0), weak)
    assert not heads_pay(merged(50.0, 1.0), weak)  # heads dearer than the step they would help
    drafter = merged(1.0, 1.0)
    drafter.worth.recheck.skipped_in_a_row = drafter.worth.recheck_every
    assert heads_pay(drafter, confident)  # measured afresh now and then


def test_in_a_batch_the_heads_always_propose():
    """A batch lasts as long as its slowest row, usually one no lookup matches: the heads are what
    drafts for it, so above ``HeadsWorth.weigh_up_to`` live rows they are not weighed against their cost."""
    confident = CandidateBatch.from_rows([chain([0.97, 0.95, 0.93, 0.9, 0.88, 0.85])] * 2)
    assert heads_pay(merged(1.0, 1.0), confident)
    one = CandidateBatch.from_rows([chain([0.97, 0.95, 0.93, 0.9, 0.88, 0.85])])
    assert not heads_pay(merged(1.0, 1.0), one)  # the same chain, one row: skipped
    weighed = merged(1.0, 1.0)
    weighed.worth.weigh_up_to = 2
    assert not heads_pay(weighed, confident)


def test_rechecks_back_off_while_the_heads_do_not_pay_and_reset_when_they_do():
    confident = CandidateBatch.from_rows([chain([0.97, 0.95, 0.93, 0.9, 0.88, 0.85])])
    weak = CandidateBatch.from_rows([chain([0.2, 0.05])])
    drafter = merged(1.0, 1.0)
    waits = []
    for _ in range(5):  # a recheck, then the step after it still finds the heads not paying
        drafter.worth.recheck.skipped_in_a_row = drafter.worth.recheck.wait
        assert heads_pay(drafter, confident)  # the recheck
        drafter.worth.recheck.skipped_in_a_row = 0
        assert not heads_pay(drafter, confident)
        waits.append(drafter.worth.recheck.wait)
    assert waits == [16, 32, 64, 64, 64]  # doubled up to recheck_most
    drafter.worth.recheck.skipped_in_a_row = drafter.worth.recheck.wait
    assert heads_pay(drafter, confident)
    assert heads_pay(drafter, weak)  # after this recheck they pay: the usual wait again
    assert drafter.worth.recheck.wait == drafter.worth.recheck_every
    sooner = MergedDrafter(object(), LookupSources(None, sources=("context",)), worth=HeadsWorth(recheck_every=4))
    assert sooner.worth.recheck.wait == 4  # the first wait is the configured one, before any request


def test_skipping_the_heads_keeps_the_output_and_saves_their_calls(tmp_path, monkeypatch):
    """This tiny base answers a token repeated (so the context match carries the steps): the heads
    are skipped on most steps, and the tokens are still the base's own (float64). Without a step
    time in ms (the relative LINEAR_COST) the heads always propose."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    base = tiny_llama(3)
    prompt = torch.tensor([[7, 21, 40, 9, 12, 55, 3, 8] * 4])
    reference = base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=48, do_sample=False)
    continuation = reference[0, prompt.shape[1]:].tolist()
    assert len(set(continuation)) == 1  # what makes the context match carry the step
    uncalibrated = DraftHeadsModel(base, OracleHeads([continuation], vocab=96, error=0.9, seed=1))
    uncalibrated.use_sources("heads,context")
    assert uncalibrated.generate(prompt, max_new_tokens=48).tolist() == reference.tolist()
    assert uncalibrated.drafter.skipped_heads_steps == 0
    model = DraftHeadsModel(base, OracleHeads([continuation], vocab=96, error=0.9, seed=1))
    model.calibrate_defaults()
    model.use_sources("heads,context")
    assert model.generate(prompt, max_new_tokens=48).tolist() == reference.tolist()
    assert model.drafter.heads_steps >= 1 and model.drafter.skipped_heads_steps >= 1


def test_env_reports_what_torch_runs_here(capsys):
    assert cli_main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["CPU capability (torch)"] == torch.backends.cpu.get_cpu_capability()
    assert info["torch version"] == torch.__version__
    assert set(info) >= {"oneDNN packing, float32", "oneDNN packing, bfloat16", "native CPU dtypes", "packing cache",
                         "calibration cache", "GPU", "torch threads", "stacked q/k/v and gate/up products"}
    assert info["stacked q/k/v and gate/up products"].startswith("bfloat16") == packing_available(torch.bfloat16)
    assert "float32" in info["native CPU dtypes"]


@pytest.mark.skipif(not __import__("draftheads.decoding.base.hardware", fromlist=["is_x86"]).is_x86(),
                    reason="the AVX2 limit is an x86 setting")
def test_env_under_an_avx2_limit():
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    import os

    out = subprocess.run([sys.executable, "-m", "draftheads.cli", "env"], env={**os.environ, **env},
                         capture_output=True, text=True, check=True).stdout
    assert "- CPU capability (torch): AVX2" in out
    assert "- native CPU dtypes: float32\n" in out
    assert "- oneDNN packing, bfloat16: off" in out
    assert "ATEN_CPU_CAPABILITY=avx2" in out


def test_merged_default_offers_the_heads_a_larger_tree_and_keeps_the_output(tmp_path, monkeypatch):
    """With lookups merged in, the default model's heads fill the stored tree for
    decoding.merged_offer_scale × the heads-alone budget (the width chooser verifies what pays of it); the
    policy keeps the heads-alone tree, sources="heads" gets no offer, a pinned tree none either,
    and the output is still the base's own (float64)."""
    from draftheads.decoding.builder import StepCosts
    from draftheads.decoding.policy import FixedTree, tree_for_budget

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    base = tiny_llama(0)
    folder = saved_tree_heads(tmp_path / "heads", base)
    model = DraftHeadsModel.from_pretrained(folder, base=base, sources="heads,context", merged_offer_scale=3)
    # as if this machine's calibration had chosen the 1-node tree (not timing's pick)
    model.step_costs = StepCosts(model.step_costs.table, default_budget=1)
    model.use_sources("heads,context")
    assert model.drafter.heads_tree.num_nodes == tree_for_budget(model.heads, 3).num_nodes == 4
    assert model.policy.tree.num_nodes in (1, 2, 4)
    filled = []
    propose = model.heads.propose
    model.heads.propose = lambda hidden, roots, tree, **kw: filled.append(tree.num_nodes) or propose(hidden, roots, tree, **kw)
    prompt = torch.tensor([[5, 17, 33, 8, 9, 5, 17, 33, 8]])
    reference = base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False)
    assert model.generate(prompt, max_new_tokens=30).tolist() == reference.tolist()
    assert filled and max(filled) == 4
    assert "heads' tree 4 nodes" in drafting_line(model)
    assert model.with_decoding(sources="heads").drafting_summary()["tree_nodes"] == model.policy.tree.num_nodes
    pinned = DraftHeadsModel.from_pretrained(folder, base=base, sources="heads,context", tree=1)
    assert pinned.step_costs.default_budget is None and pinned.drafter.heads_tree is None
    # a policy given (the batched bench's) is followed as it is
    given = model.with_decoding(tree=FixedTree(tree_for_budget(model.heads, 1)), sources="heads,context")
    assert given.drafter.heads_tree is None and model.drafter.heads_tree is not None



def test_the_steps_own_overhead_weighs_against_the_heads_cost():
    """A step costs more than its forward (the lookups' drafting, acceptance, the commit, the loop):
    measured, that overhead joins t, so heads that buy a little at a fixed cost pay once the whole
    step is counted — the check no longer grows stricter as the forward gets cheaper."""
    weak = CandidateBatch.from_rows([chain([0.7, 0.5])])
    drafter = merged(2.0, 1.0)  # G = (1 − 0.7) · 1 = 0.3 tokens for 2 ms; T ≈ 2.2 tokens
    assert not heads_pay(drafter, weak)  # against the forward alone (~10 ms) 2 ms is too much: G·t < T·p
    for _ in range(20):
        drafter.worth.stepped(25.0, 10.0)  # steps take 15 ms more than the cost model prices
    assert abs(drafter.worth.overhead_ms - 15.0) < 0.2
    assert heads_pay(merged_like(drafter), weak)


def merged_like(drafter: MergedDrafter) -> MergedDrafter:
    """A fresh drafter with what ``drafter`` measured (no recheck state in the way)."""
    fresh = merged(drafter.worth.ms, drafter.worth.gain)
    fresh.worth.overhead_ms = drafter.worth.overhead_ms
    return fresh

