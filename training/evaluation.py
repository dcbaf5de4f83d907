"""Evaluation: per-head top-k accuracy, the rank table tree search reads, τ of a fixed tree on
those ranks (per named group of rows), the evaluation tables a run scores its epochs on, and
the rule that picks a run's best epoch.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from ..decoding.tree import tree_from_paths, tree_from_ranks
from ..heads import DraftHeads
from .data.records import DataError, example_features, token_examples
from .features import Example, Features, read_jsonl, selfdistill_examples
from .losses import label_ranks, topk_accuracy
from .objective import head_labels
from .recipe_sections import Recipe
from .batches import cached_features, chunk_rows, sequence_chunks
from .head_forward import head_logits


EVAL_RANK_CAP = 16  # ranks beyond this only matter as "missed" for trees and top-k
EVAL_BUDGET = 8  # node budget of the tree epochs and checkpoints are compared on
#: the 8-node tree scored when the heads store none (a run's epochs): fixed, so every epoch is
#: scored on the same tree; the shape the shipped 8-node trees share
#: (evidence: checkpoints/smollm2-135m-hydra/config.json, trees["8"])
FIXED_TREE = [[0], [0, 0], [1], [0, 0, 0], [2], [0, 1], [1, 0], [0, 0, 0, 0]]
#: the 16-node, depth-4 tree every evaluation also reports τ at (``tau_fixed16``), whatever trees the
#: heads store, so runs and checkpoints compare on a larger budget too: FIXED_TREE and the 8 nodes the
#: shipped 16-node trees most often add to it (checkpoints/smollm2-135m-*/config.json, trees["16"]:
#: [3], [4], [0, 2] in all six, [5], [0, 0, 1] in five, [0, 3] in four, then of three ties the deeper two)
FIXED_TREE_16 = FIXED_TREE + [[3], [0, 2], [4], [0, 0, 1], [5], [0, 3], [2, 0], [0, 1, 0]]
HELD_OUT, DEV = "held_out", "dev"  # the evaluation tables: the data's held-out split, data.eval_path


@torch.no_grad()
def evaluate(heads: DraftHeads, table: Features, recipe: Recipe, dtype: torch.dtype, accelerator,
             batch_size: int = 2048) -> tuple[dict, torch.Tensor]:
    """Per-head top-1/top-5 on held-out positions (teacher-forced path tokens); returns the
    accuracies and the rank matrix (P, K) the tree search uses."""
    was_training = heads.training
    heads.eval()
    with accelerator.autocast():
        ranks = rank_table(heads, table, recipe.loss.labels, dtype, accelerator.device, recipe.run.eval_positions,
                           recipe.train.chunk_length, batch_size)
    heads.train(was_training)
    return topk_accuracy(ranks), ranks


@torch.no_grad()
def rank_table(heads: DraftHeads, table: Features, labels_from: str = "teacher", dtype=torch.float32, device="cpu",
               max_positions: int = 0, chunk_length: int = 256, batch_size: int = 2048) -> torch.Tensor:
    """Rank of each held-out label in its head's draft distribution (P, K), capped at
    EVAL_RANK_CAP, over the first ``max_positions`` rows (0 = all; contextual families score
    whole sequence chunks, so they may stop a little past it). Row i of the result is row i of
    the table."""
    count = min(len(table), max_positions) if max_positions else len(table)
    if heads.contextual:
        chunks = [c for c in sequence_chunks(table, chunk_length) if c[0] < count]
        batches = [chunk_rows(chunks[i: i + 8]) for i in range(0, len(chunks), 8)]
    else:
        batches = [torch.arange(s, min(s + batch_size, count)) for s in range(0, count, batch_size)]
    ranks = []
    for rows in batches:
        logits, flat = head_logits(heads, table, rows, heads.num_heads, device, dtype)
        labelled = table.targets[flat, 0] >= 0  # a prompt's rows feed a context layer; they hold no label
        labels = head_labels(table, flat[labelled], heads, labels_from).to(device)
        ranks.append(label_ranks(logits[labelled.to(logits.device)].float(), labels, EVAL_RANK_CAP).cpu())
    return torch.cat(ranks)


def tree_tau(ranks: torch.Tensor, paths: list[list[int]]) -> float:
    """τ of a fixed tree on measured ranks: 1 + mean depth of the deepest fully matching path."""
    tree = tree_from_paths(paths)
    depth = ranks.shape[1]
    best = torch.zeros(ranks.shape[0])
    for path in tree.paths:
        if len(path) > depth:
            continue
        hit = (ranks[:, : len(path)] == torch.tensor(path)).all(1)
        best = torch.where(hit, torch.maximum(best, torch.tensor(float(len(path)))), best)
    return round(1.0 + float(best.mean()), 4)


def eval_tree(trees: dict[str, list[list[int]]], budget: int = EVAL_BUDGET) -> tuple[str, list[list[int]]]:
    """The tree τ is read at: the stored tree of ``budget`` nodes, else the largest stored
    budget below it, else (heads in training store none) :data:`FIXED_TREE`, named ``fixed-8``."""
    stored = sorted((int(b), b) for b in trees if int(b) <= budget)
    if stored:
        return stored[-1][1], [list(p) for p in trees[stored[-1][1]]]
    return f"fixed-{len(FIXED_TREE)}", [list(p) for p in FIXED_TREE]


def rank_scores(ranks: torch.Tensor, paths: list[list[int]]) -> dict:
    """Per-head top-1/top-5, τ of the tree ``paths`` and τ of :data:`FIXED_TREE_16` on a rank matrix (P, K)."""
    if not len(ranks):
        return {"positions": 0, "top1": None, "top5": None, "tau": None, "tau_fixed16": None}
    return {"positions": int(ranks.shape[0]), **topk_accuracy(ranks), "tau": tree_tau(ranks, paths),
            "tau_fixed16": tree_tau(ranks, FIXED_TREE_16)}


@torch.no_grad()
def evaluate_heads(heads: DraftHeads, table: Features, groups: dict[str, torch.Tensor] | None = None,
                   budget: int = EVAL_BUDGET, labels_from: str = "teacher", dtype: torch.dtype = torch.float32,
                   device="cpu", max_positions: int = 0, chunk_length: int = 256, autocast=nullcontext) -> dict:
    """Per-head top-1/top-5, τ at the heads' ``budget``-node tree (:func:`eval_tree`: which one is
    recorded as ``tree``) and ``tau_fixed16`` (τ at :data:`FIXED_TREE_16`) on the table, overall and
    per group ({name: row indices}; rows past ``max_positions`` are not scored). ``tau_search`` is
    the τ of the best tree searched on these same ranks (an upper bound the fixed tree is read against)."""
    was_training = heads.training
    heads.eval()
    with autocast():
        ranks = rank_table(heads, table, labels_from, dtype, device, max_positions, chunk_length)
    heads.train(was_training)
    name, paths = eval_tree(heads.config.trees, budget)
    scores = {"tree": name, **rank_scores(ranks, paths), "tau_search": round(tree_from_ranks(ranks, budget)[1], 4)}
    if groups:
        scores["groups"] = {group: rank_scores(ranks[rows[rows < len(ranks)]], paths) for group, rows in groups.items()}
    return scores


def selection_key(scores: dict) -> tuple[float, float]:
    """What a run's epochs are ranked by: τ at the fixed 8-node tree, ties broken by head 1's top-1."""
    return scores["tau"], scores["top1"][0]


def is_better(scores: dict, best: dict | None) -> bool:
    """Whether an epoch's scores beat the best so far (an equal epoch does not: the earlier stays)."""
    return best is None or selection_key(scores) > selection_key(best)


