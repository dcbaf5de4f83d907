"""lm-evaluation-harness as its users run it (scripts/lm_eval_gsm8k.py): the committed GSM8K task
(``draftheads/data/gsm8k_sample.yaml``, ``dataset_path: json`` on the committed problems, no Hub)
through lm-eval's own HF model class, plain and with ``custom_generate`` and the shipped heads on
the same SmolLM2 object (float32): identical generations and identical score. The full run (30
problems, the time ratio) is ``results/lm_eval/``."""
from __future__ import annotations


import pytest
import yaml

from draftheads.prompts import DATA_DIR
from helpers import REPO, load_script




def test_the_task_reads_the_committed_problems():
    """The task YAML names a file beside it, which the script resolves; nothing outside the clone."""
    task = yaml.safe_load((DATA_DIR / "gsm8k_sample.yaml").read_text())
    assert task["dataset_path"] == "json" and task["output_type"] == "generate_until"
    assert (DATA_DIR / task["dataset_kwargs"]["data_files"]["test"]).is_file()
    config = load_script("lm_eval_gsm8k").task_config(DATA_DIR / "gsm8k_sample.yaml", None, 32)
    assert config["dataset_kwargs"]["data_files"]["test"] == str((DATA_DIR / "gsm8k_test_sample.jsonl").resolve())
    assert config["generation_kwargs"]["max_gen_toks"] == 32


@pytest.mark.slow
def test_lm_eval_with_the_heads_gives_the_plain_models_generations_and_score(smollm2):
    report = load_script("lm_eval_gsm8k").run(str(REPO / "checkpoints" / "smollm2-135m-hydra"), limit=3, dtype="float32",
                               max_gen_toks=48, model=smollm2)
    assert report["problems"] == 3
    assert report["identical_generations"] == 3, report["first_different"]
    assert report["identical_score"] and report["plain"] == report["draftheads"]
    assert report["time_ratio"] > 0 and all(text.strip() for text in report["generations"]["plain"])
