"""scripts/compare_heads.py end to end on a tiny random Llama (float64, so greedy tree decoding
must be token-identical to HF) with two saved checkpoints of different families."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import load_script, tiny_llama
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import HeadConfig, build_heads

TREES = {"1": [[0]], "4": [[0], [1], [0, 0], [0, 0, 0]],
         "8": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]}
PROMPTS = [{"id": 1, "category": "writing", "prompt": "Write a short poem about the sea."},
           {"id": 2, "category": "roleplay", "prompt": "Pretend to be a pirate captain."},
           {"id": 3, "category": "translation", "prompt": "Translate: the cat sleeps on the mat."},
           {"id": 4, "category": "translation", "prompt": "Translate: good morning, dear friends."}]




class CharTokenizer:
    """A trivial chat template: BOS, then one id per character (never EOS or pad)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=True):
        text = messages[-1]["content"]
        return {"input_ids": [1] + [3 + ord(ch) % (self.vocab - 3) for ch in text]}


def save_random_heads(model, family: str, directory: Path, seed: int, extra: dict) -> int:
    """Random (non-zero) heads saved as a checkpoint; returns their parameter count."""
    cfg = model.config
    heads = build_heads(HeadConfig(family=family, num_heads=3, num_layers=1, hidden_size=cfg.hidden_size,
                                   vocab_size=cfg.vocab_size, base_fingerprint=fingerprint(model).to_dict(),
                                   trees=TREES, extra=extra))
    torch.manual_seed(seed)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    heads.save_pretrained(directory)
    return sum(p.numel() for p in heads.parameters())


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    script = load_script("compare_heads")
    tmp = tmp_path_factory.mktemp("compare")
    model = tiny_llama(0)
    medusa, hydrapp = tmp / "tiny-medusa", tmp / "tiny-hydrapp"
    koala = {"label": "KOALA-Medusa", "layers": 1}  # what training records (config.koala)
    params = {"tiny-medusa": save_random_heads(model, "medusa", medusa, 1, {"default_budget": 4, "koala": koala}),
              "tiny-hydrapp": save_random_heads(model, "hydra++", hydrapp, 2, {"default_budget": 8})}
    (medusa / "training_report.json").write_text(json.dumps({
        "train_wall_seconds": 90.0, "train_tokens_per_second": 1234.0,
        "accuracy": {"top1": [0.5, 0.4, 0.3], "top5": [0.7, 0.6, 0.5]}}))
    out = tmp / "out"
    results = script.compare(model, CharTokenizer(model.config.vocab_size), [medusa, hydrapp], PROMPTS, PROMPTS,
                             out, max_new_tokens=16, accuracy_max_new_tokens=24, answers_cache=tmp / "answers.jsonl",
                             latency_steps=3, log=lambda message: None)
    return script, results, out, params, tmp


def test_one_entry_per_checkpoint_token_identical_to_hf(compared):
    _, results, _, params, _ = compared
    assert set(results["checkpoints"]) == set(params)
    assert len(results["per_prompt"]) == len(PROMPTS)
    for row in results["per_prompt"]:
        assert row["hf"]["new_tokens"] > 1
        assert set(row["checkpoints"]) == set(params)
        assert all(e["mismatch"] is None for e in row["checkpoints"].values())
    for name, entry in results["checkpoints"].items():
        overall = entry["speed"]["overall"]
        assert overall["mismatching_prompts"] == 0 and overall["prompts"] == len(PROMPTS)
        assert overall["tau"] >= 1.0 and overall["speedup"] > 0
        assert set(entry["speed"]["groups"]) == {"mt_bench", "translation"}
        assert entry["speed"]["groups"]["mt_bench"]["prompts"] == 2  # writing + roleplay
        assert all(g["tau"] >= 1.0 for g in entry["speed"]["groups"].values())
        assert entry["parameters"] == params[name]


def test_accuracy_and_report(compared):
    _, results, _, _, tmp = compared
    assert (tmp / "answers.jsonl").is_file()  # the base's answers are cached for the next run
    for entry in results["checkpoints"].values():
        acc = entry["accuracy"]["accuracy"]
        assert len(acc["top1"]) == len(acc["top5"]) == 3
        assert all(0.0 <= a <= b <= 1.0 for a, b in zip(acc["top1"], acc["top5"]))
        assert entry["accuracy"]["positions"] > 0
        assert entry["accuracy"]["tree_tau_used"] >= 1.0
    medusa, hydrapp = results["checkpoints"]["tiny-medusa"], results["checkpoints"]["tiny-hydrapp"]
    assert medusa["label"] == "KOALA-Medusa" and hydrapp["label"] == "Hydra++"
    assert medusa["training"]["train_seconds"] == 90.0
    assert medusa["training"]["held_out_accuracy"]["top1"] == [0.5, 0.4, 0.3]
    assert hydrapp["training"]["train_seconds"] is None and hydrapp["training"]["held_out_accuracy"] is None
    assert (medusa["tree_budget"], medusa["tree_nodes"]) == (4, 5)
    assert (hydrapp["tree_budget"], hydrapp["tree_nodes"]) == (8, 9)


def test_latency(compared):
    _, results, _, _, _ = compared
    for entry in results["checkpoints"].values():
        latency = entry["latency"]
        assert latency["drafting_ms"] > 0 and latency["verify_ms_mean"] > 0
        assert latency["tree_nodes"] == entry["tree_nodes"]
    assert results["checkpoints"]["tiny-hydrapp"]["latency"]["context_step_ms"] > 0  # the contextual step is timed


def test_files_written(compared):
    _, results, out, params, _ = compared
    assert json.loads((out / "results.json").read_text())["checkpoints"].keys() == results["checkpoints"].keys()
    table = (out / "table.md").read_text()
    for name in params:
        rows = [line for line in table.splitlines() if line.startswith(f"| {name} |")]
        assert len(rows) == 3  # main table, accuracy table, per-category table
    main_header = next(line for line in table.splitlines() if line.startswith("| Checkpoint | Family"))
    medusa_row = next(line for line in table.splitlines() if line.startswith("| tiny-medusa | KOALA-Medusa"))
    assert medusa_row.count("|") == main_header.count("|")
    assert "90 s @ 1234 pos/s" in medusa_row and "0.50 / 0.40 / 0.30" in medusa_row
    assert "| tiny-hydrapp | Hydra++" in table and "—" in table
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_select_prompts_by_category_and_group(compared):
    script = compared[0]
    records = PROMPTS + [{"id": 5, "category": "writing", "prompt": "x"}]
    assert [p["id"] for p in script.select_prompts(records, 1, None)] == [1, 2, 3]
    assert [p["id"] for p in script.select_prompts(records, 2, ["mt_bench"])] == [1, 2, 5]
    assert [p["id"] for p in script.select_prompts(records, 5, ["translation"])] == [3, 4]
