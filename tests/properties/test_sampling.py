"""Sampling with draft trees: the output is distributed exactly as the base's own sampling.

The statistical tests use a tiny Llama with a 12-token vocabulary, so the base's processed
distribution over the first K = 3 generated tokens can be enumerated exactly (1 + 12 + 144
prefixes). A batch of 20,000 identical rows is decoded through the acceptance function with
those exact per-node probabilities (prefill sample, then tree steps until K tokens) and the
empirical K-token distribution is compared with the exact one by Pearson's χ² test (cells with an
expected count < 10 pooled). A smaller end-to-end ``generate()`` run checks the wiring, and
deliberately broken rules show that the same test fails.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig, set_seed

from helpers import OracleHeads, force_plan, left_pad, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.accept import lossless_accept, sample_from, typical_accept
from draftheads.decoding.processors import NodeProcessors
from draftheads.heads import HeadConfig, HydraHeads, MedusaHeads

VOCAB = 12
K = 3
DRAWS = 20_000
PROMPT = [3, 7, 5, 9]
MODEL = tiny_llama(seed=4, vocab=VOCAB)
DRAFTER = tiny_llama(seed=5, vocab=VOCAB)  # a different model: imperfect, realistic drafts

TREES = {
    "d1w1": [(0,)],
    "d1w4": [(0,), (1,), (2,), (3,)],
    "d2w2": [(0,), (1,), (0, 0), (0, 1), (1, 0)],
    "d3w1": [(0,), (0, 0), (0, 0, 0)],
    "d3w3": [(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)],
    "d3w4": [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1),
             (0, 0, 2), (0, 0, 3), (1, 0, 0)],
}
CONFIGS = {
    "T0.5": dict(temperature=0.5),
    "T1.0": dict(temperature=1.0),
    "T0.5-topk5-topp0.8": dict(temperature=0.5, top_k=5, top_p=0.8),
    "T1.0-topk4-topp0.9": dict(temperature=1.0, top_k=4, top_p=0.9),
    "T1.0-penalty1.5": dict(temperature=1.0, repetition_penalty=1.5),
}


# -- exact distributions ------------------------------------------------------------------------
def offsets() -> list[int]:
    """Context id of a prefix of length l (< K) = offsets[l] + its base-VOCAB code; id
    offsets[K] = "K or more tokens" (never scored)."""
    out = [0]
    for length in range(K):
        out.append(out[-1] + VOCAB ** length)
    return out


OFFSETS = offsets()
BEYOND = OFFSETS[K]


def context_table(model, config: GenerationConfig) -> torch.Tensor:
    """(contexts + 1, V) the model's processed next-token distribution after the prompt +
    every prefix of fewer than K tokens (last row: uniform, for contexts beyond K)."""
    processors = NodeProcessors(model._get_logits_processor(config, input_ids_seq_length=len(PROMPT), device="cpu"))
    rows = []
    for length in range(K):
        prefixes = torch.cartesian_prod(*[torch.arange(VOCAB)] * length).reshape(-1, length) if length else \
            torch.zeros(1, 0, dtype=torch.long)
        ids = torch.cat([torch.tensor([PROMPT]).expand(prefixes.shape[0], -1), prefixes], dim=1)
        with torch.no_grad():
            logits = model(ids).logits[:, -1]
        scores = processors(ids, logits.float())
        rows.append(scores.double().softmax(-1))
    rows.append(torch.full((1, VOCAB), 1.0 / VOCAB, dtype=torch.float64))
    return torch.cat(rows)


OFFSETS_T = torch.tensor(OFFSETS)


def extend(context: torch.Tensor, length: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Context id after appending ``token`` to a prefix of ``length`` tokens."""
    new_length = (length + 1).clamp(max=K)
    child = OFFSETS_T[new_length] + (context - OFFSETS_T[new_length - 1]) * VOCAB + token
    return torch.where(new_length < K, child, BEYOND)


