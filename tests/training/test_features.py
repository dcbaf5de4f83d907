"""Feature cache and label alignment, against hand-computed values."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_llama
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.training.features import (MAX_TARGETS, Example, Features, extract_features, load_shards,
                                          shard_path, shift_targets, shift_teacher)
from draftheads.heads import HeadConfig, build_heads
from draftheads.training.losses import IGNORE, draft_vocab, head_targets
from draftheads.training.objective import head_labels


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
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    teacher = shift_teacher(torch.tensor([13, 24, 25, 26]))  # the base disagrees with x4, x5, x6
    features = Features(torch.zeros(3, 32), shift_targets(ids, 3), teacher)
    heads = build_heads(HeadConfig(family="hydra", num_heads=2, hidden_size=32, vocab_size=96))
    rows = torch.arange(3)
    assert features.targets[rows, :2].clamp(min=0).tolist() == [[13, 14], [14, 15], [15, 0]]  # the paths read
    assert head_labels(features, rows, heads, "teacher").tolist() == [[24, 25], [25, IGNORE], [IGNORE, IGNORE]]
    assert head_labels(features, rows, heads, "text").tolist() == [[14, 15], [15, IGNORE], [IGNORE, IGNORE]]


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


def test_a_truncated_or_foreign_feature_shard_is_named_in_one_line_and_rebuilt(tmp_path, capsys):
    model = tiny_llama(0, dtype=torch.float32)
    examples = [Example(list(range(3, 3 + n)), 2) for n in (5, 9, 7)]
    fp = fingerprint(model).to_dict()
    hidden = load_shards(extract_features(model, examples, tmp_path, fp, shard_examples=2), fp).hidden
    whole = shard_path(tmp_path, 0).read_bytes()
    shard_path(tmp_path, 0).write_bytes(whole[: len(whole) // 2])  # truncated
    capsys.readouterr()
    again = extract_features(model, examples, tmp_path, fp, shard_examples=2)
    lines = capsys.readouterr().err.strip().splitlines()
    named = [line for line in lines if "shard-00000" in line]
    assert len(named) == 1 and "unreadable" in named[0] and "rebuilding" in named[0]
    assert torch.equal(load_shards(again, fp).hidden, hidden)
    # the same shards read for another dtype (another fingerprint): named and rebuilt, never trusted
    extract_features(model, examples, tmp_path, {**fp, "lm_head_sha256": "another"}, shard_examples=2)
    assert "made from another base or dtype; rebuilding it" in capsys.readouterr().err


def test_draft_vocab_ties_go_to_the_prompts_tokens_then_the_lowest_id():
    labels = torch.tensor([[4, 4, 2], [4, 2, -1]])
    assert draft_vocab(labels, 2, 9).tolist() == [2, 4]
    assert draft_vocab(labels, 4, 9).tolist() == [0, 1, 2, 4]  # unused ids: the lowest
    prompts = torch.tensor([7, 7, 5, 2])
    assert draft_vocab(labels, 4, 9, prompts).tolist() == [2, 4, 5, 7]  # unused ids: the prompts' most frequent
    assert draft_vocab(torch.tensor([3, 1]), 1, 9, torch.tensor([3, 3, 1])).tolist() == [3]  # an equal count too
