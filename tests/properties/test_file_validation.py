"""Through the Python API every file draftheads reads is validated by one reader before use,
and a bad one is one project error (:class:`DraftheadsError`, still the ``ValueError`` /
``FileNotFoundError`` it was) naming the file and what is wrong — the lookup store's header,
sizes and ids; a foreign Medusa checkpoint; a training report and the results it cites; a run's
``recipe.json``; a recipe file; a head config that is a base model's."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import reference_heads, tiny_llama, tiny_recipe, write_medusa
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.decoding.drafters import ModelStore, StoreError, StoreHeader, build_arrays, save_store
from draftheads.decoding.drafters.store import FORMAT_VERSION, key_bits
from draftheads.heads import CheckpointError, DraftheadsError, HeadConfig, MedusaHeads, load_heads
from draftheads.heads.checkpoint.card import card_for_checkpoint
from draftheads.heads.checkpoint.hub import check_checkpoint_folder
from draftheads.heads.checkpoint.medusa_import import import_medusa
from draftheads.training.recipe import load_recipe
from draftheads.training.recipe_sections import RecipeError

MODEL = tiny_llama(0)
RECORDS = [[5, 6, 7, 8, 9, 2], [6, 7, 8, 1, 2], [3, 3, 3, 3], [7, 8, 9, 9, 2]]


@pytest.mark.parametrize("error", [CheckpointError, StoreError, RecipeError])
def test_every_project_error_shares_one_root_and_keeps_its_old_base(error):
    assert issubclass(error, DraftheadsError) and issubclass(error, ValueError)


# -- the lookup store -----------------------------------------------------------------------------
def write_store(path: Path, vocab: int = 10) -> None:
    bits = key_bits(vocab)
    header = StoreHeader(FORMAT_VERSION, vocab, "0" * 64, 64 // bits, bits, "2026-11-25", "test", len(RECORDS),
                         sum(map(len, RECORDS)))
    save_store(path, build_arrays(RECORDS, vocab), header)


def rewrite_header(path: Path, change) -> None:
    """Rewrite the safetensors header through ``change(header) -> header`` (data bytes kept)."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = change(json.loads(blob[8:8 + length]))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + length:])


def overwrite(path: Path, array: str, values: np.ndarray) -> None:
    """Overwrite the first bytes of one array's data with ``values``."""
    blob = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", blob[:8])
    begin = 8 + length + json.loads(blob[8:8 + length])[array]["data_offsets"][0]
    data = values.tobytes()
    blob[begin:begin + len(data)] = data
    path.write_bytes(bytes(blob))


def meta(**over):
    return lambda h: {**h, "__metadata__": {**h["__metadata__"], **over}}


STORE_DAMAGE = {
    "header is a list": (lambda p: rewrite_header(p, lambda h: [h]), r"header is a JSON list, not an object"),
    "no data_offsets": (lambda p: rewrite_header(p, lambda h: {**h, "keys": {k: v for k, v in h["keys"].items()
                                                                              if k != "data_offsets"}}),
                        r"array 'keys' has no valid data_offsets"),
    "offsets not numbers": (lambda p: rewrite_header(p, lambda h: {**h, "tokens": {**h["tokens"],
                                                                                   "data_offsets": ["a", "b"]}}),
                            r"array 'tokens' has no valid data_offsets"),
    "shape not a length": (lambda p: rewrite_header(p, lambda h: {**h, "tokens": {**h["tokens"], "shape": "many"}}),
                           r"array 'tokens' has shape 'many'"),
    "metadata a list": (lambda p: rewrite_header(p, lambda h: {**h, "__metadata__": [1]}), r"damaged header"),
    "wrong n": (lambda p: rewrite_header(p, meta(n="4000")), r"inconsistent header \(.*n=4000 do not fit"),
    "wrong bits": (lambda p: rewrite_header(p, meta(bits="70")), r"inconsistent header"),
    "wrong token count": (lambda p: rewrite_header(p, meta(tokens="3")), r"inconsistent header \(tokens=3"),
    "negative vocab": (lambda p: rewrite_header(p, meta(vocab_size="-5")), r"inconsistent header"),
    "ids overwritten": (lambda p: overwrite(p, "tokens", np.array([70000, 9], np.int32)),
                        r"holds token id 70000, outside this vocabulary \[0, 10\)"),
    "negative id": (lambda p: overwrite(p, "tokens", np.array([-7], np.int32)), r"holds token id -7"),
    "positions overwritten": (lambda p: overwrite(p, "positions", np.array([10 ** 6], np.int32)),
                              r"positions outside its answers"),
    "bigram overwritten": (lambda p: overwrite(p, "bigram_next", np.array([99], np.int32)), r"bigram table"),
    "keys unsorted": (lambda p: overwrite(p, "keys", np.array([2 ** 63], np.uint64)), r"keys are not sorted"),
}


