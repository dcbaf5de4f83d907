"""Probe first (issue 66, item 4): do draft heads that read several layers of the base (EAGLE-3's
fused low/middle/high features) predict the base's future tokens better than heads that read
only the last layer's post-norm state (what every shipped head reads)?

    python scripts/probe_layers.py --limit-train 1200 --select 64 --steps 400 --batch-size 512 --threads 1 \
        --out results/heads/probe_layers                  # add --resume to continue a stopped run

What it does, once, with the embedded base (SmolLM2-135M-Instruct, L = 30 layers, d = 576) in bf16:

* **Training data**: the first ``--limit-train`` sequences of the committed self-distilled token ids
  (``recipes/data/selfdistill-smollm2/shard-*.npz``, shards in order: every prefix is a
  proportional sample of the sources); the next ``--select`` sequences are a selection split
  (the "best fused set" that the Hydra-style and raw-feature probes reuse is picked there, never
  on the evaluation split).
* **Evaluation ("the clean split")**: the base's greedy answers (bf16, chat template, 128 new
  tokens) to the Spec-Bench dev prompts the benches never decode: records of the built-in
  ``spec-bench`` set whose prompt is in neither ``read_prompts(DEV_PROMPTS)`` nor
  ``read_prompts(BATCH_PROMPTS)`` (``draftheads.prompts.CLEAN_EVAL_PROMPTS`` when that exists,
  checked to be the same set). Answers come from a finished job at ``data_cache/eval-clean-smollm2``
  if one exists, else this script runs ``python -m draftheads.training.data.distill_job`` (the
  project's batched greedy decoder, lossless) into ``data_cache/probe_layers/eval-clean`` once.
* **Capture**: one bf16 forward of the base per sequence (no padding) over prompt + answer with
  ``output_hidden_states=True``; the candidate layers' states at the answer positions are kept in
  float16. **Layer convention**: index i is HF's ``hidden_states[i]``: 0 = the token embeddings,
  i (1 ≤ i < L) = the output of decoder layer i (1-based; the residual stream, before any norm),
  and L = 30 is ``last_hidden_state`` (after the final RMSNorm: what the LM head and every
  shipped head read). EAGLE-3's rule captures the *input* of zero-based layers 2, L//2, L-3
  (SafeAILab/EAGLE ``modeling_llama_kv.py``: ``if idx in (2, L//2, L-3): all_hidden_states +=
  (hidden_states,)`` before ``decoder_layer`` runs; vLLM's ``aux_hidden_state_layers`` the same),
  which is HF index {2, 15, 27} for L = 30: that is the set called ``eagle3`` here.
* **Positions**: answer positions only (the prompt's are never trained on nor scored): the state
  at t, for t from the prompt length − 1 to the sequence length − 3; the base's own next token
  x_{t+1} is the root, head k (1..4) predicts x_{t+k+1} (absent past the end: that head is not
  trained or scored there).
* **Probes**, one per feature set, trained identically (same init rule, steps, batch, lr
  schedule, seed and position order; AdamW, bf16 autocast, teacher-forced cross-entropy summed
  over heads with equal weights): the set's states, each non-final layer through its own RMSNorm
  (gain initialised to the base's final-norm gain; ``raw`` variant: divided by a fixed scalar, the
  layer's mean RMS on the training positions, instead), concatenated and projected by
  ``fc = Linear(n·d → d, no bias)`` (EAGLE-3's ``fc``; also for n = 1, so every probe has the same
  shape), initialised to pick the set's top layer (identity there, zero elsewhere: every probe
  starts as the base's own LM head on its top layer). Then per head a Medusa ``ResBlock``
  (x + SiLU(W x + b), zero init) or, ``hydra``, the shipped Hydra head (``heads/hydra.py``: it
  also reads the base's input embeddings of x_{t+1}..x_{t+k}, zero-init mix, one ResBlock), read
  out through the base's frozen LM head restricted to the 8,192 most frequent training answer
  tokens (``training.losses.draft_vocab``, the shipped heads' rule); a label outside those counts
  as a miss in every score.
* **Scores** on the clean split: per-head top-1/top-5; τ of the top-1 chain and of the repo's fixed
  8-node tree (``training.evaluation.FIXED_TREE``) on positions where all four labels exist; a
  bootstrap over evaluation sequences (``--bootstrap`` resamples) of each probe's top-1 minus the
  last-only probe's of the same family, per head and averaged over heads 1–4.

Writes ``OUT/probe.json``, ``OUT/probe.png`` and ``OUT/README.md``; caches under
``data_cache/probe_layers/``.
"""
from __future__ import annotations

