"""Amphista heads: zero-init identity with the base LM head, bidirectional heads, Cartesian
tree drafting, checkpoints, option errors, and a few training steps through the trainer."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from helpers import REPO, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import REGISTRY, AmphistaHeads, AmphistaOptions, HeadConfig, build_heads, load_heads

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0], [3], [3, 0], [3, 0, 0], [3, 0, 0, 1]]


def amphista(model, num_heads: int = 4, draft_vocab: int = 0, seed: int | None = 0, **extra) -> AmphistaHeads:
    """Amphista heads bound to ``model``; with ``seed`` all weights are random (non-zero)."""
    cfg = model.config
    heads = build_heads(HeadConfig(family="amphista", num_heads=num_heads, num_layers=1, hidden_size=cfg.hidden_size,
                                   vocab_size=cfg.vocab_size, draft_vocab_size=draft_vocab, extra=extra,
                                   base_fingerprint=fingerprint(model).to_dict()))
    if seed is not None:
        torch.manual_seed(seed)
        for p in heads.parameters():
            torch.nn.init.normal_(p, std=0.3)
    if draft_vocab:
        heads.vocab_ids.copy_(torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(1))[:draft_vocab]
                              .sort().values)
    return heads.to(model.dtype).bind(model.lm_head.weight, model.get_input_embeddings().weight)


def inputs(model, rows: int = 5, width: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, model.config.hidden_size, generator=generator, dtype=model.dtype)
    return hidden, torch.randint(0, model.config.vocab_size, (rows, width), generator=generator)


def test_amphista_is_registered_for_the_family_tests():
    from helpers import FAMILIES

    assert REGISTRY["amphista"] is AmphistaHeads and "amphista" in FAMILIES
    assert not AmphistaHeads.sequential and not AmphistaHeads.contextual


@pytest.mark.parametrize("num_heads", [1, 3, 4])
@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_fresh_heads_equal_the_base_lm_head(num_heads, draft_vocab):
    model = tiny_llama(0)
    heads = amphista(model, num_heads=num_heads, draft_vocab=draft_vocab, seed=None)
    hidden, tokens = inputs(model)
    logits = heads(hidden, tokens=tokens)
    base = model.lm_head(hidden)[:, heads.vocab_ids]
    assert logits.shape == (5, num_heads, heads.max_rank)
    for k in range(num_heads):
        assert torch.allclose(logits[:, k], base, atol=1e-12, rtol=0), k
    # the same from any leading shape
    assert torch.allclose(heads(hidden[None], tokens=tokens[None])[0], logits, atol=1e-12, rtol=0)


def test_stages_feed_early_and_late_heads_and_the_root_matters():
    model = tiny_llama(0)
    heads = amphista(model, num_heads=4)
    assert heads.stage_of == [0, 0, 1, 1] and len(heads.stages) == 2
    assert amphista(model, num_heads=3).stage_of == [0, 0, 1]
    assert len(amphista(model, num_heads=1).stages) == 1
    hidden, tokens = inputs(model)
    logits = heads(hidden, tokens=tokens)
    # only the root (column 0) is read: the teacher-forced path after it is ignored
    assert torch.equal(logits, heads(hidden, tokens=tokens[:, :1]))
    other_root = tokens.clone()
    other_root[:, 0] = (tokens[:, 0] + 1) % model.config.vocab_size
    assert (heads(hidden, tokens=other_root) - logits).abs().amax(dim=-1).min() > 1e-3  # every head, every row


def test_heads_see_each_other_bidirectionally():
    """A later head's slot feeds an earlier head's output through the unmasked attention; with
    the attention's output projection zeroed (Medusa-like independent heads) it cannot."""
    model = tiny_llama(0)
    heads = amphista(model, num_heads=4)
    hidden, tokens = inputs(model)
    slots = heads.slots(hidden, tokens[:, 0])
    changed = slots.clone()
    changed[:, 3] += torch.randn_like(changed[:, 3])
    first, second = heads.head_states(slots), heads.head_states(changed)
    assert (first[:, 0] - second[:, 0]).abs().max() > 1e-3  # head 0 sees slot 3
    # end to end: head 0 reads stage 1 only, yet a change of stage 2 (the late heads') moves it
    logits = heads(hidden, tokens=tokens)
    with torch.no_grad():
        heads.stages[1].mlp.down.weight.mul_(2.0)
    assert (heads(hidden, tokens=tokens)[:, 0] - logits[:, 0]).abs().max() > 1e-3
    with torch.no_grad():
        heads.auto_embedding.attn_out.weight.zero_()
    first, second = heads.head_states(slots), heads.head_states(changed)
    assert torch.equal(first[:, :3], second[:, :3]) and not torch.equal(first[:, 3], second[:, 3])