def exact_joint(table: torch.Tensor) -> torch.Tensor:
    """(V^K,) exact probability of every K-token continuation (first token most significant)."""
    joint = table[0]
    for length in range(1, K):
        prefixes = torch.cartesian_prod(*[torch.arange(VOCAB)] * length).reshape(-1, length)
        code = (prefixes * VOCAB ** torch.arange(length - 1, -1, -1)).sum(1)
        joint = (joint[:, None] * table[OFFSETS[length] + code]).reshape(-1)
    return joint


def chi2_test(samples: torch.Tensor, probs: torch.Tensor, min_expected: float = 10.0) -> float:
    """p-value of Pearson's χ² test of ``samples`` (codes) against ``probs``. Cells expecting
    fewer than 10 draws are pooled into one: with 1,728 cells a G-test pooled at 5 was
    anti-conservative here (4.5 % of exact multinomial draws below p = 0.01), Pearson pooled at
    10 was not (0.5–3 % over 200 draws). A sample in a zero-probability cell gives 0."""
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    if bool(((probs == 0) & (observed > 0)).any()):
        return 0.0
    expected = probs * observed.sum()
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 1e-9
    obs, exp = obs[keep], exp[keep]
    assert obs.numel() >= 2, "too few draws for a χ² test: every cell expects < 10"
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


# -- the vectorized decoder over exact tables ---------------------------------------------------
def draft_tokens(kind: str, drafts: torch.Tensor, noise: torch.Tensor, context: torch.Tensor, root_context: torch.Tensor,
                 depth: int, rank: int) -> torch.Tensor:
    """A child's token, a fixed function of its context (never of the acceptance uniforms):
    "path": the drafter's rank-th choice at the node's own context (Hydra-like);
    "cartesian": a fixed random table indexed by the root context, depth and rank (Medusa-like;
    tokens may repeat among siblings and fall outside top-k/top-p)."""
    if kind == "path":
        return drafts[context, rank]
    return noise[root_context, depth - 1, rank]


def first_tokens(table: torch.Tensor, draws: int, gen: torch.Generator):
    """The prefill sample of every row: (out (draws, K) with column 0 filled, count (draws,) = 1,
    each row's context id after it)."""
    out = torch.zeros(draws, K, dtype=torch.long)
    first = sample_from(table[torch.zeros(draws, dtype=torch.long)], torch.rand(draws, generator=gen, dtype=torch.float64))
    out[:, 0] = first
    zeros = torch.zeros(draws, dtype=torch.long)
    return out, torch.ones(draws, dtype=torch.long), extend(zeros, zeros, first)


def decode_exact(table: torch.Tensor, paths, kind: str, rule, draws: int = DRAWS, seed: int = 0) -> torch.Tensor:
    """Decode ``draws`` identical rows: the first token sampled from p after the prompt, then
    tree steps (children drafted by ``kind``, verified by ``rule`` against exact per-node
    probabilities) until every row has K tokens. Returns each row's K tokens as one code."""
    gen = torch.Generator().manual_seed(seed)
    tree = tree_from_paths(paths)
    drafts = draft_table().topk(4, dim=-1).indices
    noise = torch.randint(0, VOCAB, (table.shape[0], 3, 4), generator=torch.Generator().manual_seed(99))
    rows = torch.arange(draws)
    out, count, context = first_tokens(table, draws, gen)
    while bool((count < K).any()):
        nodes = tree.num_nodes
        tokens = torch.zeros(draws, nodes, dtype=torch.long)
        tokens[:, 0] = out[rows, count - 1]
        ctx = torch.zeros(draws, nodes, dtype=torch.long)
        ctx[:, 0] = context
        for n in range(1, nodes):
            up, d, r = int(tree.parent[n]), int(tree.depth[n]), int(tree.rank[n])
            tokens[:, n] = draft_tokens(kind, drafts, noise, ctx[:, up], context, d, r)
            ctx[:, n] = extend(ctx[:, up], (count + d - 1), tokens[:, n])
        result = rule(tokens, table[ctx], tree, gen)
        emitted = torch.cat([tokens.gather(1, result.path[:, 1:]), result.bonus[:, None]], dim=1)
        emitted[rows, result.accepted] = result.bonus  # accepted path, then the bonus
        emitted_count = result.accepted + 1
        for i in range(emitted.shape[1]):
            take = (i < emitted_count) & (count < K)
            out[rows[take], count[take]] = emitted[take, i]
            context = torch.where(take, extend(context, count, emitted[:, i]), context)
            count = count + take.long()
    return (out * VOCAB ** torch.arange(K - 1, -1, -1)).sum(1)


