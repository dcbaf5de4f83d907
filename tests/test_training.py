"""Feature cache and Medusa trainer pieces, against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_llama
from draftheads.decoding import fingerprint
from draftheads.training.features import (MAX_TARGETS, Example, Features, extract_features, load_shards,
                                          shard_path, shift_targets, shift_teacher)
from draftheads.training.heads_trainer import HeadTrainConfig, head_inputs, new_heads, rank_matrix, train_heads
from draftheads.training.losses import IGNORE, draft_vocab, head_targets, topk_accuracy


def test_shift_targets_line_up_with_heads():
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    targets = shift_targets(ids, start=3)  # hidden at positions 2..4 (predict 13, 14, 15)
    assert targets.shape == (3, MAX_TARGETS)
    assert targets[0, :4].tolist() == [13, 14, 15, -1]  # root x3, then head 0's token x4
    assert targets[2].tolist() == [15] + [-1] * (MAX_TARGETS - 1)
    # the base's argmax at positions 2..5 (its guesses for x3..x6) line up column by column
    teacher = shift_teacher(torch.tensor([113, 114, 115, 116]))
    assert teacher.shape == (3, MAX_TARGETS)
    assert teacher[0, :4].tolist() == [113, 114, 115, 116] and teacher[2, :3].tolist() == [115, 116, -1]


def test_head_inputs_label_with_the_teacher_and_feed_the_text():
    """Head k's label is the base's choice after the path x_(t+1)..x_(t+k+1), IGNOREd where
    the path runs past the text; the path itself is the text."""
    model = tiny_llama(0, dtype=torch.float32)
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    teacher = shift_teacher(torch.tensor([13, 24, 25, 26]))  # the base disagrees with x4, x5, x6
    features = Features(torch.zeros(3, 32), shift_targets(ids, 3), teacher)
    cfg = HeadTrainConfig(family="hydra", num_heads=2, draft_vocab_size=0)
    heads = new_heads(cfg, model, features.teacher[:, 1:3])
    labels, tokens = head_inputs(features, heads)
    assert tokens.tolist() == [[13, 14], [14, 15], [15, 0]]
    assert labels.tolist() == [[24, 25], [25, 26], [26, IGNORE]]


def test_head_targets_map_into_the_draft_vocabulary():
    targets = torch.tensor([[5, 7, -1], [9, 5, 5]])
    vocab_ids = torch.tensor([5, 9])
    assert head_targets(targets, vocab_ids, vocab_size=10, num_heads=3).tolist() == [[0, IGNORE, IGNORE], [1, 0, 0]]
    assert draft_vocab(torch.tensor([[1, 1, 2], [3, 3, 3]]), 2, 5).tolist() == [1, 3]


def test_features_resume_and_refuse_another_base(tmp_path):
    model = tiny_llama(0, dtype=torch.float32)
    examples = [Example(list(range(3, 3 + n)), 2) for n in (5, 9, 7, 6, 12)]
    fp = fingerprint(model).to_dict()
    paths = extract_features(model, examples, tmp_path, fp, shard_examples=2)
    assert [p.name for p in paths] == ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    features = load_shards(paths, fp)
    hidden = features.hidden
    assert hidden.shape == (sum(n - 2 for n in (5, 9, 7, 6, 12)), 32) and features.targets.shape[1] == MAX_TARGETS
    # teacher column 0 is the base's own argmax at each position
    expected = model(torch.tensor([examples[0].input_ids])).logits[0, 1:4].argmax(-1)
    assert features.teacher[:3, 0].tolist() == expected.tolist()
    # A killed run: one shard missing, one partial file left behind. Resume redoes exactly that.
    shard_path(tmp_path, 1).unlink()
    (tmp_path / "shard-00001.safetensors.partial").write_bytes(b"half")
    again = extract_features(model, examples, tmp_path, fp, shard_examples=2)
    assert torch.equal(load_shards(again, fp).hidden, hidden)
    with pytest.raises(ValueError, match="different base model"):
        load_shards(paths, fingerprint(tiny_llama(1, dtype=torch.float32)).to_dict())


def test_training_learns_a_shifted_copy_task():
    """Heads on a synthetic task (the token ahead is what the LM head reads off a random
    ResBlock's output, which one Medusa layer can represent) go from poor to high top-1."""
    model = tiny_llama(0, dtype=torch.float32)
    torch.manual_seed(0)
    hidden = torch.randn(4096, 32)
    proj = model.lm_head.weight  # the target is what the LM head would read off a fixed map
    teacher = torch.nn.Linear(32, 32)  # a random ResBlock: exactly what one Medusa layer can represent
    torch.nn.init.normal_(teacher.weight, std=0.4)
    with torch.no_grad():
        truth = ((hidden + torch.nn.functional.silu(teacher(hidden))) @ proj.t()).argmax(-1)
    targets = torch.full((4096, MAX_TARGETS), -1)
    targets[:, :2] = 3  # the path tokens (unused by Medusa)
    teacher = targets.clone()
    teacher[:, 1] = truth
    config = HeadTrainConfig(num_heads=1, draft_vocab_size=0, epochs=12, batch_size=128, lr=1e-2,
                             bf16_autocast=False)
    heads, stats = train_heads(config, Features(hidden.half(), targets, teacher), model)
    labels = head_targets(teacher[:, 1:], heads.vocab_ids, 96, 1)
    before = (hidden @ proj.t()).argmax(-1).eq(truth).float().mean().item()
    after = topk_accuracy(rank_matrix(heads, hidden, labels, 5))["top1"][0]
    assert after > before + 0.25, (before, after)
    assert stats["log"][-1]["loss"] < 0.8 * stats["log"][0]["loss"]


def test_sequence_chunks_follow_example_boundaries():
    """Contextual families train on whole sequences: an example ends where x_(t+2) is missing."""
    from draftheads.training.heads_trainer import sequence_chunks

    examples = [torch.tensor(list(range(10, 10 + n))) for n in (6, 4, 9)]
    targets = torch.cat([shift_targets(ids, 2) for ids in examples])  # 4 + 2 + 7 positions
    assert sequence_chunks(targets, 100) == [(0, 4), (4, 6), (6, 13)]
    assert sequence_chunks(targets, 3) == [(0, 3), (3, 4), (4, 6), (6, 9), (9, 12), (12, 13)]


def test_hydrapp_trains_on_sequence_chunks():
    """Hydra++ (prefix layer over the context) trains through the same trainer and its loss falls."""
    model = tiny_llama(0, dtype=torch.float32)
    examples = [torch.randint(3, 96, (n,)) for n in (40, 25, 60, 33) * 8]
    targets = torch.cat([shift_targets(ids, 2) for ids in examples])
    torch.manual_seed(0)
    hidden = torch.randn(targets.shape[0], 32)
    # the "base" repeats the last token of the path: learnable from the path tokens
    teacher = torch.roll(targets, 1, dims=1)
    config = HeadTrainConfig(family="hydra++", num_heads=2, draft_vocab_size=0, epochs=15, batch_size=256, lr=1e-2,
                             bf16_autocast=False, chunk_length=32)
    heads, stats = train_heads(config, Features(hidden.half(), targets, teacher), model)
    assert heads.family == "hydra++"
    assert stats["log"][-1]["loss"] < 0.8 * stats["log"][0]["loss"]
    labels, tokens = head_inputs(Features(hidden.half(), targets, teacher), heads)
    ranks = rank_matrix(heads, hidden, labels, 5, tokens=tokens, targets=targets)
    assert ranks.shape == (targets.shape[0], 2)
    accuracy = topk_accuracy(ranks)
    assert min(accuracy["top5"]) > 5 * 5 / 96, accuracy  # well above chance
