"""Heads that read more of the base (issue 66), the training side: the states of the named layers
come from the same forward as the final one (transformers' ``output_hidden_states`` entries), the
feature cache and the job's shards keep them beside it and say which, a shard without a layer a run
reads is rebuilt or refused by name (never read as the final state only), a multi-layer run trains
and saves its fusion, a last-layer checkpoint starts multi-layer heads that draft exactly as it did,
and a layer the base lacks is one line before any work."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from helpers import final_weights, run_inprocess, tiny_distill_setup, tiny_job_args, tiny_llama, tiny_recipe
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import DraftHeads
from draftheads.training.data import distill_job
from draftheads.training.data.distill_capture import forward_states
from draftheads.training.data.distill_shards import ShardError
from draftheads.training.data.job_data import job_table
from draftheads.training.data.records import DataError, example_features
from draftheads.training.features import Example, Features, extract_features, load_shards, shard_path
from draftheads.training.frozen import base_depth, frozen_parts
from draftheads.training.head_forward import head_logits, state_noise
from draftheads.training.head_init import new_heads
from draftheads.training.losses import input_noise
from draftheads.training.preflight import preflight
from draftheads.training.recipe import load_recipe
from draftheads.training.recipe_checks import resolve_feature_layers
from draftheads.training.recipe_sections import RecipeError

EXAMPLES = [Example(list(range(3, 3 + n)), 2) for n in (5, 9, 10, 12, 16)]  # the cache keeps a shard's rows by length


def plain_layers(model, example: Example, layers: list[int]) -> torch.Tensor:
    """The named layers' states of one plain forward over ``example`` at the rows the cache keeps
    (response_start-1 .. L-2), from transformers' own ``output_hidden_states``."""
    out = model.model(input_ids=torch.tensor([example.input_ids]), output_hidden_states=True)
    rows = slice(example.response_start - 1, len(example.input_ids) - 1)
    return torch.cat([out.hidden_states[layer][0, rows] for layer in layers], -1)


# -- capture ----------------------------------------------------------------------------------------------
def test_captured_layers_are_the_output_hidden_states_entries(tmp_path):
    model = tiny_llama(0, dtype=torch.float32)
    fp = fingerprint(model).to_dict()
    table = load_shards(extract_features(model, EXAMPLES, tmp_path, fp, shard_examples=2, layers=[0, 1]), fp, [0, 1])
    assert table.layers.shape == (len(table), 2 * 32) and table.layers.dtype == torch.float16
    expected = torch.cat([plain_layers(model, e, [0, 1]) for e in EXAMPLES])
    torch.testing.assert_close(table.layers.float(), expected, atol=2e-3, rtol=2e-3)  # stored as float16
    assert not torch.allclose(table.layers[:, :32].float(), table.layers[:, 32:].float(), atol=1e-2)
    # the final state is where it always was, and the heads' input is it then the layers
    assert torch.equal(table.hidden, load_shards(sorted(tmp_path.glob("shard-*")), fp).hidden)
    assert torch.equal(table.inputs(torch.arange(3)), torch.cat([table.hidden[:3], table.layers[:3]], -1))
    # a shard holding more layers serves fewer, in the order asked; the on-the-fly path equals the cache
    only = load_shards(sorted(tmp_path.glob("shard-*")), fp, [1])
    assert torch.equal(only.layers, table.layers[:, 32:])
    fly = example_features(model, EXAMPLES, [1])
    assert torch.equal(fly.layers, only.layers) and torch.equal(fly.hidden, table.hidden)
    assert example_features(model, EXAMPLES).layers is None
    # the job's plain forward over whole sequences: (L, d · (1 + n)), the final state first, the last row zero
    sequences = [e.input_ids for e in EXAMPLES[:3]]
    for sequence, states in zip(sequences, forward_states(model.double(), sequences, max_tokens=10, layers=[1])):
        out = model.model(input_ids=torch.tensor([sequence]), output_hidden_states=True)
        assert states.shape == (len(sequence), 64) and not states[-1].any()
        torch.testing.assert_close(states[:-1, :32], out.last_hidden_state[0, :-1], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(states[:-1, 32:], out.hidden_states[1][0, :-1], atol=1e-10, rtol=1e-10)


def test_a_cache_without_the_layers_is_rebuilt_or_refused_by_name(tmp_path, capsys):
    model = tiny_llama(0, dtype=torch.float32)
    fp = fingerprint(model).to_dict()
    paths = extract_features(model, EXAMPLES, tmp_path, fp, shard_examples=2)  # the final state only, as before
    hidden = load_shards(paths, fp).hidden
    with pytest.raises(DataError, match=r"shard-00000\.safetensors holds no base layer \(the final state only\), but "
                                        r"the heads read base layers \[1\]; re-run the feature extraction"):
        load_shards(paths, fp, [1])
    capsys.readouterr()
    again = extract_features(model, EXAMPLES, tmp_path, fp, shard_examples=2, layers=[1])
    named = [line for line in capsys.readouterr().err.splitlines() if "shard-" in line]
    assert len(named) == 3 and all("holds no base layer (the final state only), this run reads base layers [1]; "
                                   "rebuilding it" in line for line in named)
    table = load_shards(again, fp, [1])
    assert torch.equal(table.hidden, hidden) and table.layers.shape == (len(hidden), 32)
    # a shard holding the layers asked is kept (no rebuild); one with others is rebuilt with exactly the ones asked
    extract_features(model, EXAMPLES, tmp_path, fp, shard_examples=2, layers=[1])
    extract_features(model, EXAMPLES, tmp_path, fp, shard_examples=2)
    assert "shard-" not in capsys.readouterr().err
    extract_features(model, EXAMPLES, tmp_path, fp, shard_examples=2, layers=[0])
    assert "holds base layers [1], this run reads base layers [0]; rebuilding it" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"holds base layers \[0\], but the heads read base layers \[1\]"):
        load_shards([shard_path(tmp_path, 0)], fp, [1])


