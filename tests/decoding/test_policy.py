"""The batch-adaptive policy: cost model interpolation, tree choice on synthetic and measured
(GPU) cost surfaces, the calibration cache, online τ, and token identity of adaptive decoding
with HF batched greedy generate (float64 tiny Llamas)."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import TINY_GRID, OracleHeads, left_pad, tiny_heads, tiny_llama
from draftheads.decoding import DraftHeadsModel, chain_tree, tree_from_paths
from draftheads.core.errors import InputError
from draftheads.decoding.calibration import calibrate, calibration_key, calibration_path
from draftheads.decoding.cost import CostModel, LatencyTable, interp1, load_cost_surface
from draftheads.decoding.policy import AdaptivePolicy, Candidate, FixedTree, candidates_from_heads, resolve_tree
from draftheads.heads import HeadConfig, MedusaHeads
from draftheads.prompts import DATA_DIR

SURFACES = DATA_DIR / "cost_surfaces"  # the measured GPU surfaces the package ships
# τ(n) of a best-first Medusa tree from a quick SmolLM2 probe (the project's batch-adaptive notes)
PROBE_TAU = {1: 1.46, 3: 1.69, 7: 1.87, 15: 2.00, 63: 2.13}


def wide_tree(budget: int):
    return tree_from_paths([(i,) for i in range(budget)])


def probe_candidates() -> list[Candidate]:
    return [Candidate(0, chain_tree(0), 1.0)] + [Candidate(b, wide_tree(b), t) for b, t in PROBE_TAU.items()]


def synthetic_cost(ms_of, batch_sizes=(1, 2, 4, 8, 16, 32, 64), qs=(1, 2, 4, 8, 16, 32, 64), kv_len=(256,)) -> CostModel:
    rows = [{"bs": b, "q": q, "ctx": c, "ms": ms_of(b, q, c)} for b in batch_sizes for q in qs for c in kv_len]
    return CostModel(LatencyTable.from_rows(rows))


def chosen_budgets(policy: AdaptivePolicy, batch_sizes, kv_len=256) -> list[int]:
    return [policy.rank(bs, kv_len)[0].budget for bs in batch_sizes]


# -- cost model ------------------------------------------------------------------------------
def test_interpolation_is_exact_on_the_grid_linear_between_and_extrapolates():
    assert interp1([1, 4], [10.0, 40.0], 1) == 10.0
    assert interp1([1, 4], [10.0, 40.0], 2) == pytest.approx(20.0)
    assert interp1([1, 2, 4], [10.0, 10.0, 30.0], 8) == pytest.approx(70.0)  # last slope continues
    table = LatencyTable.from_rows([{"bs": b, "q": q, "ctx": c, "ms": b * q + c / 100}
                                    for b in (1, 4) for q in (1, 8) for c in (100, 300)])
    assert table.ms(4, 8, 300) == pytest.approx(35.0)
    assert table.ms(2, 4, 200) == pytest.approx(8.0 + 2.0)  # bilinear in (bs, q) is exact for b*q at corners
    assert table.ms(8, 8, 100) == pytest.approx(65.0)  # beyond the grid: linear in bs


def test_step_cost_adds_overhead_and_drafting_only_when_speculating():
    cost = CostModel(LatencyTable.from_rows([{"bs": 1, "q": q, "ctx": 0, "ms": 10.0 * q} for q in (1, 2)]),
                     overhead=LatencyTable.from_rows([{"bs": 1, "q": 1, "ctx": 0, "ms": 1.0}]),
                     draft=LatencyTable.from_rows([{"bs": 1, "q": 1, "ctx": 0, "ms": 5.0}]))
    assert cost.step_ms(1, 1, 0, budget=0) == pytest.approx(11.0)
    assert cost.step_ms(1, 2, 0, budget=1) == pytest.approx(26.0)
    again = CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert again.step_ms(1, 2, 0, budget=1) == pytest.approx(26.0)


# -- the choice ------------------------------------------------------------------------------
def test_smaller_trees_as_verification_cost_grows_with_batch():
    # memory-bound (flat) up to 64 tokens per forward, compute-bound (linear in tokens) after
    policy = AdaptivePolicy(probe_candidates(), synthetic_cost(lambda b, q, c: max(20.0, 0.3 * b * q)), learn=False)
    budgets = chosen_budgets(policy, [1, 2, 4, 8, 16, 32, 64])
    assert budgets[0] == 63
    assert budgets == sorted(budgets, reverse=True)  # never more speculation for a larger batch
    assert budgets[-1] < budgets[0] and budgets[-1] <= 3


def test_plain_decoding_when_speculation_cannot_pay():
    # every query token costs its full share from the start: τ(n) / (n+1) < 1 for every tree
    policy = AdaptivePolicy(probe_candidates(), synthetic_cost(lambda b, q, c: 5.0 * b * q), learn=False)
    assert chosen_budgets(policy, [1, 8, 64]) == [0, 0, 0]
    # and a drafting cost larger than what any tree saves also switches speculation off
    flat = synthetic_cost(lambda b, q, c: 10.0)
    flat.draft = LatencyTable.from_rows([{"bs": b, "q": n, "ctx": 0, "ms": 20.0} for b in (1, 64) for n in PROBE_TAU])
    assert chosen_budgets(AdaptivePolicy(probe_candidates(), flat, learn=False), [1, 64]) == [0, 0]


@pytest.mark.parametrize("name", ["cost_vicuna-7b_gpu_ctx512.json", "cost_llama3-8b_gpu_ctx512.json"])
def test_gpu_surfaces_shrink_the_tree_for_large_batches(name):
    cost = load_cost_surface(SURFACES / name)
    assert cost.meta["ctx"] == 512 and cost.forward.ms(1, 1, 512) > 1.0
    policy = AdaptivePolicy(probe_candidates(), cost, learn=False)
    budgets = chosen_budgets(policy, [1, 8, 64], kv_len=512)
    assert budgets[0] == 63  # a 64-query tree is almost free at bs 1 on an H100
    assert budgets[0] > budgets[1] > budgets[2] > 0
    best64 = policy.rank(64, 512)[0]
    assert best64.tokens_per_second > next(c for c in policy.rank(64, 512) if c.budget == 0).tokens_per_second


def test_gpu_chain_rows_are_a_different_surface():
    tree, chain = (load_cost_surface(SURFACES / "cost_vicuna-7b_gpu_ctx512.json", mode=m) for m in ("tree", "chain"))
    assert tree.forward.ms(64, 64, 512) != chain.forward.ms(64, 64, 512)
    with pytest.raises(ValueError, match="No latency rows with mode='beam'"):
        load_cost_surface(SURFACES / "cost_vicuna-7b_gpu_ctx512.json", mode="beam")


def test_online_tau_scale_moves_to_smaller_trees_when_drafts_are_rejected():
    cost = synthetic_cost(lambda b, q, c: 20.0 + b * q)  # every node costs a little
    policy = AdaptivePolicy(probe_candidates(), cost, decay=0.9, prior_weight=4.0)
    before = policy.choose(4, 256)
    assert before.num_nodes > 1
    for _ in range(30):  # nothing ever accepted: the heads are useless on this text
        tree = policy.choose(4, 256)
        if tree.num_nodes == 1:
            break
        policy.observe(tree, torch.zeros(4, dtype=torch.long))
    assert policy.scale < 0.5
    assert policy.choose(4, 256).num_nodes == 1
    assert policy.choose(1, 256).num_nodes > 1  # alone, a small tree still pays at this scale
    # a truncated tree (not the chosen object) or a disabled learner does not move the scale
    scale = policy.scale
    policy.observe(wide_tree(3), torch.full((4,), 3))
    assert policy.scale == scale
    policy.reset()
    assert policy.scale == 1.0


def test_candidates_from_a_checkpoint_config():
    config = HeadConfig(num_heads=2, hidden_size=32, vocab_size=96, trees={"1": [[0]], "3": [[0], [1], [0, 0]]},
                        expected_tau={"1": 1.4, "3": 1.7})
    heads = MedusaHeads(config)
    cands = candidates_from_heads(heads)
    assert [(c.budget, c.tree.num_nodes, c.tau) for c in cands] == [(0, 1, 1.0), (1, 2, 1.4), (3, 4, 1.7)]
    with pytest.raises(ValueError, match=r"budget\(s\) \[2\]"):
        candidates_from_heads(heads, budgets=[1, 2])
    with pytest.raises(ValueError, match="lacks them: pin a tree instead"):
        candidates_from_heads(MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96)))


def test_a_tau_measured_on_evaluation_answers_counts_whole_and_never_picks_a_smaller_tree():
    """``expected_tau_on``: τ fitted on held-out training text counts 0.75 of its drafted part,
    τ fitted on the base's answers to evaluation prompts all of it; the same figures then never
    choose a smaller default tree, and some step costs choose a larger one."""
    from draftheads.decoding.policy import best_budget, expected_tau_scale

    trees = {"1": [[0]], "3": [[0], [1], [0, 0]]}
    config = dict(num_heads=2, hidden_size=32, vocab_size=96, trees=trees, expected_tau={"1": 1.4, "3": 1.7})
    held_out, dev = MedusaHeads(HeadConfig(**config)), MedusaHeads(HeadConfig(**config, expected_tau_on="dev"))
    assert (expected_tau_scale(held_out), expected_tau_scale(dev)) == (0.75, 1.0)
    picks = []
    for per_node in (0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0):
        cost = synthetic_cost(lambda b, q, c: 20.0 + per_node * b * q)
        picks.append(tuple(best_budget(h, cost, 1, 256, expected_tau_scale(h))[0].budget for h in (held_out, dev)))
    assert all(d >= h for h, d in picks) and any(d > h for h, d in picks), picks
    with pytest.raises(ValueError, match=r"expected_tau_on must be one of \['dev', 'held_out'\], got 'mt_bench'"):
        HeadConfig(**config, expected_tau_on="mt_bench")


def test_resolve_tree_arguments():
    assert resolve_tree("adaptive", None, None).num_nodes == 1  # no heads: plain decoding
    assert resolve_tree("0", None, None).num_nodes == 1
    with pytest.raises(ValueError, match="expected 'adaptive' or a node budget"):
        resolve_tree("big", None, None)


# -- calibration -----------------------------------------------------------------------------
def test_calibration_is_cached_per_model_dtype_and_heads(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    model = tiny_llama(0, max_pos=64)
    heads = tiny_heads()
    heads.bind(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    cost = calibrate(model, heads, TINY_GRID)
    key = calibration_key(model, heads)
    path = calibration_path(key, TINY_GRID)
    assert path.parent == tmp_path / "calibration" and path.is_file()
    stored = json.loads(path.read_text())
    assert stored["meta"]["key"] == key and key["dtype"] == "torch.float64"
    assert {(r["bs"], r["q"], r["ctx"]) for r in stored["rows"]} == {
        (b, q, c) for b in (1, 2) for q in (1, 2, 4) for c in (8, 16) if q <= 2 or b * q <= 4}
    assert {(r["bs"], r["budget"]) for r in stored["draft_rows"]} == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert all(r["ms"] > 0 for r in stored["rows"] + stored["draft_rows"] + stored["overhead_rows"])

    def no_measuring(*_args, **_kwargs):
        raise AssertionError("a cached calibration was measured again")

    monkeypatch.setattr("draftheads.decoding.calibration.run_calibration", no_measuring)
    again = calibrate(model, heads, TINY_GRID)
    assert again.step_ms(2, 3, 12, 3) == pytest.approx(cost.step_ms(2, 3, 12, 3), rel=1e-3)
    # another dtype (or other heads, or another grid) is another entry
    assert calibration_path(calibration_key(model.float(), heads), TINY_GRID) != path
    assert calibration_path(calibration_key(model, None), TINY_GRID) != path


# -- decoding with the adaptive policy -------------------------------------------------------
def chaotic_llama(seed: int = 0) -> "torch.nn.Module":
    """conftest's tiny Llama with larger initial weights: the default (0.02) one mostly repeats
    its last token, this one writes varied text and emits EOS (id 2) at different steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         initializer_range=0.3, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(torch.float64).eval().requires_grad_(False)
    model.generation_config.pad_token_id = 0
    return model


