"""scripts/engine_check.py without vLLM: the runner it writes into the engine's venv compiles, the
command line picks the checkpoint and results for ``--to``, the export goes through the same
functions as ``draftheads export`` (the speculators layout naming the base's folder as verifier),
the speculative config vLLM gets is ``method: eagle3`` for it, and the summary and fixture are
computed from the engine's JSON as described."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import REPO, load_script, random_heads


@pytest.fixture(scope="module")
def check():
    return load_script("engine_check")


def test_the_runner_compiles_and_reads_the_jobs_speculative_config(check):
    compile(check.RUNNER, "runner.py", "exec")
    assert 'job["speculative"]' in check.RUNNER
    assert check.speculative_config("speculators", "/d", 3) == {"method": "eagle3", "model": "/d",
                                                                "num_speculative_tokens": 3}
    assert check.speculative_config("vllm-medusa", "/d", 4)["method"] == "medusa"
    assert check.speculative_config("speculators", "/d", 3, [[1, 2, 3], [3, 8, 1]])[
        "num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 8, 1]]


def test_the_command_line_picks_the_heads_for_the_target(check):
    assert check.parse([]).heads == REPO / "checkpoints" / "smollm2-135m-medusa"
    args = check.parse(["--to", "speculators", "--dtype", "float32"])
    assert (args.to, args.heads, args.dtype) == ("speculators", REPO / "checkpoints" / "smollm2-135m-eagle3", "float32")
    with pytest.raises(SystemExit):
        check.parse(["--to", "specforge"])  # vLLM is checked on the speculators layout


def test_the_speculators_export_is_the_commands(check, tmp_path):
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    base.save_pretrained(tmp_path / "base")
    base = LlamaForCausalLM.from_pretrained(tmp_path / "base")
    heads = random_heads("eagle3", base, draft_vocab=16, extra={"num_attention_heads": 4, "num_key_value_heads": 2})
    out = check.export(heads, base, "speculators", tmp_path, "float32")
    config = json.loads((out / "config.json").read_text())
    assert out == tmp_path / "speculators" and config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "base")


def test_summary_and_fixture(check, tmp_path):
    job = {"reference": [[1, 2], [3]], "prompts": [[0], [0]], "chain_taus": [1.0, 1.4, 1.5], "chain_at_bs1": 1,
           "schedule": [[1, 4, 1], [5, 32, 0]], "speculative": {"method": "eagle3", "model": "/d",
                                                               "num_speculative_tokens_per_batch_size": [[1, 4, 1], [5, 32, 0]]}}
    engine = {"vllm": "0.32.0", "outputs": [[1, 2], [4]], "seconds": 2.0,
              "before": {"vllm:spec_decode_num_drafts": 1, "vllm:spec_decode_num_accepted_tokens": 0},
              "after": {"vllm:spec_decode_num_drafts": 3, "vllm:spec_decode_num_accepted_tokens": 3}}
    plain = {"outputs": [[1, 2], [3]], "seconds": 1.0}
    summary = check.summarize(job, engine, plain)
    assert (summary["tokens_per_second"], summary["vllm_mean_accepted_per_step"], summary["same_as_hf_prompts"],
            summary["same_as_vllm_plain_prompts"]) == (1.5, 2.5, 1, 1)
    # compared with draftheads' chain of the length vLLM drafts at one row (the schedule's first k)
    assert summary["draftheads_chain_tau"] == 1.4 and "model" not in summary["speculative_config"]
    assert summary["num_speculative_tokens_per_batch_size"] == [[1, 4, 1], [5, 32, 0]]
    from safetensors.torch import save_file

    (tmp_path / "draft").mkdir()
    save_file({"fc.weight": torch.zeros(2, 6)}, str(tmp_path / "draft" / "model.safetensors"))
    (tmp_path / "draft" / "config.json").write_text(json.dumps({"a": 1, "draftheads": {}}))
    check.record_fixture(tmp_path / "draft", {"model.fc.weight": [2, 6]}, "0.32.0", tmp_path / "f.json")
    recorded = json.loads((tmp_path / "f.json").read_text())
    assert recorded["config"] == {"a": 1} and recorded["tensors"] == {"fc.weight": [2, 6]}