def uniforms(tree, batch: int, gen: torch.Generator):
    """(B, D+1): one uniform per position a step may emit."""
    return torch.rand(batch, tree.path_slots.shape[1], generator=gen, dtype=torch.float64)


def lossless(tokens, probs, tree, gen):
    return lossless_accept(tokens, probs, tree.parent, tree.depth, tree.path_slots, uniforms(tree, tokens.shape[0], gen))


def broken_accept_always(tokens, probs, tree, gen):
    """Every draw with the uniform 0 (the first token of any probability: no randomness left)."""
    u = uniforms(tree, tokens.shape[0], gen)
    return lossless_accept(tokens, probs, tree.parent, tree.depth, tree.path_slots, torch.zeros_like(u))


def broken_bonus_from_full_p(tokens, probs, tree, gen):
    """Right acceptance, but the bonus after rejections is sampled from p instead of the residual."""
    result = lossless(tokens, probs, tree, gen)
    rows = torch.arange(tokens.shape[0])
    result.bonus = sample_from(probs[rows, result.best], torch.rand(tokens.shape[0], generator=gen, dtype=torch.float64))
    return result


def typical(tokens, probs, tree, gen):
    return typical_accept(tokens, probs, tree.parent, tree.depth, tree.path_slots,
                          torch.rand(tokens.shape[0], generator=gen, dtype=torch.float64))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Single-threaded torch for this module: these are many small ops, and on a shared 2-core
    machine two threads per op were measured 10–30× slower than one. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Tables(dict):
    """Exact tables per configuration, computed on first use (inside the one-thread fixture)."""

    def __missing__(self, name: str) -> torch.Tensor:
        self[name] = context_table(MODEL, GenerationConfig(do_sample=True, **CONFIGS[name]))
        return self[name]


TABLES = _Tables()
DRAFT_TABLE = None  # the drafter's table, filled on first use by draft_table()


def draft_table() -> torch.Tensor:
    global DRAFT_TABLE
    if DRAFT_TABLE is None:
        DRAFT_TABLE = context_table(DRAFTER, GenerationConfig(do_sample=True, temperature=0.7))
    return DRAFT_TABLE


# Every tree × every configuration (30 cases × 20,000 draws), the drafting scheme alternating.
CASES = [(tree, config, "path" if (i + j) % 2 == 0 else "cartesian")
         for i, tree in enumerate(TREES) for j, config in enumerate(CONFIGS)]


@pytest.mark.parametrize("tree_name,config_name,kind", CASES)
def test_tree_sampling_is_lossless(tree_name, config_name, kind):
    table = TABLES[config_name]
    samples = decode_exact(table, TREES[tree_name], kind, lossless, seed=CASES.index((tree_name, config_name, kind)))
    p = chi2_test(samples, exact_joint(table))
    assert p > 0.01, f"χ² p = {p:.2e}: the tree sampler does not reproduce the base's distribution"


@pytest.mark.parametrize("tree_name,config_name,kind", [
    ("d1w1", "T1.0", "path"), ("d1w4", "T0.5-topk5-topp0.8", "path"), ("d2w2", "T1.0-penalty1.5", "cartesian"),
    ("d3w4", "T0.5", "path")])
def test_broken_rules_are_detected(tree_name, config_name, kind):
    """The same test rejects a rule that accepts every drafted token in the support, and one
    that samples the bonus from p instead of the residual (a subtler bug)."""
    table = TABLES[config_name]
    exact = exact_joint(table)
    assert chi2_test(decode_exact(table, TREES[tree_name], kind, broken_accept_always), exact) < 1e-6
    assert chi2_test(decode_exact(table, TREES[tree_name], kind, broken_bonus_from_full_p), exact) < 1e-3


