"""Hydra++'s ``prefix_context`` option: "answer" (what every checkpoint without the key means)
or "sequence" (the paper's prefix layer over the whole sequence); it round-trips through a
checkpoint, a bad value is one line, and the heads say which one they want."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import FAMILIES, REPO, random_heads, tiny_llama
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import DraftHeads, HeadConfig, HydraPlusPlusOptions, OptionError, read_config


@pytest.mark.parametrize("context", ["answer", "sequence"])
def test_prefix_context_round_trips_through_a_checkpoint(tmp_path, context):
    model = tiny_llama(0)
    heads = random_heads("hydra++", model, extra={"prefix_context": context})
    assert heads.config.options == HydraPlusPlusOptions(prefix_context=context)
    assert heads.context_from_prompt is (context == "sequence")
    heads.save_pretrained(tmp_path, dtype=None)
    extra = json.loads((tmp_path / "config.json").read_text())["extra"]
    # "answer" is what a config without the key means, so it is not written
    assert extra.get("prefix_context") == (None if context == "answer" else "sequence")
    loaded = DraftHeads.from_pretrained(tmp_path, expected_fingerprint=fingerprint(model).to_dict(),
                                        dtype=torch.float64)
    assert loaded.config.options.prefix_context == context and loaded.context_from_prompt is (context == "sequence")


def test_the_shipped_hydrapp_checkpoint_reads_answer():
    config = read_config(REPO / "checkpoints" / "smollm2-135m-hydrapp")
    assert "prefix_context" not in json.loads((REPO / "checkpoints" / "smollm2-135m-hydrapp" / "config.json")
                                              .read_text())["extra"]
    assert config.options.prefix_context == "answer"
    assert config.to_dict()["extra"] == {"prefix_heads": 9, **config.extra}  # written back without the key


@pytest.mark.parametrize("family", FAMILIES)
def test_only_sequence_hydrapp_and_eagle3_heads_want_the_prompt(family):
    model = tiny_llama(0)
    assert random_heads(family, model).context_from_prompt == (family == "eagle3")  # EAGLE-3 reads the whole sequence


@pytest.mark.parametrize("make", [
    lambda: HydraPlusPlusOptions(prefix_context="prompt"),
    lambda: HeadConfig(family="hydra++", hidden_size=32, vocab_size=96, extra={"prefix_context": "prompt"}),
])
def test_a_bad_prefix_context_is_one_line(make):
    with pytest.raises(OptionError, match=r"^Hydra\+\+ option extra\.prefix_context must be 'answer' or "
                                          r"'sequence', got 'prompt'\.$") as caught:
        make()
    assert "\n" not in str(caught.value) and caught.value.key == "prefix_context"


def test_a_non_string_prefix_context_is_one_line():
    with pytest.raises(OptionError, match=r"extra\.prefix_context must be a string, got 1\.$"):
        HydraPlusPlusOptions(prefix_context=1)


def test_hydrapp_dropout_acts_in_training_only_and_is_checked():
    import pytest
    import torch

    from draftheads.heads import HeadConfig, build_heads
    from draftheads.heads.family_options import OptionError

    config = HeadConfig(family="hydra++", num_heads=2, num_layers=1, hidden_size=8, vocab_size=16,
                        extra={"prefix_heads": 2, "dropout": 0.5})
    heads = build_heads(config).double()
    heads.bind(torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    hidden, tokens = torch.randn(1, 5, 8, dtype=torch.float64), torch.randint(0, 16, (1, 5, 2))
    heads.eval()
    assert torch.equal(heads(hidden, tokens=tokens), heads(hidden, tokens=tokens))
    heads.train()
    torch.manual_seed(0)
    assert not torch.equal(heads(hidden, tokens=tokens), heads(hidden, tokens=tokens))
    assert "dropout" not in build_heads(HeadConfig(family="hydra++", num_heads=2, num_layers=1, hidden_size=8,
                                                   vocab_size=16, extra={"prefix_heads": 2})).config.to_dict()["extra"]
    with pytest.raises(OptionError, match="dropout"):
        build_heads(HeadConfig(family="hydra++", num_heads=2, num_layers=1, hidden_size=8, vocab_size=16,
                               extra={"prefix_heads": 2, "dropout": 1.5}))