@pytest.mark.parametrize("case", STORE_DAMAGE)
def test_a_damaged_store_is_refused_on_open_naming_the_file(tmp_path, case):
    path = tmp_path / "store.safetensors"
    write_store(path)
    ModelStore.open(path)  # the undamaged file opens
    damage, message = STORE_DAMAGE[case]
    damage(path)
    with pytest.raises(StoreError, match=rf"{path}.*{message}.*draftheads store build"):
        ModelStore.open(path)


def test_store_ids_are_range_checked_against_the_bases_vocabulary(tmp_path):
    """A store whose ids the base cannot embed is refused when the model opens it, not with an
    IndexError inside the base's embedding during generate."""
    path = tmp_path / "store.safetensors"
    bits = key_bits(200)
    records = [[150, 151, 152, 150, 151]]
    save_store(path, build_arrays(records, 200), StoreHeader(FORMAT_VERSION, 200, "0" * 64, 64 // bits, bits, "d",
                                                             "t", 1, 5))
    model = DraftHeadsModel(MODEL, None)
    with pytest.raises(StoreError, match=rf"{path} holds token id 152, outside this vocabulary \[0, 96\)"):
        model.use_sources("context,store", lookup_store=path)


# -- a foreign Medusa checkpoint -------------------------------------------------------------------
def change_state(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "medusa_lm_head.safetensors"))
    save_file(change(state), str(folder / "medusa_lm_head.safetensors"))


def set_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


MEDUSA_DAMAGE = {
    "int32 weights": (lambda f: change_state(f, lambda s: {k: v.to(torch.int32) for k, v in s.items()}),
                      r"is torch.int32; Medusa weights are floating point"),
    "float16 bias shape": (lambda f: change_state(f, lambda s: {**s, "0.0.linear.bias": s["0.0.linear.bias"][:5]}),
                           r"tensor '0.0.linear.bias' has shape \(5,\) but .* needs \(32,\)"),
    "projection of another width": (lambda f: change_state(f, lambda s: {**s, "1.1.weight": torch.zeros(96, 8)}),
                                    r"tensor '1.1.weight' has shape \(96, 8\)"),
    "projection of another vocabulary": (lambda f: change_state(f, lambda s: {**s, "1.1.weight": torch.zeros(90, 32)}),
                                         r"tensor '1.1.weight' has shape \(90, 32\) .* needs \(96, 32\)"),
    "inf weight": (lambda f: change_state(f, lambda s: {**s, "0.1.weight": s["0.1.weight"].index_fill(0, torch.tensor([3]),
                                                                                                       float("inf"))}),
                   r"tensor '0.1.weight' holds NaN or infinite values"),
    "config not JSON": (lambda f: (f / "config.json").write_bytes(b"\xff\xfe{"), r"config.json is not valid JSON"),
    "config a string": (lambda f: (f / "config.json").write_text('"medusa"'), r"holds a JSON str, not a Medusa config"),
    "layers a string": (lambda f: set_config(f, medusa_num_layers="abc"), r"medusa_num_layers must be a positive integer"),
    "heads a float": (lambda f: set_config(f, medusa_num_heads=2.5), r"medusa_num_heads must be a positive integer"),
    "heads a bool": (lambda f: set_config(f, medusa_num_heads=True), r"medusa_num_heads must be a positive integer"),
    "heads miscounted": (lambda f: set_config(f, medusa_num_heads=5), r"medusa_num_heads=5 but .* holds 2"),
}


@pytest.mark.parametrize("case", MEDUSA_DAMAGE)
def test_a_damaged_medusa_checkpoint_is_refused_before_converting(tmp_path, case):
    write_medusa(tmp_path / "medusa", reference_heads(32, 96, heads=2, layers=1, projection=True), 1, "safetensors")
    import_medusa(tmp_path / "medusa", fingerprint(MODEL).to_dict())  # the undamaged checkpoint converts
    damage, message = MEDUSA_DAMAGE[case]
    damage(tmp_path / "medusa")
    with pytest.raises(CheckpointError, match=message):
        import_medusa(tmp_path / "medusa", fingerprint(MODEL).to_dict())


def test_a_pt_medusa_checkpoint_with_non_tensor_entries_is_refused(tmp_path):
    folder = tmp_path / "medusa"
    write_medusa(folder, reference_heads(32, 96, heads=2, layers=1, projection=False), 1, "pt")
    state = torch.load(folder / "medusa_lm_head.pt", weights_only=True)
    torch.save({**state, "0.0.linear.weight": 3}, folder / "medusa_lm_head.pt")
    with pytest.raises(CheckpointError, match=r"medusa_lm_head.pt: entries \['0.0.linear.weight'\] are not named tensors"):
        import_medusa(folder, fingerprint(MODEL).to_dict())


