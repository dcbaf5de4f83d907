"""Typed head options: each family's options dataclass and KOALA's record are what the config
holds, read from the ``extra`` keys every checkpoint already has, written back there
unchanged, and a saved config loads back equal; ``save_pretrained`` / ``from_pretrained`` are
a pair that records where the heads came from."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers import REPO, tiny_llama
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import (AmphistaHeads, AmphistaOptions, CheckpointError, DraftHeads, Eagle3Options, HeadConfig,
                              HydraHeads, HydraOptions, HydraPlusPlusOptions, KoalaOptions, MedusaHeads, MedusaOptions,
                              OptionError, build_heads, read_config)
from draftheads.heads.head_config import DRAFTHEADS_VERSION, PROMOTED_FROM_EXTRA

SHIPPED = sorted((REPO / "checkpoints").glob("*/config.json"))
KOALA = {"label": "KOALA-Hydra", "layers": 2, "adversarial_weight": 0.1, "schedule": "linear", "warmup_steps": 300,
         "ramp_steps": 300, "disc_hidden": 256, "disc_steps": 1, "disc_lr": 0.0001, "label_smoothing": 0.1,
         "grad_penalty": 1.0, "paper": "arXiv:2408.08146"}


def test_the_shipped_checkpoints_are_among_those_checked():
    assert {path.parent.name for path in SHIPPED} >= {"smollm2-135m-amphista", "smollm2-135m-eagle3",
                                                       "smollm2-135m-hydrapp", "smollm2-135m-koala-medusa",
                                                       "smollm2-135m-medusa"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.parent.name)
def test_shipped_configs_load_typed_and_write_back_the_same_extra(path):
    """Every checked-in config.json (format 1): its options become typed, its ``extra`` is
    written back key for key (only the keys format 3 made fields move out, as before), and
    what is written reads back equal."""
    raw = json.loads(path.read_text())
    config = read_config(path.parent)
    options_class = {"medusa": MedusaOptions, "hydra": HydraOptions, "hydra++": HydraPlusPlusOptions,
                     "amphista": AmphistaOptions, "eagle3": Eagle3Options}[raw["family"]]
    assert type(config.options) is options_class
    assert config.options.to_extra() == {k: v for k, v in raw["extra"].items() if k in options_class.kinds()}
    assert (config.koala is None) == ("koala" not in raw["extra"])
    assert not set(config.extra) & (set(options_class.kinds()) | {"koala"})  # typed keys are not held twice
    written = config.to_dict()
    assert written["extra"] == {k: v for k, v in raw["extra"].items() if k not in PROMOTED_FROM_EXTRA}
    assert list(written["extra"]) == [k for k in raw["extra"] if k not in PROMOTED_FROM_EXTRA]
    read_back = HeadConfig.from_dict(json.loads(json.dumps(written)))
    assert read_back == dataclasses.replace(config, draftheads_version=DRAFTHEADS_VERSION)


def test_shipped_option_values_are_the_typed_fields():
    amphista = read_config(REPO / "checkpoints" / "smollm2-135m-amphista")
    assert amphista.options == AmphistaOptions(attn_heads=9, mlp_size=576, gated=True)
    hydrapp = read_config(REPO / "checkpoints" / "smollm2-135m-hydrapp")
    assert hydrapp.options == HydraPlusPlusOptions(prefix_heads=9) and hydrapp.options.resolved(576) == (9, 2304)
    koala = read_config(REPO / "checkpoints" / "smollm2-135m-koala-hydra").koala
    assert koala == KoalaOptions(**KOALA) and koala.layers == 2 and koala.label == "KOALA-Hydra"


def test_typed_options_and_extra_keys_build_the_same_config():
    typed = HeadConfig(family="amphista", hidden_size=32, vocab_size=96,
                       options=AmphistaOptions(attn_heads=2, gated=False), koala=KoalaOptions(**KOALA))
    from_extra = HeadConfig(family="amphista", hidden_size=32, vocab_size=96,
                            extra={"attn_heads": 2, "gated": False, "koala": dict(KOALA)})
    assert typed == from_extra and typed.extra == {}
    assert build_heads(typed).auto_embedding.attn_heads == 2
    # no options given: the family's defaults, typed
    assert HeadConfig(family="hydra++").options == HydraPlusPlusOptions()
    assert HeadConfig(family="medusa").options == MedusaOptions() and HeadConfig(family="medusa").koala is None


@pytest.mark.parametrize("family, options", [
    ("medusa", MedusaOptions()), ("hydra", HydraOptions()), ("hydra++", HydraPlusPlusOptions(prefix_heads=2)),
    ("amphista", AmphistaOptions(attn_heads=4, mlp_size=24, gated=False))])
@pytest.mark.parametrize("koala", [None, KoalaOptions(**KOALA)], ids=["plain", "koala"])
def test_saved_heads_load_back_with_an_equal_config(tmp_path, family, options, koala):
    model = tiny_llama(0)
    cfg = model.config
    config = HeadConfig(family=family, num_heads=2, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                        draft_vocab_size=40, base_fingerprint=fingerprint(model).to_dict(), base_name="tiny/base-0",
                        trees={"2": [[0], [1]]}, expected_tau={"2": 1.5}, options=options, koala=koala,
                        extra={"recipe": {"name": "tiny"}, "held_out_accuracy": {"top1": [0.5, 0.25]}})
    heads = build_heads(config)
    heads.save_pretrained(tmp_path, dtype=None)
    loaded = DraftHeads.from_pretrained(tmp_path, expected_fingerprint=fingerprint(model).to_dict())
    assert loaded.config == dataclasses.replace(config, draftheads_version=DRAFTHEADS_VERSION)
    assert type(loaded) is type(heads) and loaded.checkpoint_dir == tmp_path
    # the file keeps the options where every earlier format had them
    extra = json.loads((tmp_path / "config.json").read_text())["extra"]
    assert extra == {**options.to_extra(), **({"koala": KOALA} if koala else {}), "recipe": {"name": "tiny"},
                     "held_out_accuracy": {"top1": [0.5, 0.25]}}


def test_from_pretrained_records_the_folder_and_refuses_another_family(tmp_path):
    model = tiny_llama(0)
    cfg = model.config
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size))
    assert heads.checkpoint_dir is None  # built in memory
    heads.save_pretrained(tmp_path / "medusa")
    assert heads.checkpoint_dir is None  # saving a copy does not move where the heads came from
    loaded = MedusaHeads.from_pretrained(tmp_path / "medusa", dtype=torch.float64)
    assert isinstance(loaded, MedusaHeads) and loaded.checkpoint_dir == tmp_path / "medusa"
    assert next(loaded.parameters()).dtype == torch.float64 and not loaded.training
    with pytest.raises(CheckpointError, match=r"holds 'medusa' heads, not 'hydra'"):
        HydraHeads.from_pretrained(tmp_path / "medusa")


@pytest.mark.parametrize("make, message", [
    (lambda: AmphistaOptions(attn_heads=0), r"^Amphista option extra\.attn_heads must be a whole number ≥ 1, got 0\.$"),
    (lambda: AmphistaOptions(gated="yes"), r"^Amphista option extra\.gated must be true or false, got 'yes'\.$"),
    (lambda: HydraPlusPlusOptions(prefix_mlp_size=2.5), r"extra\.prefix_mlp_size must be a whole number ≥ 1"),
    (lambda: KoalaOptions(**{**KOALA, "schedule": "cosine"}), r"extra\.koala\.schedule must be 'constant' or 'linear'"),
    (lambda: KoalaOptions(**{**KOALA, "warmup_steps": -1}), r"extra\.koala\.warmup_steps must be a whole number ≥ 0"),
    (lambda: HeadConfig(family="amphista", extra={"koala": {**KOALA, "disc_lr": "fast"}}),
     r"extra\.koala\.disc_lr must be a number ≥ 0"),
    (lambda: HeadConfig(family="amphista", options=MedusaOptions()), r"amphista heads take AmphistaOptions"),
    (lambda: HeadConfig(family="amphista", options=AmphistaOptions(attn_heads=2), extra={"attn_heads": 3}),
     r"given twice"),
])
def test_bad_options_are_one_line_errors_naming_the_key(make, message):
    with pytest.raises(ValueError, match=message) as caught:
        make()
    assert "\n" not in str(caught.value)
    if caught.type is OptionError:  # a recipe names its own key from these
        assert caught.value.key in str(caught.value) and caught.value.expected in str(caught.value)


def test_heads_of_one_family_refuse_another_familys_options():
    with pytest.raises(CheckpointError, match=r"AmphistaHeads reads AmphistaOptions, but the config holds MedusaOptions"):
        AmphistaHeads(HeadConfig(family="medusa", hidden_size=32, vocab_size=96))