# -- the job's shards -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A job answered by the decoder (the final state only, ``job/``), its ids exported (``ids/``),
    and the same ids rebuilt with the states of layer 1 (``with-layers/``)."""
    root = tmp_path_factory.mktemp("layers-job")
    model, _ = tiny_distill_setup(root, 16, seed=2)
    args = tiny_job_args(root)
    assert distill_job.main(args) == 0
    assert distill_job.main(["--out", str(root / "job"), "--export", str(root / "ids")]) == 0
    fp = distill_job.Job(distill_job.parse_args(args)).fingerprint
    assert distill_job.main(rebuild_args(root, "with-layers", "--layers", "1")) == 0
    return root, model, fp


def rebuild_args(root, out: str, *more: str) -> list[str]:
    return ["--from-tokens", str(root / "ids"), "--out", str(root / out), "--base", str(root / "base"),
            "--dtype", "float64", *more]


def test_a_job_rebuilt_with_layers_keeps_them_and_one_without_is_refused_by_name(job, capsys):
    root, model, fp = job
    with pytest.raises(ShardError, match=r"shard-00000: it holds no base layer \(the final state only\), this run "
                                         r"reads base layers \[1\]; rebuild it: `python -m draftheads\.training\.data\."
                                         r"distill_job --from-tokens .* --layers 1`"):
        distill_job.open_job(root / "job", fp, "float64", [1])
    # the rebuild kept layer 1 beside the final state: layers.npy (tokens, d) float16, named in the manifest
    folder = root / "with-layers" / "shards" / "shard-00000"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["layers"] == [1] and np.load(folder / "layers.npy").shape == (manifest["tokens"], 32)
    shards = distill_job.open_job(root / "with-layers", fp, "float64", [1])
    table = job_table(shards, layers=[1])
    row = 0
    for shard in shards:
        for k in range(len(shard)):
            example = Example([int(t) for t in shard.sequence(k)], int(shard.answer_starts[k]))
            expected = plain_layers(model, example, [1])
            torch.testing.assert_close(table.layers[torch.arange(row, row + len(expected))].double(), expected,
                                       atol=2e-3, rtol=2e-3)
            row += len(expected)
    assert row == len(table)
    # old shards stay valid for last-layer heads; a shard with layers serves them too (layers unread)
    assert job_table(distill_job.open_job(root / "job", fp, "float64")).layers is None
    assert job_table(distill_job.open_job(root / "with-layers", fp, "float64")).layers is None
    # a rebuild asking for a layer a shard lacks rebuilds it (one line), one asking for none keeps it
    more = shutil.copytree(root / "with-layers", root / "more-layers")
    capsys.readouterr()
    assert distill_job.main(rebuild_args(root, "more-layers")) == 0
    assert "rebuilding" not in capsys.readouterr().out
    assert distill_job.main(rebuild_args(root, "more-layers", "--layers", "0", "1")) == 0
    assert "shard-00000: it holds base layers [1], this run reads base layers [0, 1]; rebuilding it" \
        in capsys.readouterr().out
    # shards holding [0, 1] serve heads reading [1]: the same states as shards holding [1] alone
    assert json.loads((more / "shards" / "shard-00000" / "manifest.json").read_text())["layers"] == [0, 1]
    picked = job_table(distill_job.open_job(more, fp, "float64", [1]), layers=[1])
    assert picked.layers.columns[0] is not None and torch.equal(picked.layers[torch.arange(len(picked))],
                                                                table.layers[torch.arange(len(table))])


@pytest.mark.parametrize("more, message", [
    (["--layers", "1"], r"--layers 1: the states of base layers are kept only by a rebuild from token ids"),
    (["--from-tokens", "IDS", "--layers", "2"], r"--layers 2: feature_layers \[2\] names a layer the base does not "
                                                 r"have: it has 2 layers, so 0-1"),
    (["--from-tokens", "IDS", "--layers", "deep"], r"--layers deep: pass layer numbers \(e\.g\. --layers 8 22\) or "
                                                    r"--layers default"),
])
def test_a_bad_layers_option_is_one_line_before_a_file_is_written(job, capsys, more, message):
    root, _, _ = job
    more = [str(root / "ids") if m == "IDS" else m for m in more]
    args = ["--out", str(root / "bad"), "--base", str(root / "base"), "--dtype", "float64", *more]
    if "--from-tokens" not in more:
        args += ["--prompts", str(root / "prompts.jsonl")]
    capsys.readouterr()
    assert distill_job.main(args) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and re.search(message, error), error
    assert not (root / "bad").exists()


def test_a_recipe_reads_the_layers_of_a_job_and_refuses_a_job_without_them_before_the_base_loads(job, monkeypatch):
    root, _, _ = job
    data = {"kind": "job", "path": str(root / "job"), "features_dir": None, "eval_examples": 4}
    without = tiny_recipe(root, "job-run", data=data, heads__feature_layers=[1], train__batch_size=16,
                          train__max_steps=2)
    from draftheads.training import train as train_module

    def loaded(*args, **kwargs):
        raise AssertionError("the base was loaded before the job's layers were checked")

    with monkeypatch.context() as patch:
        patch.setattr(train_module, "load_frozen_base", loaded)
        with pytest.raises(ShardError, match=r"shard-00000: it holds no base layer .* this run reads base layers \[1\]; "
                                             r"rebuild it: .*--from-tokens .*--layers 1`"):
            run_inprocess(without)
    recipe = tiny_recipe(root, "job-run", data={**data, "path": str(root / "with-layers"),
                                                "eval_path": str(root / "with-layers")},
                         heads__feature_layers=[1], train__batch_size=16, train__max_steps=2)
    report = run_inprocess(recipe)
    assert report["steps"] == 2 and np.isfinite(report["final_loss"])
    assert json.loads((root / "job-run" / "final" / "config.json").read_text())["feature_layers"] == [1]


# -- training ------------------------------------------------------------------------------------------------
def fusion_layer_columns(weights: dict) -> torch.Tensor:
    return weights["fusion.fc.weight"][:, 32:]


def test_a_multi_layer_run_trains_its_fusion_and_its_checkpoint_reloads(tiny_setup):
    recipe = tiny_recipe(tiny_setup, "layers", heads__feature_layers="default", train__epochs=1,
                         loss__noise_alpha=1.0, run__keep_best=False)
    report = run_inprocess(recipe)
    log = [json.loads(line) for line in (tiny_setup / "layers" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert report["steps"] > 2 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    config = json.loads((tiny_setup / "layers" / "final" / "config.json").read_text())
    assert config["feature_layers"] == [1]  # "default" for a base of 2 layers
    weights = final_weights(tiny_setup / "layers")
    assert set(weights) >= {"fusion.fc.weight", "fusion.norms.0.weight"}
    assert fusion_layer_columns(weights).abs().max() > 0  # the heads read layer 1: its columns trained from 0
    from safetensors import safe_open

    with safe_open(str(tiny_setup / "features" / "train" / "shard-00000.safetensors"), "pt") as handle:
        assert json.loads(handle.metadata()["layers"]) == [1] and handle.get_slice("layers").get_shape()[1] == 32
    heads = DraftHeads.from_pretrained(tiny_setup / "layers" / "final", dtype=torch.float64)
    assert heads.feature_layers == (1,)
    assert torch.equal(heads.state_dict()["fusion.fc.weight"], weights["fusion.fc.weight"])


def test_a_contextual_family_reads_the_layers_on_the_fly_over_sequence_chunks(tiny_setup):
    """No feature cache: each batch's forward keeps the layers too; Hydra++ reads them as chunks (B, T)."""
    recipe = tiny_recipe(tiny_setup, "fly", heads={"family": "hydra++", "num_heads": 3, "num_layers": 1,
                                                   "draft_vocab_size": 0, "feature_layers": [0, 1]},
                         data__features_dir=None, train__batch_size=4, train__chunk_length=8, train__max_steps=3,
                         loss__noise_alpha=1.0, run__keep_best=False, run__eval_each_epoch=False)
    report = run_inprocess(recipe)
    assert report["steps"] == 3 and np.isfinite(report["final_loss"])
    assert fusion_layer_columns(final_weights(tiny_setup / "fly")).abs().max() > 0