# -- the evaluation tables -----------------------------------------------------------------------------------
def load_eval_table(recipe: Recipe, accelerator, fp: dict, base,
                    tokenizer) -> tuple[Features, dict[str, torch.Tensor]] | None:
    """The ``dev`` table of ``data.eval_path`` (None when unset): a JSONL of the base's own
    answers, records ``{"prompt", "response_ids", "group"}`` (or token ids: ``{"input_ids",
    "response_start", "group"}``; ``group`` optional, e.g. mt_bench, spec_bench_dev), as
    features (cached under ``data.features_dir``/dev when set) and the row indices of each
    group; an evaluation job's folder is read as it lies (:func:`~.data.job_data.job_eval_table`).
    ``base`` and ``tokenizer``: the run's, loaded once for every table."""
    path = recipe.data.eval_path
    if not path:
        return None
    from .frozen import feature_layers_for  # the base layers the heads read beside the final state

    if Path(path).is_dir():  # a self-distillation job's folder: its states are read where they lie
        from ..decoding.base.loading import dtype_name
        from .data.job_data import job_eval_table, reads_prompt

        return job_eval_table(Path(path), fp, dtype_name(base.dtype), reads_prompt(recipe),
                              feature_layers_for(recipe, base))
    if not Path(path).is_file():
        raise DataError(f"Recipe key data.eval_path: {path} does not exist; point it at a JSONL of the base's "
                        "answers (prompt, response_ids, group) or remove it.")
    by_group: dict[str, list[dict]] = {}
    try:
        for record in read_jsonl(path):
            by_group.setdefault(str(record.get("group", "")), []).append(record)
        examples = {g: token_examples(rs, recipe.data.max_length) if all("input_ids" in r for r in rs)
                    else selfdistill_examples(rs, tokenizer, recipe.data.max_length) for g, rs in by_group.items()}
    except ValueError as err:
        raise DataError(f"Recipe key data.eval_path: {err}") from None
    ordered = [e for g in examples for e in examples[g]]
    if not ordered:
        raise DataError(f"Recipe key data.eval_path: {path} holds no answer of ≥ 2 tokens to score heads on.")
    layers = feature_layers_for(recipe, base)
    if recipe.data.features_dir:
        table = cached_features(base, ordered, Path(recipe.data.features_dir) / DEV, fp, accelerator, layers)
    else:
        table = example_features(base, ordered, layers)
    return table, group_rows(examples) if set(examples) != {""} else {}


def eval_tables(held_out: Features, dev: tuple[Features, dict] | None) -> dict[str, tuple[Features, dict]]:
    """The tables a run's epochs are scored on, {name: (table, groups)}: the held-out split, and
    the dev table when ``data.eval_path`` gives one (:func:`load_eval_table`)."""
    return {HELD_OUT: (held_out, {}), **({DEV: dev} if dev is not None else {})}


def group_rows(examples: dict[str, list[Example]]) -> dict[str, torch.Tensor]:
    """Row indices of each group's positions in the table of its examples, concatenated in
    order (an example of L tokens answering from ``response_start`` holds L − response_start rows)."""
    rows, start = {}, 0
    for group, items in examples.items():
        count = sum(len(e.input_ids) - e.response_start for e in items)
        rows[group or "other"] = torch.arange(start, start + count)
        start += count
    return rows