MODEL = chaotic_llama(0)
PAD = 0


def batch_sensitive_policy() -> AdaptivePolicy:
    """Big tree alone, a small one for 2-3 rows, plain decoding for 4+ rows."""
    trees = {1: tree_from_paths([[0]]), 4: tree_from_paths([[0], [1], [0, 0], [0, 0, 0]]),
             9: tree_from_paths([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0, 0]])}
    cost = synthetic_cost(lambda b, q, c: 10.0 + 4.0 * max(0, b * q - 10) + 3.0 * (b - 1) * (q - 1),
                          batch_sizes=(1, 2, 4, 8), qs=(1, 2, 5, 10), kv_len=(8, 64))
    cands = [Candidate(0, chain_tree(0), 1.0), Candidate(1, trees[1], 1.5), Candidate(4, trees[4], 2.2),
             Candidate(9, trees[9], 2.9)]
    return AdaptivePolicy(cands, cost)


@pytest.mark.parametrize("case,finished_rows", [(0, "shrink"), (1, "shrink"), (0, "mask")])
def test_adaptive_decoding_matches_hf_batched_greedy(case, finished_rows):
    gen = torch.Generator().manual_seed(case)
    prompts = [torch.randint(3, 96, (int(n),), generator=gen).tolist() for n in torch.randint(1, 9, (5,), generator=gen)]
    ids, mask = left_pad(prompts)
    free = MODEL.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    continuations = free[:, ids.shape[1]:].tolist()
    firsts = {row[0] for row in continuations}
    eos = [2] + [t for t in continuations[case % 5][3 + case:] if t not in firsts][:1]  # rows end at different steps
    # delegate_plain off: keep 5 rows in the loop, the tree must change as the batch shrinks
    policy = batch_sensitive_policy()
    for rows in (slice(0, 5), slice(4, 5)):  # the batch, then its last row alone
        drafter = DraftHeadsModel(MODEL, OracleHeads(continuations[rows], vocab=96, error=0.2, seed=case),
                                  tree=policy, finished_rows=finished_rows, delegate_plain=False)
        sub_mask = mask[rows][:, mask[rows].any(0)]
        sub_ids = ids[rows][:, mask[rows].any(0)]
        reference = MODEL.generate(sub_ids, attention_mask=sub_mask, max_new_tokens=20, do_sample=False,
                                   pad_token_id=PAD, eos_token_id=eos)
        ours = drafter.generate(sub_ids, attention_mask=sub_mask, max_new_tokens=20, pad_token_id=PAD,
                                eos_token_id=eos)
        assert ours.tolist() == reference.tolist()
        chosen = drafter.last_stats.trees_by_batch_size()  # {rows verified: {tree slots: steps}}
        assert all(set(nodes) == {1} for live, nodes in chosen.items() if live >= 3)  # plain when crowded
        assert all(set(nodes) <= {1, 2} for live, nodes in chosen.items() if live == 2)  # 1-node tree for two
        if 1 in chosen:
            assert max(chosen[1]) == 10  # alone: the 9-node tree (10 slots)
    assert max(drafter.last_stats.tree_nodes) == 10 and drafter.last_stats.tau > 1.5