def test_init_from_a_last_layer_checkpoint_drafts_identically_at_step_0(tiny_setup):
    from draftheads.training.frozen import load_frozen_base

    run_inprocess(tiny_recipe(tiny_setup, "last", train__epochs=1, heads__family="hydra"))
    start = tiny_setup / "last" / "final"
    base, _ = load_frozen_base(str(tiny_setup / "base"), "float64")
    recipe = load_recipe(tiny_recipe(tiny_setup, "warm", heads__family="hydra", heads__feature_layers=[0, 1],
                                     heads__init_from=str(start)), [])
    heads = new_heads(recipe, frozen_parts(base, torch.float64, [0, 1]), torch.zeros(0, dtype=torch.long),
                      torch.float64)
    last = DraftHeads.from_pretrained(start, dtype=torch.float64).bind(base.lm_head.weight,
                                                                      base.get_input_embeddings().weight)
    examples = [Example(list(range(5, 25)), 4), Example([7, 9, 11, 13, 40, 41, 42, 60], 3)]
    table = example_features(base, examples, [0, 1])
    rows = torch.arange(len(table))
    logits, _ = head_logits(heads, table, rows, 3, "cpu", torch.float64)
    assert heads.fusion is not None and table.inputs(rows).shape[-1] == 96  # the heads read three states
    assert torch.equal(logits, last(table.hidden[rows].double(), tokens=table.targets[rows, :3].clamp(min=0)))
    # a checkpoint that reads other layers than the recipe's (or layers a last-layer recipe does not) is refused
    run_inprocess(tiny_recipe(tiny_setup, "layer0", train__epochs=1, heads__family="hydra", heads__feature_layers=[0],
                              run__keep_best=False))
    for layers, shown in (([1], r"\[1\]"), ([], r"\[\]")):
        recipe = tiny_recipe(tiny_setup, f"refused{len(layers)}", heads__family="hydra", heads__feature_layers=layers,
                             heads__init_from=str(tiny_setup / "layer0" / "final"))
        message = r"heads\.init_from .* holds other heads than the recipe trains: feature_layers \[0\] \(recipe: "
        with pytest.raises(RecipeError, match=message + shown):  # before any work, from its config.json
            preflight(load_recipe(recipe, []))
        parts = frozen_parts(base, torch.float64, layers)  # and when the heads are built (a Hub id is read then)
        with pytest.raises(RecipeError, match=message + shown):
            new_heads(load_recipe(recipe, []), parts, torch.zeros(0, dtype=torch.long), torch.float64)