def test_typical_acceptance_is_lossy_and_accepts_more():
    """Typical acceptance changes the distribution (the test detects it) but accepts longer paths."""
    table = TABLES["T1.0"]
    exact = exact_joint(table)
    assert chi2_test(decode_exact(table, TREES["d3w3"], "path", typical), exact) < 1e-6


def test_typical_rule_semantics():
    """Deepest accepted node wins; ties go to the higher path likelihood; threshold is
    min(ε, δ·exp(−H)) at the parent."""
    probs = torch.zeros(1, 4, 4, dtype=torch.float64)
    probs[0, 0] = torch.tensor([0.5, 0.3, 0.15, 0.05])  # root: children tokens 1 (p .3) and 2 (p .15)
    probs[0, 1] = torch.tensor([0.97, 0.01, 0.01, 0.01])  # below node 1: token 3 has p .01 < threshold
    probs[0, 2] = torch.tensor([0.25, 0.25, 0.25, 0.25])
    probs[0, 3] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    tree = tree_from_paths([(0,), (1,), (0, 0)])
    tokens = torch.tensor([[0, 1, 2, 3]])
    result = typical_accept(tokens, probs, tree.parent, tree.depth, tree.path_slots, torch.tensor([0.5]))
    assert result.accepted.tolist() == [1] and result.best.tolist() == [1]  # .3 beats .15 at equal depth
    tokens = torch.tensor([[0, 1, 2, 0]])  # node 3 now carries p .97 → depth 2 accepted
    result = typical_accept(tokens, probs, tree.parent, tree.depth, tree.path_slots, torch.tensor([0.5]))
    assert result.accepted.tolist() == [2] and result.bonus.tolist() == [0]
    strict = typical_accept(tokens, probs, tree.parent, tree.depth, tree.path_slots, torch.tensor([0.5]),
                            epsilon=0.99, delta=10.0)  # threshold .99 at every node: nothing accepted
    assert strict.accepted.tolist() == [0]


# -- generate(): the wiring --------------------------------------------------------------------
def random_heads(family: str, seed: int = 0, trees: dict | None = None):
    """``trees``: stored trees (budget → paths), from which a budget's dynamic tree is drawn."""
    torch.manual_seed(seed)
    cls = {"medusa": MedusaHeads, "hydra": HydraHeads}[family]
    heads = cls(HeadConfig(family=family, num_heads=3, hidden_size=32, vocab_size=VOCAB, trees=trees or {},
                           expected_tau={b: 1.5 for b in trees or {}})).to(torch.float64)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return heads


@pytest.mark.parametrize("family,config_name,paths", [
    ("medusa", "T0.5-topk5-topp0.8", TREES["d2w2"]), ("hydra", "T1.0-penalty1.5", TREES["d3w3"])])
def test_generate_end_to_end_matches_exact_distribution(family, config_name, paths):
    """generate() on a batch of identical rows: the first K tokens follow the exact distribution
    (tested as the pairs (t1, t2) and (t2, t3): 144 cells each, enough for 2,000 draws)."""
    rows = 2000
    drafter = DraftHeadsModel(MODEL, random_heads(family), tree=tree_from_paths(paths))
    ids = torch.tensor([PROMPT] * rows)
    out = drafter.generate(ids, max_new_tokens=K + 1, do_sample=True, generator=torch.Generator().manual_seed(7),
                           eos_token_id=None, **CONFIGS[config_name])
    assert drafter.last_stats.tau > 1.0  # the trees were really used
    new = out[:, len(PROMPT): len(PROMPT) + K]
    joint = exact_joint(TABLES[config_name]).view(VOCAB, VOCAB, VOCAB)
    assert chi2_test(new[:, 0] * VOCAB + new[:, 1], joint.sum(2).flatten()) > 0.01
    assert chi2_test(new[:, 1] * VOCAB + new[:, 2], joint.sum(0).flatten()) > 0.01