@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_propose_takes_each_heads_top_k(draft_vocab):
    model = tiny_llama(0)
    heads = amphista(model, num_heads=4, draft_vocab=draft_vocab)
    tree = tree_from_paths(TREE)
    heads.check_tree(tree.spec)
    hidden, _ = inputs(model, rows=3)
    roots = torch.tensor([5, 17, 90])
    tokens = heads.propose(hidden, roots, tree.spec)
    assert tokens.shape == (3, tree.num_nodes) and tokens[:, 0].tolist() == roots.tolist()
    logits = heads(hidden, tokens=roots[:, None])  # teacher-forced forward with the same root
    for node in range(1, tree.num_nodes):
        depth, rank = int(tree.depth[node]), int(tree.rank[node])
        expected = heads.to_vocab(logits[:, depth - 1].topk(rank + 1, dim=-1).indices[:, rank])
        assert tokens[:, node].tolist() == expected.tolist(), node
    # a batch row's draft does not depend on the other rows
    alone = heads.propose(hidden[1:2], roots[1:2], tree.spec)
    assert torch.equal(alone, tokens[1:2])
    # a root-only tree (no drafts) and a chain work too
    assert heads.propose(hidden, roots, tree_from_paths([]).spec).tolist() == roots[:, None].tolist()
    chain = tree_from_paths([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    assert heads.propose(hidden, roots, chain.spec)[:, 1:].tolist() == heads.to_vocab(logits.argmax(-1)).tolist()


def test_checkpoint_round_trip_keeps_options_and_logits(tmp_path):
    model = tiny_llama(0)
    heads = amphista(model, num_heads=3, draft_vocab=40, attn_heads=4, mlp_size=24, gated=False)
    heads.save_pretrained(tmp_path, dtype=None)
    loaded = load_heads(tmp_path, expected_fingerprint=fingerprint(model).to_dict(), dtype=model.dtype)
    loaded.bind(model.lm_head.weight, model.get_input_embeddings().weight)
    assert isinstance(loaded, AmphistaHeads)
    assert loaded.config.options == AmphistaOptions(attn_heads=4, mlp_size=24, gated=False)
    assert json.loads((tmp_path / "config.json").read_text())["extra"] == {"attn_heads": 4, "mlp_size": 24, "gated": False}
    hidden, tokens = inputs(model)
    assert torch.equal(heads(hidden, tokens=tokens), loaded(hidden, tokens=tokens))
    assert torch.equal(heads.vocab_ids, loaded.vocab_ids)


def test_clear_errors():
    model = tiny_llama(0)
    heads = amphista(model)
    hidden, tokens = inputs(model)
    with pytest.raises(ValueError, match="root token"):
        heads(hidden)
    with pytest.raises(ValueError, match="root token"):
        heads(hidden, tokens=tokens[:, 0])  # (P,) instead of (P, ≥1)
    with pytest.raises(ValueError, match="root token"):
        heads(hidden, tokens=tokens[:, :0])
    unbound = build_heads(HeadConfig(family="amphista", num_heads=2, hidden_size=32, vocab_size=96)).double()
    unbound.bind(model.lm_head.weight)  # no embedding table
    with pytest.raises(RuntimeError, match="embed_weight"):
        unbound(hidden, tokens=tokens)
    for extra, message in [({"attn_heads": 5}, r"attn_heads=5 must divide hidden_size=32"),
                           ({"attn_heads": 0}, r"extra\.attn_heads must be a whole number ≥ 1"),
                           ({"mlp_size": "wide"}, r"extra\.mlp_size must be a whole number ≥ 1"),
                           ({"mlp_size": True}, r"extra\.mlp_size must be a whole number ≥ 1"),
                           ({"gated": "yes"}, r"extra\.gated must be true or false")]:
        with pytest.raises(ValueError, match=message):
            build_heads(HeadConfig(family="amphista", hidden_size=32, vocab_size=96, extra=extra))
    # unrelated keys (the trainer stores its recipe and accuracies there) are left alone
    build_heads(HeadConfig(family="amphista", hidden_size=32, vocab_size=96, extra={"recipe": {}}))


def test_construction_leaves_the_global_rng_alone_for_the_position_embedding():
    config = HeadConfig(family="amphista", num_heads=3, hidden_size=32, vocab_size=96)
    torch.manual_seed(0)
    first = build_heads(config).auto_embedding.position.detach().clone()
    torch.manual_seed(123)
    assert torch.equal(first, build_heads(config).auto_embedding.position)
    assert 0 < first.abs().max() < 1


def test_fresh_and_random_heads_decode_token_identically():
    model = tiny_llama(1)
    ids = torch.tensor([[0, 0, 5, 9, 33, 4], [7, 8, 9, 10, 11, 12]])
    mask = (ids != 0).long()
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    for heads in (amphista(model, seed=None), amphista(model, draft_vocab=40)):
        drafter = DraftHeadsModel(model, heads, tree=tree_from_paths(TREE))
        assert drafter.generate(ids, attention_mask=mask, max_new_tokens=24).tolist() == reference.tolist()


def test_shipped_recipe_validates():
    from draftheads.training.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / "amphista-smollm2.yaml")
    assert recipe.name == "amphista-smollm2" and recipe.heads.family == "amphista"
    build_heads(HeadConfig(family="amphista", num_heads=recipe.heads.num_heads, num_layers=recipe.heads.num_layers,
                           hidden_size=576, vocab_size=49152, draft_vocab_size=recipe.heads.draft_vocab_size,
                           extra=dict(recipe.heads.extra)))


# -- the trainer on a tiny model ------------------------------------------------------------------------
def test_trainer_fits_amphista_on_a_tiny_model(tmp_path):
    """A few epochs on a tiny Llama's own greedy continuations: the loss falls, and the saved
    heads load for that base and decode token-identically."""
    from accelerate.state import AcceleratorState

    from draftheads.training.recipe import load_recipe
    from draftheads.training.train import train

    model = tiny_llama(0, dtype=torch.float64)
    model.save_pretrained(tmp_path / "base")
    prompts = torch.randint(3, 96, (48, 4), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=20, do_sample=False,
                         min_new_tokens=20)
    with open(tmp_path / "tokens.jsonl", "w") as handle:
        for row in out.tolist():
            handle.write(json.dumps({"input_ids": row, "response_start": 4}) + "\n")
    recipe = {
        "name": "tiny-amphista", "base": str(tmp_path / "base"), "base_dtype": "float64",
        "heads": {"family": "amphista", "num_heads": 3, "num_layers": 1, "draft_vocab_size": 0,
                  "extra": {"attn_heads": 2}},
        "data": {"kind": "tokens", "path": str(tmp_path / "tokens.jsonl"), "features_dir": str(tmp_path / "features"),
                 "eval_examples": 8, "max_length": 64},
        "loss": {"labels": "teacher", "ce_weight": 1.0, "kl_weight": 0.0, "head_decay": 0.8, "noise_alpha": 0.0},
        "train": {"epochs": 3, "batch_size": 64, "lr": 0.01, "mixed_precision": "no", "dtype": "float64"},
        "run": {"output_dir": str(tmp_path / "run"), "checkpoint_every": 1000, "eval_every": 1000, "log_every": 1,
                "wandb": False, "save_dtype": "float64", "tree_budgets": [3]},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    AcceleratorState._reset_state(True)
    report = train(load_recipe(tmp_path / "recipe.yaml"))
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert report["steps"] == len(losses) > 10
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    drafter = DraftHeadsModel.from_pretrained(tmp_path / "run" / "final", base=model, tree=3)
    assert drafter.heads.family == "amphista" and drafter.heads.config.options.attn_heads == 2
    prompt = torch.tensor([[5, 9, 33, 4]])
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
    assert drafter.generate(prompt, max_new_tokens=24).tolist() == reference.tolist()