def test_the_input_noise_is_each_states_as_the_final_state_alone_gets_it():
    inputs = torch.randn(5, 3 * 8, dtype=torch.float64)
    torch.manual_seed(3)
    alone = input_noise(inputs[:, :8], 0.5)
    torch.manual_seed(3)
    assert torch.equal(state_noise(inputs[:, :8], 8, 0.5), alone)  # the final state only: today's draws
    torch.manual_seed(3)
    noisy = state_noise(inputs, 8, 0.5)
    assert noisy.shape == inputs.shape and (noisy - inputs).abs().max() <= 0.5 / 8 ** 0.5
    assert (noisy - inputs).abs().max() > 0.5 / 24 ** 0.5  # scaled by each state's width, not the whole input's


# -- the recipe -------------------------------------------------------------------------------------------------
def test_a_layer_the_base_lacks_is_one_line_before_any_work(tiny_setup):
    recipe = tiny_recipe(tiny_setup, "deep", heads__feature_layers=[1, 99])
    with pytest.raises(RecipeError, match=r"Recipe key heads\.feature_layers: feature_layers \[1, 99\] names a layer "
                                          r"the base does not have: it has 2 layers, so 0-1 .*; name layers below 2, or default"):
        preflight(load_recipe(recipe, []))
    with pytest.raises(RecipeError, match=r"heads\.feature_layers"):
        run_inprocess(recipe)
    assert not (tiny_setup / "deep").exists()  # nothing was written: no run folder, no feature shard
    for value, message in (([3, 1], "distinct layers in ascending order"), ("deep", "or default, got 'deep'"),
                           ([-1], "negative layer")):
        with pytest.raises(RecipeError, match=r"heads\.feature_layers.*" + message):
            load_recipe(tiny_recipe(tiny_setup, "bad", heads__feature_layers=value), [])
    assert base_depth(str(tiny_setup / "base")) == 2 and base_depth("embedded") == 30
    assert resolve_feature_layers("default", 30) == [8, 22] and resolve_feature_layers([], 30) == []
    # omitted, the recipe is what it was (its identity too: runs from before the key still resume)
    plain = load_recipe(tiny_recipe(tiny_setup, "plain"), [])
    assert plain.heads.feature_layers == [] and "feature_layers" not in plain.identity()["heads"]
    assert load_recipe(tiny_recipe(tiny_setup, "plain"), ["--heads.feature_layers", "[1]"]).identity()["heads"][
        "feature_layers"] == [1]


def test_the_heads_input_of_float16_states_joins_under_bfloat16_autocast():
    """A job's states are float16 and a bf16 run evaluates under CPU autocast, where ``cat`` refuses
    float16 parts (a run once crashed at its epoch's evaluation): the parts are cast, then joined."""
    table = Features(torch.randn(4, 8).half(), torch.zeros(4, 9, dtype=torch.long), torch.zeros(4, 9, dtype=torch.long),
                     layers=torch.randn(4, 16).half())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        joined = table.inputs(torch.arange(4), torch.bfloat16)
    assert joined.dtype == torch.bfloat16 and joined.shape == (4, 24)
    assert torch.equal(joined[:, 8:], table.layers.to(torch.bfloat16))