def test_sampling_through_the_body_in_one_call_matches_exact_distribution(monkeypatch, tmp_path):
    """The same on the float32 fast path: every product through the few-row kernel and each tree step's
    body in one library call (decoding/base/body_call.py); the rounding it adds is float32's, far below
    what 2,000 draws can see."""
    from draftheads.decoding.base import direct, fewrow

    if not fewrow.load_kernel(tmp_path / "kernels"):
        pytest.skip(f"the few-row kernel is off here ({fewrow.kernel_status()})")
    model = copy.deepcopy(MODEL).float()
    force_plan(model, monkeypatch)
    calls = []
    real = direct.run_body
    monkeypatch.setattr(direct, "run_body", lambda *args: calls.append(args[4]) or real(*args))
    rows = 2000
    drafter = DraftHeadsModel(model, random_heads("hydra").float(), tree=tree_from_paths(TREES["d3w3"]))
    out = drafter.generate(torch.tensor([PROMPT] * rows), max_new_tokens=K + 1, do_sample=True,
                           generator=torch.Generator().manual_seed(5), eos_token_id=None, **CONFIGS["T1.0-penalty1.5"])
    assert calls and drafter.last_stats.tau > 1.0  # the one call ran, with the trees
    new = out[:, len(PROMPT): len(PROMPT) + K]
    joint = exact_joint(TABLES["T1.0-penalty1.5"]).view(VOCAB, VOCAB, VOCAB)
    assert chi2_test(new[:, 0] * VOCAB + new[:, 1], joint.sum(2).flatten()) > 0.01
    assert chi2_test(new[:, 1] * VOCAB + new[:, 2], joint.sum(0).flatten()) > 0.01


def test_dynamic_trees_match_exact_distribution():
    """The heads alone on dynamic trees (each row its own best 2 nodes of the stored 8-node tree,
    :class:`~draftheads.decoding.drafters.HeadsDrafter`): sampling still follows the exact
    distribution."""
    rows = 2000
    stored = {"2": [[0], [0, 0]], "8": [list(p) for p in TREES["d3w3"][:8]]}
    drafter = DraftHeadsModel(MODEL, random_heads("hydra", seed=3, trees=stored), tree=2, heads_offer_scale=4)
    ids = torch.tensor([PROMPT] * rows)
    out = drafter.generate(ids, max_new_tokens=K + 1, do_sample=True, generator=torch.Generator().manual_seed(11),
                           eos_token_id=None, **CONFIGS["T1.0-topk4-topp0.9"])
    assert drafter.drafter.offer is not None and drafter.drafter.hitrate.proposed.sum() > 0
    assert drafter.last_stats.tau > 1.0
    new = out[:, len(PROMPT): len(PROMPT) + K]
    joint = exact_joint(TABLES["T1.0-topk4-topp0.9"]).view(VOCAB, VOCAB, VOCAB)
    assert chi2_test(new[:, 0] * VOCAB + new[:, 1], joint.sum(2).flatten()) > 0.01
    assert chi2_test(new[:, 1] * VOCAB + new[:, 2], joint.sum(0).flatten()) > 0.01


def test_greedy_with_repetition_penalty_matches_transformers():
    """Greedy + repetition penalty (the penalty sees each node's own drafted path), batched."""
    model = tiny_llama(seed=1)
    ids, mask = left_pad([[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]])
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, repetition_penalty=1.3,
                               pad_token_id=0)
    heads = OracleHeads(reference[:, ids.shape[1]:].tolist(), vocab=96, error=0.2, seed=2)
    drafter = DraftHeadsModel(model, heads, tree=tree_from_paths([(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]))
    ours = drafter.generate(ids, attention_mask=mask, max_new_tokens=24, repetition_penalty=1.3, pad_token_id=0)
    assert ours.tolist() == reference.tolist()
    assert drafter.last_stats.tau > 1.5


def test_seeded_sampling_is_reproducible():
    drafter = DraftHeadsModel(MODEL, random_heads("medusa"), tree=tree_from_paths(TREES["d2w2"]))
    ids, mask = left_pad([PROMPT, PROMPT])
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=True, temperature=0.8, top_p=0.95,
                  eos_token_id=None)
    a = drafter.generate(ids, generator=torch.Generator().manual_seed(3), **kwargs)
    b = drafter.generate(ids, generator=torch.Generator().manual_seed(3), **kwargs)
    c = drafter.generate(ids, generator=torch.Generator().manual_seed(4), **kwargs)
    set_seed(11)
    d = drafter.generate(ids, **kwargs)
    set_seed(11)
    e = drafter.generate(ids, **kwargs)
    f = drafter.generate(ids, **kwargs)  # no reseed: the global RNG moved on
    assert torch.equal(a, b) and torch.equal(d, e)
    assert not torch.equal(a, c) and not torch.equal(e, f)
    assert not torch.equal(a[0], a[1])  # identical prompts: each row draws its own randomness


