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
