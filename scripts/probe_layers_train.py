"""scripts/probe_layers.py: the probes, their training, scores and report (one of its three files)."""
from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from probe_layers_setup import *  # noqa: F401,F403 (the probe's constants)
from probe_layers_capture import Split  # noqa: E402


class Probe(nn.Module):
    """fc over the set's (normed) layers, then per head a ResBlock (Medusa) or a Hydra head, read
    out through the frozen LM head rows ``readout`` (V', d)."""

    def __init__(self, layers: tuple[int, ...], num_layers: int, readout: torch.Tensor, embed: torch.Tensor,
                 final_norm: torch.Tensor, eps: float, raw_scales: dict[int, float] | None = None,
                 hydra: bool = False, num_heads: int = NUM_HEADS):
        super().__init__()
        from draftheads.heads.hydra import HydraHead
        from draftheads.heads.medusa import ResBlock

        d = readout.shape[1]
        self.layers, self.num_layers, self.hydra = tuple(layers), num_layers, hydra
        self.raw_scales = raw_scales
        self.norms = nn.ModuleDict()
        if raw_scales is None:
            for i in layers:
                if i != num_layers:
                    norm = nn.RMSNorm(d, eps=eps)
                    norm.weight.data.copy_(final_norm.float())
                    self.norms[str(i)] = norm
        self.fc = nn.Linear(len(layers) * d, d, bias=False)
        top = len(layers) - 1 - list(reversed(layers)).index(max(layers))
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, top * d: (top + 1) * d] = torch.eye(d)
        if hydra:
            self.heads = nn.ModuleList(HydraHead(d, k + 1, 1) for k in range(num_heads))
        else:
            self.heads = nn.ModuleList(ResBlock(d) for _ in range(num_heads))
        self.register_buffer("readout", readout.detach().float().clone(), persistent=False)
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)

    def fused(self, feats: list[torch.Tensor]) -> torch.Tensor:
        parts = []
        for i, x in zip(self.layers, feats):
            if i == self.num_layers:
                parts.append(x)
            elif self.raw_scales is not None:
                parts.append(x / self.raw_scales[i])
            else:
                parts.append(self.norms[str(i)](x))
        return self.fc(torch.cat(parts, dim=-1))

    def forward(self, feats: list[torch.Tensor], path: torch.Tensor) -> torch.Tensor:
        """feats: per layer (B, d) float32; path (B, K) = x_{t+1}..x_{t+K} (−1 allowed) → (B, K, V')."""
        f = self.fused(feats)
        if self.hydra:
            emb = self.embed[path.clamp(min=0)]  # (B, K, d)
            states = [head(f, emb[:, : k + 1].to(f.dtype)) for k, head in enumerate(self.heads)]
        else:
            states = [head(f) for head in self.heads]
        z = torch.stack(states, dim=1)
        return z @ self.readout.to(z.dtype).T


def draft_labels(future: torch.Tensor, lookup: torch.Tensor) -> torch.Tensor:
    """Base ids (P, K) (−1: absent) → draft-vocabulary indices, −1 absent, −2 outside the vocabulary."""
    out = lookup[future.clamp(min=0)]
    return torch.where(future < 0, torch.full_like(out, -1), out)


def label_ranks(logits: torch.Tensor, labels: torch.Tensor, cap: int = RANK_CAP) -> torch.Tensor:
    """Rank (0 = top) of each head's label among its draft logits, (B, K); ``cap`` where the label is
    outside the draft vocabulary (−2, a miss) or absent (−1; masked out by :func:`topk_hits`)."""
    safe = labels.clamp(min=0)
    own = logits.gather(-1, safe[..., None])
    ranks = (logits > own).sum(-1)
    return torch.where(labels >= 0, ranks.clamp(max=cap), torch.full_like(ranks, cap))


def topk_hits(ranks: torch.Tensor, labels: torch.Tensor, ks=(1, 5)) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """({k: (B, K) bool hit in the top k}, (B, K) bool scored): a label outside the draft
    vocabulary is scored and missed; an absent one (past the end) is not scored."""
    scored = labels != -1
    return {k: (ranks < k) & scored for k in ks}, scored


