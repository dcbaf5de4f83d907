"""The decoding options as one typed object (decoding/config.py): each bad value is refused in
one line naming the field, the keyword arguments users pass to ``from_pretrained`` and
``custom_generate`` build the same config the model then holds (per instance), and a config
written with ``to_dict`` reads back equal with ``from_dict``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftheads import custom_generate
from draftheads.custom_generate import _DECODERS
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.calibration import CalibrationConfig
from draftheads.decoding.config import DecodingConfig
from draftheads.core.errors import InputError, InputTypeError
from draftheads.decoding.policy import FixedTree
from draftheads.decoding.tree import tree_from_paths
from helpers import left_pad, saved_tree_heads, tiny_llama


@pytest.mark.parametrize("options,error,line", [
    ({"finished_rows": "drop"}, InputError, "finished_rows='drop': expected 'shrink'"),
    ({"delegate_plain": "yes"}, InputTypeError, "delegate_plain='yes': expected True or False"),
    ({"packed_linears": 1}, InputTypeError, "packed_linears=1: expected True or False"),
    ({"packed_attention": None}, InputTypeError, "packed_attention=None: expected True or False"),
    ({"merged_offer_scale": 0}, InputError, "merged_offer_scale must be ≥ 1"),
    ({"merged_offer_scale": 1.5}, InputTypeError, "merged_offer_scale must be an integer"),
    ({"calibration": {"reps": 2}}, InputTypeError, "calibration={'reps': 2}: pass a draftheads.decoding.calibration"),
    ({"tree": "big"}, InputError, "tree='big': expected 'adaptive' or a node budget"),
    ({"tree": -1}, InputError, "tree (a node budget) must be ≥ 0"),
    ({"sources": "bogus"}, InputError, "sources='bogus': expected a comma-separated subset"),
    ({"review": "yes"}, InputError, "review='yes': expected True"),
    ({"sources": "heads", "review": True}, InputError, "review=True: the heads review lookup drafts"),
    ({"lookup_store": 3}, InputTypeError, "lookup_store must be a path"),
])
def test_each_bad_option_is_refused_in_one_line_naming_it(options, error, line):
    with pytest.raises(error) as raised:
        DecodingConfig(**options)
    assert line in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(error):  # a copy is checked like a new config
        DecodingConfig().replace(**options)


def test_an_unknown_option_names_the_options():
    with pytest.raises(InputTypeError, match="unknown decoding option.*finished_row;.*finished_rows"):
        DecodingConfig().replace(finished_row="mask")
    with pytest.raises(InputError, match="unknown decoding option.*speed"):
        DecodingConfig.from_dict({"speed": "max"})


def test_equal_options_make_equal_configs():
    assert DecodingConfig(sources=" Heads, context") == DecodingConfig(sources=("heads", "context"))
    assert DecodingConfig(sources="AUTO").sources == "auto"
    assert DecodingConfig(tree=" 4 ") == DecodingConfig(tree=4)
    assert DecodingConfig(tree="Adaptive").tree == "adaptive"
    assert DecodingConfig(finished_rows="mask") != DecodingConfig()


def test_from_pretrained_keywords_build_the_config_the_model_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    base = tiny_llama(0)
    folder = saved_tree_heads(tmp_path / "heads", base)
    options = dict(tree=3, sources="heads,context", finished_rows="mask", delegate_plain=True, merged_offer_scale=3)
    model = DraftHeadsModel.from_pretrained(folder, base=base, **options)
    assert model.decoding == DecodingConfig(**options)
    assert model.sources == ("heads", "context")
    # a config passed whole, keyword options over it (they win)
    given = DraftHeadsModel.from_pretrained(folder, base=base, decoding=DecodingConfig(**options), sources="heads")
    assert given.decoding == DecodingConfig(**{**options, "sources": "heads"}) and given.sources == ("heads",)
    # "auto" stays what was asked; the sources it chose are the model's
    auto = DraftHeadsModel.from_pretrained(folder, base=base, tree=3)
    assert auto.decoding.sources == "auto" and auto.sources == ("heads", "context")
    # use_sources records the new choice
    auto.use_sources("heads")
    assert auto.decoding == DecodingConfig(tree=3, sources="heads")
    # the switches are the instance's own: another model keeps the defaults
    other = DraftHeadsModel(base, None)
    assert other.decoding.finished_rows == "shrink" and not other.decoding.delegate_plain
    with pytest.raises(InputError, match="finished_rows='drop'"):  # checked before anything loads
        DraftHeadsModel.from_pretrained(tmp_path / "missing", base=base, finished_rows="drop")


def test_a_model_decodes_as_its_config_says(tmp_path, monkeypatch):
    """finished_rows="mask" keeps finished rows in the batch (every step verifies all rows),
    "shrink" drops them; the tokens are the base's either way (float64)."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    base = tiny_llama(0)
    folder = saved_tree_heads(tmp_path / "heads", base)
    ids, mask = left_pad([[3, 5, 9, 13, 21], [7, 8]])
    first = base.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False)[0, -1].item()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=[first])
    reference = base.generate(ids, do_sample=False, **kwargs)
    rows = {}
    for finished_rows in ("shrink", "mask"):
        model = DraftHeadsModel.from_pretrained(folder, base=base, tree=3, sources="heads", finished_rows=finished_rows)
        assert model.generate(ids, **kwargs).tolist() == reference.tolist()
        rows[finished_rows] = set(model.last_stats.batch_sizes)
    assert rows["mask"] == {2} and 1 in rows["shrink"]