import argparse
import glob
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

REPO = Path(__file__).resolve().parents[1]
NUM_HEADS = 4
DRAFT_VOCAB = 8192
RANK_CAP = 16
CACHE = REPO / "data_cache" / "probe_layers"
TRAIN_DATA = REPO / "recipes" / "data" / "selfdistill-smollm2"
SHARED_EVAL_JOB = REPO / "data_cache" / "eval-clean-smollm2"

#: the feature sets compared (HF hidden_states indices, L = 30 = last_hidden_state), in order;
#: "last" is the reference every difference is taken against
FEATURE_SETS = {
    "last": (30,),
    "eagle3": (2, 15, 27),       # EAGLE-3's rule: inputs of zero-based layers 2, L//2, L-3
    "low-mid-final": (3, 15, 30),
    "mid-final": (15, 30),
    "8-22-final": (8, 22, 30),
}


# ---------------------------------------------------------------------------------------------
# capture


def capture_states(model, ids: torch.Tensor, layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """{layer: (T, d)} states of one sequence ``ids`` (1, T) under the convention of the module
    docstring: index i < L is ``hidden_states[i]`` (0 = embeddings, i = decoder layer i's output),
    index L is ``last_hidden_state`` (after the final norm)."""
    inner = model.model if hasattr(model, "model") else model
    num_layers = model.config.num_hidden_layers
    if any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(f"layers {layers} out of range 0..{num_layers}")
    out = inner(input_ids=ids, output_hidden_states=True, use_cache=False)
    if len(out.hidden_states) != num_layers + 1:
        raise RuntimeError(f"{len(out.hidden_states)} hidden states for {num_layers} layers")
    return {i: (out.last_hidden_state if i == num_layers else out.hidden_states[i])[0] for i in layers}


def answer_positions(tokens: np.ndarray, answer_start: int, num_heads: int = NUM_HEADS) -> tuple[np.ndarray, np.ndarray]:
    """(positions t, future (P, num_heads + 1)) of one sequence: t from answer_start − 1 to
    len − 3 (the root x_{t+1} and head 1's label x_{t+2} exist); ``future[:, j]`` = x_{t+1+j},
    −1 past the end. Column 0 is the root, column k head k's label."""
    n = len(tokens)
    t = np.arange(max(answer_start - 1, 0), n - 2)
    idx = t[:, None] + 1 + np.arange(num_heads + 1)[None, :]
    future = np.where(idx < n, np.asarray(tokens, np.int64)[np.minimum(idx, n - 1)], -1)
    return t, future


@dataclass
class Split:
    """Captured positions of one split: ``states[layer]`` (P, d) float16, ``future`` (P, K+1),
    ``seq`` (P,) the sequence each position belongs to, ``base_ok`` (P,) the base's argmax at
    index L equals x_{t+1} (a check that states and tokens line up)."""

    states: dict[int, np.ndarray]
    future: np.ndarray
    seq: np.ndarray
    base_ok: np.ndarray
    sequences: int
    tokens: int
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)