# -- head configs, training reports, bench results -------------------------------------------------
def saved_heads(folder: Path) -> Path:
    MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96,
                           base_fingerprint=fingerprint(MODEL).to_dict())).save_pretrained(folder)
    return folder


def test_a_base_model_folder_is_not_a_head_checkpoint(tmp_path):
    """Both files a checkpoint has, but a model's config: refused before any upload or load."""
    MODEL.save_pretrained(tmp_path / "base")
    for check in (check_checkpoint_folder, load_heads):
        with pytest.raises(CheckpointError, match=r"base/config.json is a model's config \(model_type 'llama'\)"):
            check(tmp_path / "base")


REPORT_DAMAGE = {
    "truncated": ('{"recipe": {"name"', r"training_report.json is not valid JSON"),
    "binary": (b"\x00\x01\xff\xfe", r"training_report.json is not valid JSON"),
    "a list": ("[]", r"training_report.json holds a JSON list, not a training report"),
    "key-less": ('{"command": "x"}', r"training_report.json lacks what the card cites \(KeyError: 'recipe'\)"),
    "measured not an object": ('{"measured": 3}', r"'measured' must be an object with a 'results' path"),
    "results missing": ('{"measured": {"results": "nowhere.json", "command": "c"}}', r"nowhere.json .* not found"),
    "results corrupt": ('{"measured": {"results": "bad.json", "command": "c"}}', r"bad.json is not valid JSON"),
    "served not an object": ('{"served": 3}', r"'served' must be an object with a 'results' path"),
    "served missing": ('{"served": {"results": "nowhere.json"}}', r"nowhere.json .* not found: run the card command"),
    "served corrupt": ('{"served": {"results": "bad.json"}}', r"bad.json is not valid JSON"),
    "served of other heads": ('{"served": {"results": "other.json"}}',
                              r"other.json is the engine check of 'checkpoints/smollm2-135m-medusa', not of ckpt"),
}


@pytest.mark.parametrize("case", REPORT_DAMAGE)
def test_a_damaged_training_report_or_results_file_is_named(tmp_path, case):
    folder = saved_heads(tmp_path / "ckpt")
    card_for_checkpoint(folder)  # without a report: the basic card
    content, message = REPORT_DAMAGE[case]
    (tmp_path / "bad.json").write_text('{"checkpoints": ')
    (tmp_path / "other.json").write_text('{"heads": "checkpoints/smollm2-135m-medusa"}')
    report = folder / "training_report.json"
    report.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DraftheadsError, match=message):
        card_for_checkpoint(folder, root=tmp_path)


# -- recipes and a run's recipe.json ---------------------------------------------------------------
RECIPE_VALUES = [("train.lr", ".nan"), ("train.lr", ".inf"), ("train.lr", "-.inf"), ("train.epochs", ".inf"),
                 ("train.epochs", ".nan"), ("loss.temperature", ".nan"), ("loss.head_decay", ".inf"),
                 ("train.warmup_ratio", ".nan"), ("adversarial.weight", ".nan"), ("loss.kl_weight", ".inf")]


@pytest.mark.parametrize("key,value", RECIPE_VALUES)
def test_recipe_floats_must_be_finite(key, value):
    with pytest.raises(RecipeError, match=rf"Recipe key {key} must be a finite number, got -?(nan|inf)"):
        load_recipe(None, [f"--{key}", value])


@pytest.mark.parametrize("content,message", [
    (b"\x89PNG\r\n\x1a\n\x00\xff", r"is not a text file"),
    ("- a\n- b\n", r"holds a YAML list at the top level"),
    ("just a string\n", r"holds a YAML str at the top level"),
    ("train: {lr: .nan}\n", r"train.lr must be a finite number"),
    ("train: [1, 2]\n", r"section train must be a mapping"),
])
def test_a_bad_recipe_file_is_one_error(tmp_path, content, message):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(RecipeError, match=message):
        load_recipe(path, ["--train.lr", "0.1"] if "lr" not in str(content) else ["--epochs", "2"])


@pytest.mark.parametrize("content,message", [("{\"name\": ", "is not valid JSON"), ("[]", "holds a JSON list"),
                                             (b"\xff\x00", "is not valid JSON")])
def test_a_corrupt_recipe_json_in_a_resume_checkpoint_is_named(tmp_path, content, message):
    from draftheads.training.resume import check_same_recipe

    recipe = load_recipe(tiny_recipe(tmp_path, "run"))
    step = tmp_path / "run" / "checkpoints" / "step-0000004"
    step.mkdir(parents=True)
    (step / "recipe.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(RecipeError, match=rf"{step / 'recipe.json'} {message}.*run.resume=never"):
        check_same_recipe(step, recipe)
