"""scripts/probe_layers.py: capturing the base's layers and reading the sequences (one of its three files)."""
from __future__ import annotations

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

from probe_layers_setup import *  # noqa: F401,F403 (the probe's constants)


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
