"""``draftheads card / import-medusa / export``: the shipped cards are what the generator makes
from the recorded figures, and the commands run end to end on a tiny base saved to disk."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, tiny_llama
from draftheads.cli import main
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import HeadConfig, HydraHeads, load_heads
from draftheads.core.atomic import current_umask
from draftheads.heads.checkpoint.card import card_for_checkpoint
from draftheads.heads.checkpoint.medusa_import import import_medusa
from helpers import draftheads_full_logits, vllm_medusa_reference
from helpers import reference_heads, write_medusa

SHIPPED = sorted(p for p in (REPO / "checkpoints").iterdir() if (p / "config.json").is_file())


@pytest.mark.parametrize("checkpoint", SHIPPED, ids=lambda p: p.name)
def test_shipped_cards_are_generated_from_recorded_figures(checkpoint):
    card = (checkpoint / "README.md").read_text()
    assert card == card_for_checkpoint(checkpoint, name=f"checkpoints/{checkpoint.name}", root=REPO)
    assert main(["card", str(checkpoint), "--check", "--root", str(REPO), "--name", f"checkpoints/{checkpoint.name}"]) == 0
    front = card.split("---\n")[1]
    for key in ("base_model: HuggingFaceTB/SmolLM2-135M-Instruct", "library_name: draftheads", "license: apache-2.0",
                "tags:", "datasets:"):
        assert key in front
    # the figures cited are those in the results JSON the cited command wrote
    report = json.loads((checkpoint / "training_report.json").read_text())
    measured = report["measured"]
    assert f"`{measured['command']}`" in card and measured["command"].endswith(
        "--out " + str(Path(measured["results"]).parent))
    entry = json.loads((REPO / measured["results"]).read_text())["checkpoints"][checkpoint.name]
    mt = entry["speed"]["groups"]["mt_bench"]
    assert f"τ {mt['tau']:.2f}, {mt['speedup']:.2f}× HF `generate`" in card
    overall = entry["speed"]["overall"]  # differing answers come with how many left the dtype's band
    differ = f"{overall['mismatching_prompts']}/{overall['prompts']} prompts differ from HF greedy `generate`"
    assert differ + (f", {overall['divergences_outside_band']} of them outside" if overall["mismatching_prompts"]
                     else ".") in card
    assert f"{report['train_wall_seconds']} s wall time" in card
    served = report.get("served")  # the run in a serving engine, where the card cites one
    assert served or checkpoint.name != "smollm2-135m-eagle3"  # the EAGLE-3 heads are shipped to be served
    if served:
        result = json.loads((REPO / served["results"]).read_text())
        assert Path(result["heads"]).name == checkpoint.name and f"`{result['command']}`" in card
        assert f"- {result['same_as_hf_prompts']}/{result['prompts']} prompts: the same tokens as HF greedy" in card
        assert (f"{result['vllm_mean_accepted_per_step']:.3f} in vLLM, {result['draftheads_chain_tau']:.3f} in "
                "draftheads" in card)
    assert "| 1 | {:.3f} | {:.3f} |".format(report["accuracy"]["top1"][0], report["accuracy"]["top5"][0]) in card


def test_card_records_the_cited_results_and_writes_the_shipped_card(tmp_path, capsys):
    """``card --results --command --served`` point a report at its benchmark and engine check: on a copy
    of the shipped EAGLE-3 checkpoint with both pointers removed, the card comes out as shipped."""
    shipped = REPO / "checkpoints" / "smollm2-135m-eagle3"
    copy = tmp_path / shipped.name
    copy.mkdir()
    for name in ("config.json", "model.safetensors", "curves.json"):
        (copy / name).write_bytes((shipped / name).read_bytes())
    report = json.loads((shipped / "training_report.json").read_text())
    measured, served = report.pop("measured"), report.pop("served")
    (copy / "training_report.json").write_text(json.dumps(report))
    args = ["card", str(copy), "--root", str(REPO), "--name", f"checkpoints/{shipped.name}"]
    with pytest.raises(SystemExit) as stop:  # a user error: one line on stderr, exit status 2
        main(args + ["--results", measured["results"]])
    assert stop.value.code == 2
    assert "--results needs --command, the exact command that wrote the results." in capsys.readouterr().err
    assert "measured" not in json.loads((copy / "training_report.json").read_text())  # nothing recorded
    assert main(args + ["--results", measured["results"], "--command", measured["command"], "--date", measured["date"],
                        "--served", served["results"]]) == 0
    assert (copy / "README.md").read_text() == (shipped / "README.md").read_text()
    recorded = json.loads((copy / "training_report.json").read_text())
    assert recorded["measured"] == measured and recorded["served"] == served


def test_card_check_fails_on_a_stale_card(tmp_path):
    heads = HydraHeads(HeadConfig(family="hydra", num_heads=2, hidden_size=8, vocab_size=10))
    heads.save_pretrained(tmp_path, card="hand-edited")
    assert main(["card", str(tmp_path), "--check"]) == 1
    assert main(["card", str(tmp_path)]) == 0 and main(["card", str(tmp_path), "--check"]) == 0
    assert (tmp_path / "README.md").read_text().startswith("---\nlibrary_name: draftheads\n")
    assert (tmp_path / "README.md").stat().st_mode & 0o777 == 0o666 & ~current_umask()  # not mkstemp's 0600


def test_import_then_export_from_the_command_line(tmp_path):
    model = tiny_llama(0)
    model.save_pretrained(tmp_path / "base")
    module = reference_heads(32, 96, heads=2, layers=1, projection=False)
    write_medusa(tmp_path / "medusa", module, 1, "safetensors")
    assert main(["import-medusa", str(tmp_path / "medusa"), str(tmp_path / "ours"), "--base", str(tmp_path / "base")]) == 0
    ours = load_heads(tmp_path / "ours", expected_fingerprint=fingerprint(model).to_dict(), dtype=torch.float64)
    direct = import_medusa(tmp_path / "medusa", fingerprint(model).to_dict())
    hidden = torch.randn(4, 32, dtype=torch.float64)
    assert torch.equal(ours.bind(model.lm_head.weight)(hidden), direct.bind(model.lm_head.weight)(hidden))
    assert "Imported with `draftheads import-medusa`" in (tmp_path / "ours" / "README.md").read_text()

    assert main(["export", "--to", "vllm-medusa", str(tmp_path / "ours"), str(tmp_path / "vllm"), "--base",
                 str(tmp_path / "base"), "--dtype", "float32", "--share-lm-head"]) == 0
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["original_lm_head"] is True
    assert set(load_file(str(tmp_path / "vllm" / "model.safetensors"))) == {
        "blocks.0.layers.0.weight", "blocks.0.layers.0.bias", "blocks.1.layers.0.weight", "blocks.1.layers.0.bias",
        "lm_heads.0.weight"}
    hidden32 = hidden.float()
    ref = vllm_medusa_reference(tmp_path / "vllm", hidden32)
    assert torch.allclose(ref.double(), draftheads_full_logits(ours, hidden32.double()), atol=1e-5)


def test_command_line_errors_are_messages(tmp_path, capsys):
    model = tiny_llama(0)
    model.save_pretrained(tmp_path / "base")
    HydraHeads(HeadConfig(family="hydra", num_heads=2, hidden_size=32, vocab_size=96,
                          base_fingerprint=fingerprint(model).to_dict())).save_pretrained(tmp_path / "hydra")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--to", "vllm-mlp-speculator", str(tmp_path / "hydra"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: Cannot export 'hydra' heads to vLLM's MLPSpeculator")
    write_medusa(tmp_path / "medusa", reference_heads(32, 128, 2, 1, True), 1, "pt")
    with pytest.raises(SystemExit) as exit_info:
        main(["import-medusa", str(tmp_path / "medusa"), str(tmp_path / "x"), "--base", str(tmp_path / "base")])
    assert exit_info.value.code == 2 and "error: Vocabulary-size mismatch" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "x").exists()


def float_dtypes(path: Path) -> set[torch.dtype]:
    return {t.dtype for t in load_file(str(path)).values() if t.is_floating_point()}


@pytest.mark.parametrize("option, expected", [(None, torch.float64), ("keep", torch.float64), ("float32", torch.float32),
                                              ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_import_and_export_write_the_dtype_asked_for(tmp_path, option, expected):
    """``--save-dtype`` (default keep: the float64 source stays float64) and ``--dtype`` (default bfloat16)."""
    tiny_llama(0).save_pretrained(tmp_path / "base")
    write_medusa(tmp_path / "medusa", reference_heads(32, 96, heads=2, layers=1, projection=False), 1, "safetensors")
    extra = [] if option is None else ["--save-dtype", option]
    assert main(["import-medusa", str(tmp_path / "medusa"), str(tmp_path / "ours"), "--base", str(tmp_path / "base"),
                 *extra]) == 0
    assert float_dtypes(tmp_path / "ours" / "model.safetensors") == {expected}
    if option in (None, "keep"):
        option = "bfloat16"  # export's default
        expected = torch.bfloat16
    extra = [] if option == "bfloat16" else ["--dtype", option]
    assert main(["export", "--to", "vllm-medusa", str(tmp_path / "ours"), str(tmp_path / "vllm"), "--base",
                 str(tmp_path / "base"), *extra]) == 0
    assert float_dtypes(tmp_path / "vllm" / "model.safetensors") == {expected}
    with pytest.raises(SystemExit):
        main(["export", "--to", "vllm-medusa", str(tmp_path / "ours"), str(tmp_path / "x"), "--dtype", "keep"])