def test_custom_generate_builds_the_same_config(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    model = tiny_llama(0)
    heads = saved_tree_heads(tmp_path / "heads", model)
    fn = custom_generate(heads, sources="heads", tree=3, finished_rows="mask")
    with pytest.raises(InputError, match="finished_rows='drop'"):  # checked when the callable is made
        custom_generate(heads, finished_rows="drop")
    ids = torch.tensor([[5, 17, 33, 8, 9]])
    reference = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert model.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=fn).tolist() == reference.tolist()
    (decoder,) = _DECODERS[model].values()
    assert decoder.decoding == DecodingConfig(sources="heads", tree=3, finished_rows="mask")
    # a config passed whole is the same config
    again = custom_generate(heads, decoding=DecodingConfig(sources="heads", tree=3, finished_rows="mask"))
    model.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=again)
    assert len(_DECODERS[model]) == 1  # the same options share the decoder


def test_to_dict_and_from_dict_are_a_symmetric_pair():
    config = DecodingConfig(tree=tree_from_paths([(0,), (1,), (0, 0)]), sources="heads,context,store",
                            lookup_store=Path("/tmp/store.safetensors"), review=True,
                            calibration=CalibrationConfig(batch_sizes=(1, 2), reps=2), packed_attention=False,
                            packed_linears=False, finished_rows="mask", delegate_plain=True, merged_offer_scale=4)
    written = json.loads(json.dumps(config.to_dict()))  # JSON-plain
    back = DecodingConfig.from_dict(written)
    assert back.tree.paths == config.tree.paths  # a Tree compares by identity; its paths are what it is
    assert back.replace(tree=None) == config.replace(tree=None, lookup_store=str(config.lookup_store))
    assert back.to_dict() == written
    for plain in (DecodingConfig(), DecodingConfig(tree="adaptive", sources="context"), DecodingConfig(tree=0)):
        assert DecodingConfig.from_dict(json.loads(json.dumps(plain.to_dict()))) == plain
    with pytest.raises(InputError, match="decoding.tree is a FixedTree object"):
        DecodingConfig(tree=FixedTree(tree_from_paths([(0,)]))).to_dict()


@pytest.mark.parametrize("saved,error,line", [
    ({"calibration": {"reps": 0}}, InputError, "calibration.reps must be ≥ 1, got 0."),
    ({"calibration": {"contexts": [-5]}}, InputError,
     "calibration.contexts=[-5]: expected a non-empty list of whole numbers ≥ 1, such as [1, 2, 4]."),
    ({"calibration": {"batch_sizes": "1,2"}}, InputError,
     "calibration.batch_sizes='1,2': expected a non-empty list of whole numbers ≥ 1, such as [1, 2, 4]."),
    ({"calibration": {"nodes": []}}, InputError,
     "calibration.nodes=[]: expected a non-empty list of whole numbers ≥ 1, such as [1, 2, 4]."),
    ({"calibration": {"extra_nodes": [0]}}, InputError,
     "calibration.extra_nodes=[0]: expected a list of whole numbers ≥ 1, such as [1, 2, 4]."),
    ({"calibration": {"max_tokens": 1.5}}, InputTypeError,
     "calibration.max_tokens must be an integer ≥ 1, got 1.5 (float)."),
    ({"calibration": {"tree_nodes": "yes"}}, InputTypeError, "calibration.tree_nodes='yes': expected True or False."),
    ({"calibration": {"speed": 1}}, InputError, "unknown calibration option(s) speed in the saved config; the options "
     "are batch_sizes, nodes, contexts, max_tokens, reps, tree_nodes, extra_nodes."),
    ({"calibration": [1, 2]}, InputTypeError, "calibration=[1, 2] in the saved config: expected an object of "
     "calibration options (batch_sizes, nodes, contexts, max_tokens, reps, tree_nodes, extra_nodes) or null"),
    ({"tree": {}}, InputError, "tree={} in the saved config: a saved tree is {'paths': [[0], [1], [0, 0]]} (a list of "
     "rank paths, each a list of ranks); fix it or save tree= as a node budget."),
    ({"tree": {"paths": "0,1"}}, InputError, "tree={'paths': '0,1'} in the saved config: a saved tree is"),
    ({"tree": {"paths": [[0, 0]]}}, InputError, "tree.paths in the saved config: Tree path [0, 0] has no parent [0]: "
     "a tree must be prefix-closed. Fix the paths or save tree= as a node budget."),
    ({"lookup_store": ""}, InputError, "lookup_store='' is empty: pass the lookup store file's path, or None"),
])
def test_a_saved_config_is_checked_field_by_field_where_it_is_read(saved, error, line):
    """Every field of a saved config, nested ones included, is refused in one line naming it —
    not accepted to fail when ``tree="adaptive"`` first measures, nor a KeyError/TypeError."""
    with pytest.raises(error) as raised:
        DecodingConfig.from_dict(saved)
    assert line in str(raised.value) and "\n" not in str(raised.value)


def test_a_calibration_grid_is_checked_however_it_is_given():
    with pytest.raises(InputError, match=r"^calibration\.reps must be ≥ 1, got 0\.$"):
        DecodingConfig(calibration=CalibrationConfig(reps=0))
    with pytest.raises(InputError, match=r"^calibration\.contexts=\(128, -5\): expected a non-empty list"):
        DecodingConfig(tree="adaptive").replace(calibration=CalibrationConfig(contexts=(128, -5)))
    # lists read as the tuples the grid holds: the same grid is the same config (and cache key)
    as_lists = DecodingConfig(calibration=CalibrationConfig(batch_sizes=[1, 2], contexts=[64]))
    assert as_lists == DecodingConfig(calibration=CalibrationConfig(batch_sizes=(1, 2), contexts=(64,)))
    assert DecodingConfig.from_dict(json.loads(json.dumps(as_lists.to_dict()))) == as_lists