@pytest.mark.parametrize("acceptance", ["lossless", "typical"])
def test_batched_sampling_stops_each_row_at_its_eos(acceptance):
    model = tiny_llama(seed=2)
    drafter = DraftHeadsModel(model, OracleHeads([[]] * 6, vocab=96, error=1.0), tree=tree_from_paths(TREES["d3w3"]))
    ids, mask = left_pad([[5, 6, 7], [8, 9, 10, 11], [14], [20, 21], [30, 31, 32, 33, 34], [40]])
    eos = 17
    free = drafter.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=True, eos_token_id=None,
                            generator=torch.Generator().manual_seed(0), acceptance=acceptance, pad_token_id=0)
    # with a flat random tiny model some token is frequent; make it the EOS of a second run
    eos = int(torch.mode(free[:, ids.shape[1]:].flatten()).values)
    out = drafter.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=True, eos_token_id=eos,
                           generator=torch.Generator().manual_seed(1), acceptance=acceptance, pad_token_id=0)
    new = out[:, ids.shape[1]:]
    stopped = 0
    for row in new.tolist():
        if eos in row:
            end = row.index(eos) + 1
            assert all(t == 0 for t in row[end:]), row  # nothing after the row's own EOS but padding
            stopped += 1
        else:
            assert len(row) == 40
    assert 0 < stopped
    assert new.shape[1] <= 40


def test_typical_needs_do_sample():
    drafter = DraftHeadsModel(MODEL, random_heads("medusa"), tree=tree_from_paths(TREES["d1w1"]))
    with pytest.raises(ValueError, match="pass do_sample=True"):
        drafter.generate(torch.tensor([PROMPT]), max_new_tokens=3, acceptance="typical")
    with pytest.raises(ValueError, match="acceptance='fast' is unknown"):
        drafter.generate(torch.tensor([PROMPT]), max_new_tokens=3, do_sample=True, acceptance="fast")


def test_output_scores_are_the_processed_scores():
    """As transformers: ``scores`` are the processed scores (top-k leaves 3 finite entries per
    step) and every sampled token is one of them; ``logits`` stay raw."""
    drafter = DraftHeadsModel(MODEL, random_heads("hydra"), tree=tree_from_paths(TREES["d3w3"]))
    ids = torch.tensor([PROMPT] * 4)
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=3, temperature=0.9, eos_token_id=None,
                  return_dict_in_generate=True, generator=torch.Generator().manual_seed(5))
    out = drafter.generate(ids, output_scores=True, **kwargs)
    assert len(out.scores) == 12
    for step, scores in enumerate(out.scores):
        assert (scores.isfinite().sum(-1) == 3).all()
        assert scores.isfinite().gather(1, out.sequences[:, len(PROMPT) + step, None]).all()
    raw = drafter.generate(ids, output_logits=True, **kwargs).logits
    assert all(bool(step.isfinite().all()) for step in raw)


# -- per-row trees mixing head drafts and lookup chains -------------------------------------------
# Four shapes of different node counts, as per-row counts under one batch budget give them: three
# head trees plus a lookup chain (rank 5 marks the chain's nodes) and the root alone (a row given
# one node: a plain step beside drafting rows); every row verifies the shape its current context
# picks, padded to a common width as the loop does.
MIXED = [TREES["d2w2"] + [(5,), (5, 0), (5, 0, 0)], TREES["d1w4"] + [(5,), (5, 0)],
         [(0,), (0, 0), (1,), (5,), (5, 0), (5, 0, 0)], []]