def test_plain_choice_hands_the_batch_to_the_base_generate():
    """5 rows: the policy prefers plain decoding, so the base's own generate runs (same tokens,
    same output type, stats say so); 1 row: it speculates in the loop; a torch.Generator
    (seeded sampling only the loop provides) keeps the call in the loop."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (int(n),), generator=gen).tolist() for n in (3, 7, 5, 2, 6)]
    ids, mask = left_pad(prompts)
    reference = MODEL.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD,
                               return_dict_in_generate=True, output_scores=True)
    assert not DraftHeadsModel(MODEL, None).decoding.delegate_plain  # off by default: the loop drops finished rows
    heads = OracleHeads(reference.sequences[:, ids.shape[1]:].tolist(), vocab=96, error=0.0, seed=0)
    drafter = DraftHeadsModel(MODEL, heads, tree=batch_sensitive_policy(), delegate_plain=True)
    ours = drafter.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=PAD,
                            return_dict_in_generate=True, output_scores=True)
    assert isinstance(ours, GenerateDecoderOnlyOutput) and ours.sequences.tolist() == reference.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, reference.scores))
    stats = drafter.last_stats
    assert stats.delegated and stats.tau == 1.0 and set(stats.tree_nodes) == {1}
    # the prefill is timed there too (a logits processor that notes the first call, scores untouched above)
    assert 0 < stats.prefill_seconds < stats.seconds and stats.first_tokens == 5
    assert stats.new_tokens == sum(16 if 2 not in row else row.index(2) + 1
                                   for row in reference.sequences[:, ids.shape[1]:].tolist())
    alone = drafter.generate(ids[4:, -6:], attention_mask=mask[4:, -6:], max_new_tokens=16, pad_token_id=PAD)
    assert not drafter.last_stats.delegated and max(drafter.last_stats.tree_nodes) == 10
    loop = drafter.last_stats
    assert 0 < loop.prefill_seconds < loop.seconds and loop.first_tokens == 1
    assert loop.decode_tokens_per_second == pytest.approx((loop.new_tokens - 1) / (loop.seconds - loop.prefill_seconds))
    assert alone.tolist() == MODEL.generate(ids[4:, -6:], attention_mask=mask[4:, -6:], max_new_tokens=16,
                                            do_sample=False, pad_token_id=PAD).tolist()
    drafter.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD, do_sample=True,
                     generator=torch.Generator().manual_seed(0))
    assert not drafter.last_stats.delegated


def test_from_pretrained_adaptive_uses_the_calibrated_policy(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    model = tiny_llama(0, max_pos=64)
    heads = tiny_heads()
    heads.bind(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    policy = resolve_tree("adaptive", model, heads, TINY_GRID)
    assert isinstance(policy, AdaptivePolicy) and [c.budget for c in policy.candidates] == [0, 1, 3]
    assert any((tmp_path / "calibration").iterdir())
    drafter = DraftHeadsModel(model, heads, tree=policy)
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = (ids != 0).long()
    out = drafter.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    assert out.tolist() == model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                          pad_token_id=0).tolist()
    assert isinstance(DraftHeadsModel(model, heads, tree=resolve_tree(3, model, heads)).policy, FixedTree)


def test_cli_tree_and_batch_size_arguments():
    from draftheads.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "--prompts", "x.jsonl", "--tree", "adaptive", "--batch-sizes", "1,2,4",
                              "--budgets", "0,4"])
    assert args.tree == "adaptive" and args.batch_sizes == [1, 2, 4] and args.budgets == [0, 4]
    assert parser.parse_args(["generate", "--prompt", "hi", "--tree", "8"]).tree == 8
    from draftheads.cli.bench_command import batches_per_size

    assert batches_per_size([1, 4, 32], [2]) == {1: 2, 4: 2, 32: 2}
    assert batches_per_size([1, 4, 32], [6, 4, 1]) == {1: 6, 4: 4, 32: 1}
    for bad in ([6, 4], [2, 0, 1]):
        with pytest.raises(InputError, match="--max-batches needs one positive number or one per batch size"):
            batches_per_size([1, 4, 32], bad)
    for bad in (["--tree", "huge"], ["--batch-sizes", "1,x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "--prompts", "x.jsonl", *bad])


def test_batched_bench_rotates_strategies_and_keeps_the_fastest_repeat():
    from draftheads.bench import keep_fastest, rotated

    names = ["hf", "fixed:0", "adaptive"]
    assert [rotated(names, k)[0] for k in range(4)] == ["hf", "fixed:0", "adaptive", "hf"]
    assert sorted(rotated(names, 2)) == sorted(names)
    best: dict = {}
    for result in (("first", 2.0), ("second", 1.5), ("third", 1.7)):
        keep_fastest(best, "hf", result)
    assert best == {"hf": ("second", 1.5)}


def test_monotone_envelope_removes_spikes_from_other_jobs():
    from draftheads.decoding.calibration import monotone_envelope

    rows = [{"bs": 1, "q": q, "ctx": 64, "ms": ms} for q, ms in [(1, 50.0), (2, 600.0), (4, 70.0)]]
    rows += [{"bs": 2, "q": 1, "ctx": 64, "ms": 55.0}, {"bs": 2, "q": 4, "ctx": 64, "ms": 90.0}]
    smooth = {(r["bs"], r["q"]): r["ms"] for r in monotone_envelope(rows)}
    assert smooth == {(1, 1): 50.0, (1, 2): 70.0, (1, 4): 70.0, (2, 1): 55.0, (2, 4): 90.0}
