"""scripts/data_scaling.py's pure parts: which family a run's recipe trains, the papers' orderings
checked on the decoded τ, and the table that reports them."""
from __future__ import annotations


from helpers import load_script




def row(family: str, limit: int, tau: float) -> dict:
    return {"family": family, "limit": limit, "sequences": 10, "positions": 100, "decoded": {"tau": tau},
            "teacher_forced": {"mt_bench": {"accuracy": {"top1": [0.4, 0.3]}, "tree_tau_8": 1.9}},
            "generation_seconds": 60.0, "features_seconds": 0.0, "training_seconds": 120.0}


def test_family_label_names_koala_runs_by_their_family():
    script = load_script("data_scaling")
    assert script.family_label({"heads": {"family": "hydra++"}}) == "Hydra++"
    assert script.family_label({"heads": {"family": "hydra"}, "adversarial": {"enabled": False}}) == "Hydra"
    assert script.family_label({"heads": {"family": "hydra"}, "adversarial": {"enabled": True}}) == "KOALA-Hydra"


def test_orderings_compare_families_only_within_one_size():
    script = load_script("data_scaling")
    rows = [row("Medusa", 400, 1.5), row("Hydra", 400, 1.6), row("Hydra++", 400, 1.55),
            row("Amphista", 400, 1.4), row("KOALA-Hydra", 400, 1.7),
            row("Medusa", 0, 1.7), row("Hydra", 1200, 1.9)]  # no pair at 0 or 1200
    checks = script.orderings(rows)
    assert [(c["claim"], c["holds"]) for c in checks] == [
        ("Medusa < Hydra", True), ("Hydra < Hydra++", False), ("Medusa < Amphista", False),
        ("Hydra < KOALA-Hydra", True)]
    assert {c["limit"] for c in checks} == {400}
    assert checks[1]["low"] == 1.6 and checks[1]["high"] == 1.55


def test_a_tie_does_not_hold():
    script = load_script("data_scaling")
    assert script.orderings([row("Medusa", 0, 1.6), row("Hydra", 0, 1.6)])[0]["holds"] is False


def test_the_table_carries_each_family_and_the_orderings():
    script = load_script("data_scaling")
    table = script.markdown([row("Medusa", 0, 1.5), row("Hydra", 0, 1.6)])
    assert "| Medusa | 10 | 100 | 0.40 / 0.30 | 1.90 | 1.50 | 1 min | 0 min | 2 min |" in table
    assert "| all | Medusa < Hydra | 1.50 vs 1.60 | — | yes |" in table
    assert "Ordering" not in script.markdown([row("Hydra", 0, 1.6)])


def test_a_paired_bootstrap_tells_a_clear_ordering_from_noise():
    script = load_script("data_scaling")
    low = [[41, 40], [61, 50], [81, 60], [31, 30]] * 6  # τ 1.0 .. 1.33 a prompt
    better = [[t, max(1, s - 12)] for t, s in low]      # fewer steps on every prompt
    noisy = [[t, s + (3 if i % 2 else -3)] for i, (t, s) in enumerate(low)]  # ± on alternate prompts
    rows = [row("Medusa", 0, 1.0), row("Hydra", 0, 1.2), row("Amphista", 0, 1.0)]
    rows[0]["decoded"]["per_prompt"], rows[1]["decoded"]["per_prompt"] = low, better
    rows[2]["decoded"]["per_prompt"] = noisy
    checks = {c["claim"]: c for c in script.orderings(rows)}
    clear, noise = checks["Medusa < Hydra"], checks["Medusa < Amphista"]
    assert clear["clear"] and 0 < clear["ci95"][0] < clear["ci95"][1]
    assert not noise["clear"] and noise["ci95"][0] < 0 < noise["ci95"][1]
    assert script.tau_difference_ci(low, better) == clear["ci95"]  # seeded: the same interval every run
    table = script.markdown(rows)
    assert "(within noise)" in table.split("Medusa < Amphista")[1].splitlines()[0]
    assert "(within noise)" not in table.split("Medusa < Hydra")[1].splitlines()[0]


def test_a_familys_rows_are_compared_as_data_steps_with_tau_per_task():
    """Two runs of one family (another mixture of the same size) are compared on the same prompts;
    the decoded τ per Spec-Bench task is grouped with MT-Bench's categories as one."""
    script = load_script("data_scaling")
    prompts = [{"category": c} for c in ("writing", "coding", "translation", "translation")]
    per_prompt = [[41, 20], [41, 40], [21, 20], [61, 20]]
    assert script.tau_per_group(prompts, per_prompt) == {"mt_bench": round(80 / 60, 3), "translation": 2.0}  # (tokens - prompts) / steps
    first, second, other = row("Hydra", 0, 1.5), row("Hydra", 2944, 1.7), row("Medusa", 0, 1.4)
    first["data"], second["data"] = ["pool-50"], ["self-open", "pool-50"]
    low = [[41, 40], [61, 50], [81, 60], [31, 30]] * 6
    first["decoded"]["per_prompt"], other["decoded"]["per_prompt"] = low, low
    second["decoded"]["per_prompt"] = [[t, max(1, s - 12)] for t, s in low]
    for r in (first, second):
        r["decoded"]["per_group"] = {"mt_bench": r["decoded"]["tau"], "qa": 1.0}
    steps = script.data_steps([first, other, second])
    assert len(steps) == 1 and steps[0]["from"] == "10 of pool-50" and steps[0]["to"] == "10 of self-open + pool-50"
    assert steps[0]["clear"] and steps[0]["ci95"][0] > 0
    table = script.markdown([first, other, second])
    assert "| Hydra | 10 of self-open + pool-50 | 1.70 | 1.00 |" in table
    assert "| Hydra | 10 of self-open + pool-50 | 10 of pool-50 | 1.70 vs 1.50 | +0.200 [" in table