def mixed_shapes():
    """One padded StepTrees with a row per shape (its tables are indexed by each draw's shape)."""
    from draftheads.decoding.step_trees import StepTrees

    trees_ = [tree_from_paths(paths) for paths in MIXED]
    parents = [(t.parent[1:] - 1).tolist() for t in trees_]
    return trees_, StepTrees.from_rows(torch.zeros(len(trees_), dtype=torch.long), parents,
                                    [[0] * (t.num_nodes - 1) for t in trees_])


def decode_exact_mixed(table: torch.Tensor, rule, draws: int = DRAWS, seed: int = 0) -> torch.Tensor:
    """As :func:`decode_exact`, but each row's tree is one of ``MIXED`` (chosen by its context,
    so rows of one step differ) with padding slots, head nodes drafted "path"-style and lookup
    nodes copied from a fixed chain table keyed by the root context (point masses, as lookups)."""
    gen = torch.Generator().manual_seed(seed)
    shapes, padded = mixed_shapes()
    drafts = draft_table().topk(4, dim=-1).indices
    chains = torch.randint(0, VOCAB, (table.shape[0], 3), generator=torch.Generator().manual_seed(98))
    rows = torch.arange(draws)
    out, count, context = first_tokens(table, draws, gen)
    children = padded.children()
    nodes, width = padded.num_nodes, children.shape[-1]
    while bool((count < K).any()):
        shape = context % len(shapes)
        parent, depth, path_slots = padded.parent[shape], padded.depth[shape], padded.path_slots[shape]
        tokens = torch.zeros(draws, nodes, dtype=torch.long)
        tokens[:, 0] = out[rows, count - 1]
        ctx = torch.full((draws, nodes), BEYOND, dtype=torch.long)
        ctx[:, 0] = context
        for s, tree in enumerate(shapes):
            mine = shape == s
            for n in range(1, tree.num_nodes):
                up, d, r = int(tree.parent[n]), int(tree.depth[n]), int(tree.rank[n])
                path_ranks = tree.paths[n - 1]
                token = chains[context, d - 1] if path_ranks[0] == 5 else drafts[ctx[:, up], r]
                tokens[mine, n] = token[mine]
                ctx[mine, n] = extend(ctx[:, up], count + d - 1, token)[mine]
        result = rule(tokens, table[ctx], parent, depth, path_slots, children[shape], gen, width)
        emitted = torch.cat([tokens.gather(1, result.path[:, 1:]), result.bonus[:, None]], dim=1)
        emitted[rows, result.accepted] = result.bonus
        for i in range(emitted.shape[1]):
            take = (i < result.accepted + 1) & (count < K)
            out[rows[take], count[take]] = emitted[take, i]
            context = torch.where(take, extend(context, count, emitted[:, i]), context)
            count = count + take.long()
    return (out * VOCAB ** torch.arange(K - 1, -1, -1)).sum(1)


def lossless_rows(tokens, probs, parent, depth, path_slots, children, gen, width):
    u = torch.rand(tokens.shape[0], path_slots.shape[-1], generator=gen, dtype=torch.float64)
    return lossless_accept(tokens, probs, parent, depth, path_slots, u, children)


def broken_rows_accept_always(tokens, probs, parent, depth, path_slots, children, gen, width):
    u = torch.zeros(tokens.shape[0], path_slots.shape[-1], dtype=torch.float64)
    return lossless_accept(tokens, probs, parent, depth, path_slots, u, children)


@pytest.mark.parametrize("config_name", ["T1.0", "T0.5-topk5-topp0.8", "T1.0-penalty1.5"])
def test_mixed_per_row_trees_sampling_is_lossless(config_name):
    """Rows verify different trees (padded, ragged node counts, one row at times given the root
    alone), mixing head drafts and a lookup chain: the K-token distribution is still exactly the
    base's; accepting every drafted token is caught."""
    table = TABLES[config_name]
    exact = exact_joint(table)
    seed = list(CONFIGS).index(config_name)
    assert chi2_test(decode_exact_mixed(table, lossless_rows, seed=seed), exact) > 0.01
    assert chi2_test(decode_exact_mixed(table, broken_rows_accept_always, seed=seed), exact) < 1e-6