@torch.no_grad()
def capture_split(base, sequences: list[tuple[np.ndarray, int]], layers: tuple[int, ...], log: str,
                  check_every: int = 1) -> Split:
    """The states of ``layers`` at every answer position of ``sequences``; the base's own argmax on
    index L is checked against x_{t+1} on every ``check_every``-th sequence (``base_ok``: the
    positions of the others are False and not counted, see ``checked``)."""
    d, num_layers = base.config.hidden_size, base.config.num_hidden_layers
    counts = [len(answer_positions(s, a)[0]) for s, a in sequences]
    total = sum(counts)
    states = {i: np.empty((total, d), np.float16) for i in layers}
    future = np.empty((total, NUM_HEADS + 1), np.int64)
    seq = np.empty(total, np.int32)
    base_ok = np.zeros(total, bool)
    checked = np.zeros(total, bool)
    head = base.lm_head.weight
    row, started, tokens = 0, time.perf_counter(), 0
    for k, (s, a) in enumerate(sequences):
        t, fut = answer_positions(s, a)
        got = capture_states(base, torch.from_numpy(np.asarray(s, np.int64))[None], tuple(sorted(set(layers) | {num_layers})))
        sl = slice(row, row + len(t))
        for i in layers:
            states[i][sl] = got[i][torch.from_numpy(t)].float().numpy()
        if k % check_every == 0:
            base_ok[sl] = (got[num_layers][torch.from_numpy(t)] @ head.T).argmax(-1).numpy() == fut[:, 0]
            checked[sl] = True
        future[sl], seq[sl] = fut, k
        row += len(t)
        tokens += len(s)
        if (k + 1) % 100 == 0 or k + 1 == len(sequences):
            print(json.dumps({"capture": log, "sequences": k + 1, "of": len(sequences), "positions": row,
                              "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    for i in layers:
        if not np.isfinite(states[i]).all():
            raise RuntimeError(f"layer {i}: a state overflows float16")
    return Split(states, future, seq, base_ok, len(sequences), tokens, time.perf_counter() - started,
                 {"base_agreement": round(float(base_ok[checked].mean()), 4), "checked_positions": int(checked.sum())})


def cached_split(base, sequences: list[tuple[np.ndarray, int]], layers: tuple[int, ...], log: str,
                 check_every: int = 1) -> Split:
    """:func:`capture_split`, kept under ``data_cache/probe_layers/capture-*`` (keyed by the sequences'
    tokens and the layers) and read back memory-mapped on a rerun."""
    import hashlib

    h = hashlib.sha256(repr(layers).encode())
    for s, a in sequences:
        h.update(np.asarray(s, np.int64).tobytes())
        h.update(str(a).encode())
    folder = CACHE / f"capture-{log}-{len(sequences)}-{h.hexdigest()[:12]}"
    if (folder / "meta.json").is_file():
        meta = json.loads((folder / "meta.json").read_text())
        print(json.dumps({"capture": log, "cached": str(folder)}), flush=True)
        return Split({i: np.load(folder / f"layer{i}.npy", mmap_mode="r") for i in layers}, np.load(folder / "future.npy"),
                     np.load(folder / "seq.npy"), np.load(folder / "base_ok.npy"), meta["sequences"], meta["tokens"],
                     meta["seconds"], meta["meta"])
    split = capture_split(base, sequences, layers, log, check_every)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for i in layers:
        np.save(tmp / f"layer{i}.npy", split.states[i])
    for name in ("future", "seq", "base_ok"):
        np.save(tmp / f"{name}.npy", getattr(split, name))
    (tmp / "meta.json").write_text(json.dumps({"sequences": split.sequences, "tokens": split.tokens,
                                               "seconds": split.seconds, "meta": split.meta}))
    tmp.rename(folder)
    return split


# ---------------------------------------------------------------------------------------------
# data


def read_train_sequences(folder: Path, count: int) -> list[tuple[np.ndarray, int]]:
    """The first ``count`` sequences of the committed shards, shards in order."""
    out = []
    for path in sorted(glob.glob(str(folder / "shard-*.npz"))):
        z = np.load(path)
        tokens, offsets, starts = z["tokens"], z["offsets"], z["answer_starts"]
        for k in range(len(starts)):
            out.append((tokens[offsets[k]: offsets[k + 1]].astype(np.int64), int(starts[k])))
            if len(out) == count:
                return out
    if len(out) < count:
        raise SystemExit(f"{folder} holds {len(out)} sequences, fewer than the {count} asked for.")
    return out


def clean_prompts() -> list[dict]:
    """The Spec-Bench dev records no bench decodes (see the module docstring)."""
    from draftheads import prompts as P

    used = {r["prompt"] for r in P.read_prompts(P.DEV_PROMPTS)} | {r["prompt"] for r in P.read_prompts(P.BATCH_PROMPTS)}
    clean = [r for r in P.read_prompt_file("spec-bench") if r["prompt"] not in used]
    named = getattr(P, "CLEAN_EVAL_PROMPTS", None)
    if named is not None:  # the project's own name for this set: use it, and say if it differs
        records = P.read_prompts(named) if isinstance(named, (str, tuple, list)) else list(named)
        if {r["prompt"] for r in records} != {r["prompt"] for r in clean}:
            print(json.dumps({"warning": "CLEAN_EVAL_PROMPTS differs from the computed clean split; using it",
                              "named": len(records), "computed": len(clean)}), flush=True)
        return records
    return clean


def job_complete(folder: Path) -> bool:
    from draftheads.training.data.distill_job import finished_shards

    plan = folder / "plan.json"
    if not plan.is_file():
        return False
    return len(finished_shards(folder)) == json.loads(plan.read_text())["shards"]


def eval_job(prompts: list[dict]) -> Path:
    """A finished job of the base's answers to the clean split: the shared one, else ours (built once)."""
    if job_complete(SHARED_EVAL_JOB):
        return SHARED_EVAL_JOB
    out = CACHE / "eval-clean"
    if not job_complete(out):
        CACHE.mkdir(parents=True, exist_ok=True)
        file = CACHE / "clean_prompts.jsonl"
        file.write_text("".join(json.dumps({"id": f"spec-bench-{r['id']}", "prompt": r["prompt"],
                                            "source": r["category"]}) + "\n" for r in prompts))
        cmd = [sys.executable, "-m", "draftheads.training.data.distill_job", "--out", str(out),
               "--prompts", str(file), "--max-new-tokens", "128"]
        print(json.dumps({"eval_job": " ".join(cmd)}), flush=True)
        subprocess.run(cmd, check=True, cwd=REPO)
    return out


def read_job_sequences(folder: Path, limit: int) -> tuple[list[tuple[np.ndarray, int]], list[str], dict]:
    """The job's sequences in its order (the first ``limit``; 0 = all), their ids, and its plan."""
    from draftheads.training.data.distill_job import finished_shards
    from draftheads.training.data.distill_shards import open_shard

    seqs, ids = [], []
    for _, shard_folder in finished_shards(folder):
        shard = open_shard(shard_folder, {}, "", with_hidden=False)
        for k in range(len(shard)):
            seqs.append((shard.sequence(k).astype(np.int64), int(shard.answer_starts[k])))
            ids.append(shard.ids[k])
    plan = json.loads((folder / "plan.json").read_text())
    return (seqs[:limit], ids[:limit], plan) if limit else (seqs, ids, plan)


# ---------------------------------------------------------------------------------------------
# probes


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit-train", type=int, default=1200, help="training sequences (the first of the shards)")
    parser.add_argument("--select", type=int, default=64, help="held-out training sequences the best fused set is picked on")
    parser.add_argument("--limit-eval", type=int, default=0, help="evaluation sequences (the job's first; 0 = all)")
    parser.add_argument("--steps", type=int, default=400, help="training steps of every probe (400 x 512: 0.8 epochs of 1,200 sequences)")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--sets", default=",".join(FEATURE_SETS), help="feature sets (names of FEATURE_SETS)")
    parser.add_argument("--extras", default="raw,hydra", help="raw: the best fused set (with layer 30) on raw states; "
                        "hydra: Hydra-style heads on last-only and the best fused set; '' for none")
    parser.add_argument("--eval-job", default=None, help="read the clean split's answers from this job folder as it "
                        "lies (default: data_cache/eval-clean-smollm2 when finished, else one built under data_cache/probe_layers)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); 1 keeps a run "
                        "steady beside other jobs on a 2-core machine (two threads sharing one core stall each other)")
    parser.add_argument("--resume", action="store_true", help="keep the probes OUT/probe.json already holds for the "
                        "same settings and run the rest (each probe's per-sequence scores are kept under data_cache/)")
    parser.add_argument("--out", default="results/heads/probe_layers")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # AdamW's second moments of near-zero gradients: denormals are slow on CPU

    from draftheads.decoding.base.loading import load_base
    from draftheads.training.losses import draft_vocab

    names = [s for s in args.sets.split(",") if s]
    if "last" not in names:
        names.insert(0, "last")
    sets = {n: FEATURE_SETS[n] for n in names}
    layers = tuple(sorted({i for s in sets.values() for i in s}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    prompts = clean_prompts()
    job = Path(args.eval_job).resolve() if args.eval_job else eval_job(prompts)
    eval_seqs, eval_ids, plan = read_job_sequences(job, args.limit_eval)
    train_seqs = read_train_sequences(TRAIN_DATA, args.limit_train + args.select)
    select_seqs, train_seqs = train_seqs[args.limit_train:], train_seqs[: args.limit_train]

    base, _ = load_base(dtype="bfloat16")
    L = base.config.num_hidden_layers
    train = cached_split(base, train_seqs, layers, "train", check_every=8)
    select = cached_split(base, select_seqs, layers, "select")
    evals = cached_split(base, eval_seqs, layers, "eval")

    answer_tokens = torch.from_numpy(train.future[:, 0])  # every answer token of the training sequences, once
    prompt_tokens = torch.from_numpy(np.concatenate([s[:a] for s, a in train_seqs]))
    vocab_ids = draft_vocab(answer_tokens, DRAFT_VOCAB, base.config.vocab_size, prompt_tokens)
    lookup = torch.full((base.config.vocab_size,), -2, dtype=torch.long)
    lookup[vocab_ids] = torch.arange(len(vocab_ids))
    readout = base.lm_head.weight.detach().float()[vocab_ids]
    embed = base.model.embed_tokens.weight.detach().float()
    final_norm = base.model.norm.weight.detach().float()
    eps = base.config.rms_norm_eps
    scales = {i: float(np.sqrt((train.states[i][:: 16].astype(np.float32) ** 2).mean())) for i in layers if i != L}

    eval_labels = evals.future[:, 1:]
    coverage = float((lookup[torch.from_numpy(eval_labels[eval_labels >= 0])] >= 0).double().mean())

    runs, kept = [], {}
    settings = {"limit_train": args.limit_train, "select": args.select, "limit_eval": args.limit_eval,
                "steps": args.steps, "batch": args.batch_size, "lr": args.lr, "seed": args.seed,
                "sets": {n: list(s) for n, s in sets.items()}, "eval_job": str(job), "train_positions": len(train.seq)}
    scores_dir = CACHE / ("scores-" + __import__("hashlib").sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12])
    scores_dir.mkdir(parents=True, exist_ok=True)
    earlier: dict = {}
    if args.resume and (out / "probe.json").is_file():
        old = json.loads((out / "probe.json").read_text())
        if old["meta"].get("settings", settings) != settings:
            raise SystemExit(f"{out / 'probe.json'} was made with other settings; drop --resume or use another --out.")
        earlier = {"commands": old["meta"].get("commands", [old["meta"]["command"]]),
                   "wall_minutes": old["meta"].get("wall_minutes", 0.0)}
        for r in old["runs"]:
            key = f"{r['family']}/{r['set']}/{r['variant']}"
            runs.append(r)
            if (scores_dir / f"{key.replace('/', '_')}.npz").is_file():
                kept[key] = dict(np.load(scores_dir / f"{key.replace('/', '_')}.npz"))
        print(json.dumps({"resumed": [f"{r['family']}/{r['set']}/{r['variant']}" for r in runs]}), flush=True)

    def done(family: str, name: str, variant: str) -> bool:
        return any((r["family"], r["set"], r["variant"]) == (family, name, variant) for r in runs)

    def trained_scores(family: str, name: str, variant: str) -> tuple[Probe, dict, dict, dict]:
        key = f"{family}/{name}/{variant}"
        probe = Probe(sets[name], L, readout, embed, final_norm, eps, scales if variant == "raw" else None,
                      hydra=family == "Hydra")
        trained = train_probe(probe, train, lookup, args.steps, args.batch_size, args.lr, args.seed, key)
        sel = summarize(score_probe(probe, select, lookup), select.seq, select.sequences)
        ev = summarize(score_probe(probe, evals, lookup), evals.seq, evals.sequences)
        kept[key] = ev.pop("_seq")
        np.savez(scores_dir / f"{key.replace('/', '_')}.npz", **kept[key])
        sel.pop("_seq")
        return probe, trained, sel, ev

    def reference(family: str) -> dict | None:
        """The last-only probe's per-sequence scores; a resumed run whose earlier process kept none
        trains it again (same settings, so the same probe) and checks it scores as recorded."""
        key = f"{family}/last/norm"
        if key not in kept and done(family, "last", "norm"):
            recorded = next(r for r in runs if (r["family"], r["set"], r["variant"]) == (family, "last", "norm"))
            _, _, _, ev = trained_scores(family, "last", "norm")
            drift = max(abs(a - b) for a, b in zip(ev["top1"], recorded["eval"]["top1"]))
            recorded["retrained_for_scores"] = {"top1": ev["top1"], "max_top1_drift": round(drift, 4),
                                                "threads": torch.get_num_threads()}
            print(json.dumps({"reference": key, "retrained": ev["top1"], "recorded": recorded["eval"]["top1"]}), flush=True)
        return kept.get(key)

    def run(family: str, name: str, variant: str) -> None:
        key = f"{family}/{name}/{variant}"
        if done(family, name, variant):
            return
        probe, trained, sel, ev = trained_scores(family, name, variant)
        r = {"family": family, "set": name, "layers": list(sets[name]), "variant": variant, **trained,
             "threads": torch.get_num_threads(),
             "params": sum(p.numel() for p in probe.parameters()), "eval": ev, "select": sel,
             "select_top1_mean": round(float(np.mean(sel["top1"])), 4)}
        ref = reference(family) if key != f"{family}/last/norm" else None
        if ref is not None:
            r["vs_last"] = bootstrap_diff(kept[key], ref, args.bootstrap, args.seed)
        print(json.dumps({k: v for k, v in r.items() if k not in ("select",)}), flush=True)
        runs.append(r)
        write()

    picked: dict = {}

    def write() -> None:
        """probe.json, the chart and the README as they stand (after every probe: a stopped run keeps
        what it finished)."""
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": cpu_model(), "torch": torch.__version__,
                "transformers": __import__("transformers").__version__, "python": platform.python_version(),
                "command": "python " + " ".join([command_path(sys.argv[0])] + sys.argv[1:]),
                "commands": earlier.get("commands", []) + ["python " + " ".join([command_path(sys.argv[0])] + sys.argv[1:])],
                "settings": settings,
                "seed": args.seed, "steps": args.steps, "batch": args.batch_size, "lr": args.lr,
                "train_epochs": round(args.steps * args.batch_size / len(train.seq), 2), "bootstrap": args.bootstrap,
                "draft_vocab": DRAFT_VOCAB, "num_heads": NUM_HEADS, "layers_captured": list(layers),
                "positions": "answer only (prompt positions neither trained on nor scored)",
                "feature_sets": {n: list(s) for n, s in sets.items()},
                "raw_scales": {str(i): round(v, 4) for i, v in scales.items()},
                "best_fused": picked.get("best"), "best_fused_with_final": picked.get("best_final"),
                "train": {"source": str(TRAIN_DATA.relative_to(REPO)), "sequences": train.sequences, "tokens": train.tokens,
                          "positions": len(train.seq), "capture_seconds": round(train.seconds, 1), **train.meta},
                "select": {"sequences": select.sequences, "positions": len(select.seq), **select.meta},
                "eval": {"job": str(job.relative_to(REPO)) if job.is_relative_to(REPO) else str(job), "plan": plan,
                         "prompts_in_split": len(prompts), "sequences": evals.sequences, "tokens": evals.tokens,
                         "positions": len(evals.seq), "label_coverage": round(coverage, 4),
                         "capture_seconds": round(evals.seconds, 1), **evals.meta, "ids": eval_ids},
                "complete": len(runs) == planned[0], "wall_minutes": round(earlier.get("wall_minutes", 0.0) + (time.perf_counter() - began) / 60, 1)}
        result = {"meta": meta, "runs": runs}
        (out / "probe.json").write_text(json.dumps(result, indent=1) + "\n")
        plot(runs, out / "probe.png")
        (out / "README.md").write_text(readme(result))

    extras = [e for e in args.extras.split(",") if e]
    planned = [len(sets) + ("hydra" in extras) * 2 + ("raw" in extras)]
    for name in sets:
        run("Medusa", name, "norm")
    fused = [r for r in runs if r["set"] != "last"]
    picked["best"] = best = max(fused, key=lambda r: r["select_top1_mean"])["set"] if fused else "last"
    with_final = [r for r in fused if L in r["layers"]]
    picked["best_final"] = best_final = max(with_final, key=lambda r: r["select_top1_mean"])["set"] if with_final else None
    planned[0] = len(sets) + ("hydra" in extras) * (1 + (best != "last")) + ("raw" in extras and best_final is not None)
    if "hydra" in extras:
        run("Hydra", "last", "norm")
        if best != "last":
            run("Hydra", best, "norm")
    if "raw" in extras and best_final:
        run("Medusa", best_final, "raw")
    write()
    print(markdown_table(runs))
    print(per_head_table(runs))
    return 0


def command_path(arg0: str) -> str:
    path = Path(arg0)
    return str(path.relative_to(REPO)) if path.is_absolute() and path.is_relative_to(REPO) else arg0


if __name__ == "__main__":
    raise SystemExit(main())
