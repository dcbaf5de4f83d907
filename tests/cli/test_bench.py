"""draftheads/bench: what every bench shares — runs interleave in a rotating order and keep the fastest repeat; τ over a run."""
from __future__ import annotations

import pytest

from draftheads.bench import keep_fastest, rotated
from draftheads.bench.summary import run_tau
from draftheads.decoding.loop import tau


def test_strategies_rotate_and_the_fastest_repeat_counts():
    assert [rotated(["a", "b", "c"], k) for k in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                               ["a", "b", "c"]]
    best: dict = {}
    for run in (("x", 2.0), ("y", 1.0), ("z", 3.0)):
        keep_fastest(best, "hf", run)
    assert best == {"hf": ("y", 1.0)}


def test_a_prompts_entries_rotate_and_each_keeps_its_fastest_run(monkeypatch):
    """The bs-1 bench: HF, each drafting configuration and HF prompt lookup run ``repeats``
    times per prompt, in an order rotated by the prompt's index, and each entry reports its
    fastest run — the τ and steps of that very run, not of its last."""
    import torch

    from draftheads.bench import single

    ids, answer = torch.tensor([[5, 6]]), torch.tensor([[5, 6, 7, 8, 9]])
    calls: list[str] = []
    seconds = {"hf": iter([2.0, 1.0]), "prompt_lookup": iter([1.5, 3.0])}

    def fake_timed(fn):
        return fn(), next(seconds[calls[-1]])

    def fake_greedy(base, ids, max_new_tokens, **kwargs):
        calls.append("prompt_lookup" if kwargs else "hf")
        return answer

    runs = {"a": iter([(2.0, (1.5, 2, 0.1)), (1.0, (3.0, 1, 0.1))]), "b": iter([(0.5, (1.5, 2, 0.1)), (0.75, (3.0, 1, 0.1))])}

    def fake_drafted(variant, ids, max_new_tokens):  # a configuration's light model: here its name
        calls.append(variant)
        took, stats = next(runs[variant])
        return answer, took, stats

    monkeypatch.setattr(single, "timed", fake_timed)
    monkeypatch.setattr(single, "hf_greedy", fake_greedy)
    monkeypatch.setattr(single, "draftheads_run", fake_drafted)
    model = type("Model", (), {"base": None, "drafter": None})()
    row, plain = single.bench_prompt(model, ids, 3, control=True, configs={"a": "a", "b": "b"}, repeats=2, shift=1)
    # entries hf, a, b, prompt_lookup; prompt 1 of 2 repeats: rotations 2 and 3
    assert calls == ["b", "prompt_lookup", "hf", "a", "prompt_lookup", "hf", "a", "b"]
    assert row["hf"]["seconds"] == 1.0 and row["prompt_lookup"]["seconds"] == 1.5
    assert (row["sources"]["a"]["seconds"], row["sources"]["a"]["tau"], row["sources"]["a"]["verify_steps"]) == (1.0, 3.0, 1)
    assert (row["sources"]["b"]["seconds"], row["sources"]["b"]["tau"], row["sources"]["b"]["verify_steps"]) == (0.5, 1.5, 2)
    assert row["draftheads"]["seconds"] == 0.5 and row["speedup"] == 2.0  # b, the last configuration, heads the row
    assert row["sources"]["a"]["mismatch"] is None and torch.equal(plain, answer)


def test_tau_is_tokens_per_verification():
    assert tau(3, 3) == pytest.approx(2.0)  # (3 accepted + 3 bonus) / 3 steps
    assert tau(0, 0) == 0.0
    assert run_tau(new_tokens=13, prompts=1, steps=4) == 3.0  # after the prefill token


def test_parts_bench_times_the_default_beside_its_parts(tmp_path, monkeypatch):
    """``draftheads bench --parts --twin``: every prompt through the heads alone, the lookups
    alone, a twin of the default (built apart: the A/A control) and the default (last, the
    headline), each identical to HF in float64; the summary's ``default_vs_best_part`` is the
    default's tokens/s over the faster part's (the twin is no part), ``twin_vs_default`` the
    twin's over the default's, per category."""
    import json

    from draftheads.cli import main
    from helpers import save_tiny_base, save_tiny_heads

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    base = save_tiny_base(tmp_path / "base")
    save_tiny_heads(tmp_path / "heads", base)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n"
                               for p, c in (("w5 w6 w7 w5 w6", "a"), ("w9 w8 w9 w8", "b"), ("w11 w12", "a"))))
    out = tmp_path / "bench"
    assert main(["bench", "--prompts", str(prompts), "--base", str(tmp_path / "base"), "--heads", str(tmp_path / "heads"),
                 "--dtype", "float64", "--tree", "3", "--max-new-tokens", "12", "--parts", "--twin", "--repeats", "2",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["sources"] == ["heads", "context", "twin", "default"]
    for row in results["per_prompt"]:
        assert list(row["sources"]) == ["heads", "context", "twin", "default"]
        assert all(run["mismatch"] is None for run in row["sources"].values())
    for summary in [*results["by_category"].values(), results["overall"]]:
        speeds = {name: d["tokens_per_second"] for name, d in summary["sources"].items()}
        expected = speeds["default"] / max(speeds["heads"], speeds["context"])
        assert summary["default_vs_best_part"] == pytest.approx(expected, rel=1e-3)
        assert summary["twin_vs_default"] == pytest.approx(speeds["twin"] / speeds["default"], rel=1e-3)
    assert (out / "sources.png").is_file()


def test_parts_is_refused_beside_another_comparison(capsys):
    from draftheads.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--prompts", "mt-bench@1", "--parts", "--sources", "all"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --parts compares the default with its parts in the bs-1 bench: drop --sources/--batch-sizes."]


def test_twin_without_parts_is_refused(capsys):
    from draftheads.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--prompts", "mt-bench@1", "--twin"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --twin is the control of --parts: add --parts."]


def test_a_runs_source_configurations_read_alike_under_the_old_key_and_the_new():
    """Runs written before the rename keep ``drafts`` (and ``default_drafts``) on disk; every
    reader goes through ``with_sources``, which gives both under ``sources``, the old run's
    configurations winning over the command's own ``--sources`` in ``meta``."""
    from draftheads.bench.summary import with_sources

    timing = {"speedup": 2.0, "tau": 1.5}
    old = {"meta": {"sources": None, "drafts": ["heads", "default"], "default_drafts": ["heads", "context"]},
           "overall": {"drafts": {"heads": timing}}, "by_category": {"qa": {"drafts": {"heads": timing}}},
           "per_prompt": [{"id": 1, "drafts": {"heads": timing}}]}
    new = {"meta": {"sources": ["heads", "default"], "default_sources": ["heads", "context"]},
           "overall": {"sources": {"heads": timing}}, "by_category": {"qa": {"sources": {"heads": timing}}},
           "per_prompt": [{"id": 1, "sources": {"heads": timing}}]}
    assert with_sources(old) == with_sources(new) == new
    assert "drafts" in old["overall"]  # the payload read is not changed