def accuracy(hits: torch.Tensor, scored: torch.Tensor) -> list[float]:
    """Per head (column) share of scored positions hit."""
    return (hits.sum(0).double() / scored.sum(0).clamp(min=1).double()).tolist()


def tree_depths(ranks: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """Per position: depth of the deepest path of the tree whose every rank matches (as
    ``training.evaluation.tree_tau``, which is 1 + the mean of this)."""
    best = torch.zeros(ranks.shape[0])
    for path in paths:
        if len(path) > ranks.shape[1]:
            continue
        hit = (ranks[:, : len(path)] == torch.tensor(path)).all(1)
        best = torch.where(hit, torch.maximum(best, torch.tensor(float(len(path)))), best)
    return best


def gather(split: Split, layers: tuple[int, ...], rows: torch.Tensor) -> list[torch.Tensor]:
    r = rows.numpy()
    return [torch.from_numpy(split.states[i][r]).float() for i in layers]


def train_probe(probe: Probe, split: Split, lookup: torch.Tensor, steps: int, batch: int, lr: float, seed: int,
                name: str) -> dict:
    """The same schedule for every probe: AdamW, 5 % linear warm-up then cosine, bf16 autocast,
    positions in one seeded order (epochs of a seeded permutation)."""
    torch.manual_seed(seed)
    params = [p for p in probe.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warm = max(1, int(0.05 * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    gen = torch.Generator().manual_seed(seed)
    total = len(split.seq)
    order = torch.randperm(total, generator=gen)
    future = torch.from_numpy(split.future)
    started, losses, cursor = time.perf_counter(), [], 0
    probe.train()
    for step in range(steps):
        if cursor + batch > total:
            order, cursor = torch.randperm(total, generator=gen), 0
        rows = order[cursor: cursor + batch].sort().values
        cursor += batch
        fut = future[rows]
        labels = draft_labels(fut[:, 1:], lookup)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = probe(gather(split, probe.layers, rows), fut[:, :NUM_HEADS])
        target = labels.masked_fill(labels < 0, -100).flatten()  # absent or outside the draft vocabulary
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target, ignore_index=-100,
                                           reduction="sum") / batch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == steps:
            print(json.dumps({"probe": name, "step": step + 1, "of": steps, "loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
                              "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    probe.eval()
    return {"train_seconds": round(time.perf_counter() - started, 1), "loss_first50": round(float(np.mean(losses[:50])), 4),
            "loss_last50": round(float(np.mean(losses[-50:])), 4), "positions_seen": steps * batch,
            "epochs": round(steps * batch / total, 3)}


@torch.no_grad()
def score_probe(probe: Probe, split: Split, lookup: torch.Tensor, batch: int = 4096) -> dict:
    """Per position ranks (P, K) and labels (P, K) on a split, in float32."""
    future = torch.from_numpy(split.future)
    ranks, labels = [], []
    for s in range(0, len(future), batch):
        rows = torch.arange(s, min(s + batch, len(future)))
        fut = future[rows]
        lab = draft_labels(fut[:, 1:], lookup)
        logits = probe(gather(split, probe.layers, rows), fut[:, :NUM_HEADS])
        ranks.append(label_ranks(logits, lab))
        labels.append(lab)
    return {"ranks": torch.cat(ranks), "labels": torch.cat(labels)}


def summarize(scored: dict, seq: np.ndarray, sequences: int) -> dict:
    """Overall scores and per-sequence sums (for the bootstrap)."""
    from draftheads.training.evaluation import FIXED_TREE

    ranks, labels = scored["ranks"], scored["labels"]
    hits, valid = topk_hits(ranks, labels)
    full = valid.all(1)
    chain = tree_depths(ranks[full], [[0] * (k + 1) for k in range(NUM_HEADS)])
    tree = tree_depths(ranks[full], FIXED_TREE)
    seq_t = torch.from_numpy(seq.astype(np.int64))

    def per_seq(values: torch.Tensor, index: torch.Tensor) -> np.ndarray:
        out = torch.zeros((sequences,) + tuple(values.shape[1:]), dtype=torch.float64)
        return out.index_add_(0, index, values.double()).numpy()

    return {"top1": [round(a, 4) for a in accuracy(hits[1], valid)], "top5": [round(a, 4) for a in accuracy(hits[5], valid)],
            "positions": valid.sum(0).tolist(), "tau_chain": round(1 + float(chain.mean()), 4),
            "tau_tree8": round(1 + float(tree.mean()), 4), "tau_positions": int(full.sum()),
            "_seq": {"hits1": per_seq(hits[1], seq_t), "scored": per_seq(valid, seq_t),
                     "chain": per_seq(chain, seq_t[full]), "tree": per_seq(tree, seq_t[full]),
                     "full": per_seq(full.double(), seq_t)}}


def bootstrap_diff(a: dict, b: dict, resamples: int, seed: int) -> dict:
    """95 % percentile intervals of (a − b) over evaluation sequences resampled with replacement:
    per-head top-1, its mean over heads 1–4, and the chain and 8-node-tree τ."""
    n = a["hits1"].shape[0]
    rng = np.random.default_rng(seed)
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)  # (R, n)

    def acc(x: dict) -> np.ndarray:
        return (w @ x["hits1"]) / (w @ x["scored"])  # (R, K)

    def tau(x: dict, key: str) -> np.ndarray:
        return 1 + (w @ x[key]) / (w @ x["full"])

    def interval(d: np.ndarray, point: float) -> dict:
        lo, hi = np.percentile(d, [2.5, 97.5])
        return {"diff": round(point, 4), "lo": round(float(lo), 4), "hi": round(float(hi), 4)}

    da, db = acc(a), acc(b)
    point = a["hits1"].sum(0) / a["scored"].sum(0) - b["hits1"].sum(0) / b["scored"].sum(0)
    out = {f"head{k + 1}": interval(da[:, k] - db[:, k], float(point[k])) for k in range(da.shape[1])}
    out["mean"] = interval((da - db).mean(1), float(point.mean()))
    for key in ("chain", "tree"):
        pa = 1 + a[key].sum() / a["full"].sum()
        pb = 1 + b[key].sum() / b["full"].sum()
        out[f"tau_{key}"] = interval(tau(a, key) - tau(b, key), float(pa - pb))
    return out


# ---------------------------------------------------------------------------------------------
# report


def label(run: dict) -> str:
    layers = "{" + ", ".join(map(str, run["layers"])) + "}"
    extra = (" raw" if run["variant"] == "raw" else "")
    return f"{run['family']} {run['set']} {layers}{extra}"


def markdown_table(runs: list[dict]) -> str:
    lines = ["| probe | top-1 h1 | h2 | h3 | h4 | top-5 h1 | h2 | h3 | h4 | τ chain | τ tree-8 | Δ top-1 mean vs last [95% CI] | sel. top-1 mean |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        e = r["eval"]
        d = r.get("vs_last")
        delta = f"{d['mean']['diff'] * 100:+.2f} pt [{d['mean']['lo'] * 100:+.2f}, {d['mean']['hi'] * 100:+.2f}]" if d else "—"
        lines.append(f"| {label(r)} | " + " | ".join(f"{x * 100:.1f}" for x in e["top1"]) + " | "
                     + " | ".join(f"{x * 100:.1f}" for x in e["top5"])
                     + f" | {e['tau_chain']:.3f} | {e['tau_tree8']:.3f} | {delta} | {r['select_top1_mean'] * 100:.1f} |")
    return "\n".join(lines) + "\n"


def per_head_table(runs: list[dict]) -> str:
    lines = ["| probe | Δ h1 | Δ h2 | Δ h3 | Δ h4 | Δ τ chain | Δ τ tree-8 |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        d = r.get("vs_last")
        if not d:
            continue
        cells = [f"{d[f'head{k}']['diff'] * 100:+.2f} [{d[f'head{k}']['lo'] * 100:+.2f}, {d[f'head{k}']['hi'] * 100:+.2f}]"
                 for k in range(1, NUM_HEADS + 1)]
        cells += [f"{d[k]['diff']:+.4f} [{d[k]['lo']:+.4f}, {d[k]['hi']:+.4f}]" for k in ("tau_chain", "tau_tree")]
        lines.append(f"| {label(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(runs)
    x = np.arange(NUM_HEADS)
    for j, r in enumerate(runs):
        ax.bar(x + (j - (len(runs) - 1) / 2) * width, np.array(r["eval"]["top1"]) * 100, width, label=label(r))
    ax.set_xticks(x, [f"head {k + 1} (x_t+{k + 2})" for k in range(NUM_HEADS)])
    ax.set_ylabel("top-1 accuracy on the clean split (%)")
    ax.set_title("Layer probes: which base layers a draft head reads (SmolLM2-135M, teacher-forced)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def readme(result: dict) -> str:
    m = result["meta"]
    runs = result["runs"]
    return f"""# Layer probes: do fused base layers (EAGLE-3's `fc`) draft better than the last layer?

Issue 66 item 4, "probe first". Written by `scripts/probe_layers.py` ({m['date']}, {m['machine']}, torch
{m['torch']}; {m['wall_minutes']} min wall):

```bash
{chr(10).join(m.get('commands', [m['command']]))}
```

Small Medusa-style (and Hydra-style) probes, one per feature set of the base's hidden states, trained
identically on the first {m['train']['sequences']:,} committed self-distilled sequences
({m['train']['positions']:,} answer positions, {m['train_epochs']} epochs at batch {m['batch']}, {m['steps']} steps,
lr {m['lr']}, seed {m['seed']}) and scored teacher-forced on the clean split: the base's greedy answers
(bf16, 128 new tokens) to the {m['eval']['sequences']} Spec-Bench dev prompts no bench decodes
({m['eval']['positions']:,} answer positions; answers from `{m['eval']['job']}`). Head k predicts x_(t+k+1) from the state
at t (x_(t+1) is the base's own token). Layer index i = HF `hidden_states[i]` (0 embeddings, i the output of
decoder layer i), 30 = `last_hidden_state` (after the final norm). `eagle3` = {{2, 15, 27}}: EAGLE-3 captures
the *input* of zero-based layers 2, L//2, L−3. Each non-final layer goes through its own RMSNorm (gain
initialised to the final norm's) unless marked `raw` (divided by the layer's mean RMS, a constant); the
concatenation goes through `fc` = Linear(n·d → d, no bias), initialised to pass the top layer through, so every probe starts
as the base's LM head on its top layer (also n = 1: last-only has the same `fc`). Readout: the frozen LM head
over the {m['draft_vocab']:,} most frequent training answer tokens ({m['eval']['label_coverage'] * 100:.1f} % of the
clean split's labels; the rest count as misses). Training and scoring use answer positions only.

## Top-1 / top-5 per head on the clean split (%), τ, and the difference from last-only

Δ is each probe's top-1 minus the last-only probe's of the same family (Medusa-style or Hydra-style),
averaged over heads 1–4, in points, with a 95 % bootstrap interval over the {m['eval']['sequences']} evaluation
sequences ({m['bootstrap']} resamples). τ chain: 1 + mean number of leading heads whose top-1 is right
(a 4-token chain); τ tree-8: the repo's fixed 8-node tree (`training.evaluation.FIXED_TREE`), both on the
{runs[0]['eval']['tau_positions']:,} positions where all four labels exist. "sel." is the mean top-1 on the
{m['select']['sequences']} held-out training sequences the best fused set was picked on
(`{m['best_fused']}`).

{markdown_table(runs)}
Per head, Δ top-1 in points and Δ τ, [95 % interval]:

{per_head_table(runs)}
![top-1 per head](probe.png)

Base sanity check: the base's own argmax on the captured layer-30 state equals the next token at
{m['train']['base_agreement'] * 100:.2f} % of the {m['train']['checked_positions']:,} training positions checked (every 8th sequence) and {m['eval']['base_agreement'] * 100:.2f} % of evaluation positions (bf16 near-ties
aside, the states line up with the tokens).
"""


# ---------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown CPU"
    return f"{name}, {torch.get_num_threads()} threads"
