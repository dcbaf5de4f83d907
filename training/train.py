"""One trainer for every draft-head family, driven by 🤗 accelerate.

    python -m draftheads.training.train recipes/medusa-smollm2.yaml [--train.lr 5e-4 ...]
    accelerate launch --config_file recipes/accelerate/cpu.yaml -m draftheads.training.train recipes/hydra-smollm2.yaml
    draftheads train recipes/hydrapp-smollm2.yaml

The family is only a name in the recipe: heads come from ``heads.build_heads`` and are called
as ``heads(hidden, tokens=x_{t+1..t+K})`` → draft logits (P, K, V_draft). The base is frozen;
with the feature cache (default, the fast path) only its LM head and input embeddings stay in
memory while the heads train.

Exact resume: data order is a pure function of (seed, epoch, micro-step) and every checkpoint
(``accelerator.save_state``) holds model, optimizer, scheduler, RNG states and the step, so a
run killed at any moment continues from its last checkpoint as if it had never stopped.
Data-parallel runs split each global batch across processes and normalize each head's loss
by the label count of the *global* batch, so N processes × batch B train exactly like one
process × batch N·B.

KOALA (``adversarial.enabled``, see training/adversarial.py) works on top of any family: a
discriminator with its own optimizer (both in every checkpoint) learns to tell the base's
next-token distribution from the heads', and the heads add λ·(−log D(fake)) to their loss.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..decoding.base import fingerprint, load_base
from ..decoding.limits import DTYPES  # the one dtype table (recipe names are checked against CHOICES)
from ..decoding.tree import tree_from_ranks
from ..heads import REGISTRY, CheckpointError, DraftHeads, HeadConfig, build_heads
from ..heads.card import model_card
from .adversarial import Adversary, expected_embedding, koala_info
from .data import DataError, example_features, load_examples, resolve_data_path, shifted_rows
from .features import Example, Features, extract_features, load_shards
from .losses import (draft_vocab, generator_objective, head_cross_entropy, head_targets, head_weights, input_noise,
                     label_counts, label_ranks, mask_labels, teacher_kl, teacher_logits, topk_accuracy)
from .recipe import Recipe, RecipeError, load_recipe
from .run_state import check_checkpoint_files, foreign_entries, load_run_state, save_run_state

CHECKPOINTS = "checkpoints"
RECIPE_FILE = "recipe.json"
EVAL_RANK_CAP = 16  # ranks beyond this only matter as "missed" for trees and top-k


# -- the frozen base --------------------------------------------------------------------------------
def load_frozen_base(name: str, dtype: str):
    """The base model (frozen) and its tokenizer; a local model directory without a tokenizer
    is fine for pre-tokenized data."""
    if name in ("embedded", "") or name.endswith(".gguf"):
        return load_base(None if name in ("embedded", "") else name, dtype=DTYPES[dtype])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype]).eval().requires_grad_(False)
    except OSError as err:  # not a model dir / not in the local Hub cache: one line for main()
        raise FileNotFoundError(f"Recipe key base={name!r} could not be loaded: {str(err).splitlines()[0]}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


@contextlib.contextmanager
def unsharded_loading(accelerator):
    """The frozen base is never sharded: under ZeRO-3, transformers would partition its weights
    at load time (it follows the global HF DeepSpeed config), and the base runs outside DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or getattr(plugin, "dschf", None) is None:
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(plugin.dschf)


@dataclass
class FrozenParts:
    """What the heads read from the base: the LM head and the input embedding table."""

    lm_head: torch.Tensor
    embed: torch.Tensor
    fingerprint: dict  # keys the feature cache (unchanged across versions)
    checkpoint_fingerprint: dict | None = None  # + the dtype-independent sketch, recorded in the heads
    revision: str | None = None  # the Hub commit of a base loaded from the Hub (recorded in the checkpoint)


def frozen_parts(base, dtype: torch.dtype) -> FrozenParts:
    fp = fingerprint(base)
    return FrozenParts(base.get_output_embeddings().weight.detach().to(dtype),
                       base.get_input_embeddings().weight.detach().to(dtype), fp.to_dict(), fp.with_sketch(base),
                       getattr(base.config, "_commit_hash", None))


# -- data -----------------------------------------------------------------------------------------------
def split_examples(examples: list[Example], eval_examples: int) -> tuple[list[Example], list[Example]]:
    """Held-out = the last ``eval_examples`` examples (never trained on)."""
    if len(examples) <= eval_examples:
        raise DataError(f"Only {len(examples)} usable examples but data.eval_examples={eval_examples}: "
                        "lower data.eval_examples or add data.")
    return examples[: len(examples) - eval_examples], examples[len(examples) - eval_examples:]


def cached_features(base, examples: list[Example], directory: Path, fp: dict, accelerator) -> Features:
    """Extract (or resume extracting) feature shards on the main process, then every process
    loads them; shards from another base are refused by :func:`load_shards`."""
    with accelerator.main_process_first():
        paths = extract_features(base, examples, directory, fp) if accelerator.is_main_process else None
    if paths is None:
        paths = extract_features(base, examples, directory, fp)  # all shards exist now: only lists them
    return load_shards(paths, fp)


class FeatureSource:
    """Training items = cached positions (the fast path); for contextual families (Hydra++,
    whose layer reads the context) items are sequence chunks and a batch is their rows,
    right-padded with -1 (B, T)."""

    def __init__(self, table: Features, num_heads: int, chunk_length: int | None = None):
        self.table = table
        self.next_rows = shifted_rows(table.targets, num_heads)
        self.chunks = None if chunk_length is None else sequence_chunks(table.targets, chunk_length)

    def __len__(self) -> int:
        return len(self.table) if self.chunks is None else len(self.chunks)

    def batch(self, items: torch.Tensor) -> tuple[Features, torch.Tensor, torch.Tensor]:
        if self.chunks is None:
            return self.table, items, self.next_rows[items]
        rows = chunk_rows([self.chunks[i] for i in items.tolist()])
        return self.table, rows, self.next_rows[rows[rows >= 0]]


def sequence_chunks(targets: torch.Tensor, max_length: int) -> list[tuple[int, int]]:
    """Contiguous row ranges [start, end) of at most ``max_length`` positions that never cross
    an example. The cache keeps each example's positions in order, and an example's last
    position is the only one whose x_{t+2} is past the end (``targets[:, 1] < 0``)."""
    chunks, start = [], 0
    for end in (targets[:, 1] < 0).nonzero().squeeze(1).tolist():
        chunks += [(s, min(s + max_length, end + 1)) for s in range(start, end + 1, max_length)]
        start = end + 1
    return chunks


def chunk_rows(chunks: list[tuple[int, int]]) -> torch.Tensor:
    """Row indices of each chunk, right-padded with -1: (B, T)."""
    width = max(e - s for s, e in chunks)
    rows = torch.full((len(chunks), width), -1, dtype=torch.long)
    for i, (s, e) in enumerate(chunks):
        rows[i, : e - s] = torch.arange(s, e)
    return rows


def head_logits(model, table: Features, rows: torch.Tensor, num_heads: int, device, dtype,
                noise_alpha: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits (P, K, V) for ``rows`` and the rows they belong to, flattened: per-position
    families read ``rows`` (P,) directly; contextual ones read padded chunks (B, T) as sequences."""
    safe = rows.clamp(min=0)
    hidden = input_noise(table.hidden[safe].to(device, dtype), noise_alpha)
    tokens = table.targets[safe, :num_heads].clamp(min=0).to(device)
    if rows.dim() == 1:
        return model(hidden, tokens=tokens), rows
    valid = rows >= 0
    logits = model(hidden, tokens=tokens, attention_mask=valid.to(device))
    return logits[valid.to(device)], rows[valid]


class OnTheFlySource:
    """Training items = examples; each batch runs the frozen base over its sequences (for
    contextual families the batch's rows come as sequence chunks, as in :class:`FeatureSource`)."""

    def __init__(self, base, examples: list[Example], num_heads: int, chunk_length: int | None = None):
        self.base, self.examples, self.num_heads, self.chunk_length = base, examples, num_heads, chunk_length

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, items: torch.Tensor) -> tuple[Features, torch.Tensor, torch.Tensor]:
        table = example_features(self.base, [self.examples[i] for i in items.tolist()])
        shifted = shifted_rows(table.targets, self.num_heads)
        if self.chunk_length is None:
            return table, torch.arange(len(table)), shifted
        rows = chunk_rows(sequence_chunks(table.targets, self.chunk_length))
        return table, rows, shifted[rows[rows >= 0]]


def epoch_order(num_items: int, seed: int, epoch: int) -> torch.Tensor:
    """The item order of an epoch: a function of (seed, epoch) only, so a resumed run sees the
    same order whatever happened before."""
    return torch.randperm(num_items, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def micro_batch_items(num_items: int, micro: int, batch: int, world: int, rank: int, seed: int) -> torch.Tensor:
    """This process's items for global micro-step ``micro``: slice ``rank`` of the global batch
    of ``batch · world`` items (the last incomplete global batch of an epoch is dropped)."""
    global_batch = batch * world
    per_epoch = num_items // global_batch
    epoch, index = divmod(micro, per_epoch)
    start = index * global_batch + rank * batch
    return epoch_order(num_items, seed, epoch)[start: start + batch]


# -- one step's loss ------------------------------------------------------------------------------------
def head_labels(table: Features, rows: torch.Tensor, heads: DraftHeads, source: str) -> torch.Tensor:
    """Draft-vocabulary labels (P, K): column k+1 of the text or of the base's own predictions,
    IGNORE where the path runs past the end of the text or the token cannot be drafted."""
    k = heads.num_heads
    ids = (table.teacher if source == "teacher" else table.targets)[rows, 1: k + 1]
    labels = head_targets(ids, heads.vocab_ids.cpu(), heads.config.vocab_size, k)
    return mask_labels(labels, table.targets[rows, 1: k + 1] >= 0)


def compute_loss(model, heads: DraftHeads, table: Features, rows: torch.Tensor, next_rows: torch.Tensor,
                 recipe: Recipe, weights: torch.Tensor, dtype: torch.dtype, accelerator,
                 adversary: Adversary | None = None, step: int = 0) -> tuple[torch.Tensor, dict]:
    """The recipe's objective on one micro-batch, normalized by the global label count. With an
    ``adversary`` (KOALA), its discriminator first takes its steps on this batch (REAL = the
    base's distribution, FAKE = the heads', detached), then the heads' loss adds λ(step)·(−log D)."""
    device = accelerator.device
    logits, rows = head_logits(model, table, rows, heads.num_heads, device, dtype, recipe.loss.noise_alpha)
    labels = head_labels(table, rows, heads, recipe.loss.labels).to(device)
    counts = accelerator.reduce(label_counts(labels), reduction="sum")
    scale = accelerator.num_processes  # DDP averages gradients over processes
    loss = torch.zeros((), dtype=torch.promote_types(dtype, torch.float32), device=device)
    metrics = {}
    if recipe.loss.ce_weight:
        ce, per_head = head_cross_entropy(logits, labels, weights, counts)
        loss = loss + recipe.loss.ce_weight * ce * scale
        metrics["ce"] = per_head.detach() * scale
    if recipe.loss.kl_weight or adversary is not None:
        with torch.no_grad():
            nxt = table.hidden[next_rows.clamp(min=0)].to(device, dtype)  # (P, K, d); masked rows unused
            with accelerator.autocast():
                target = teacher_logits(nxt, heads.draft_weight())
    if recipe.loss.kl_weight:
        kl, per_head = teacher_kl(logits, target, labels, weights, counts, recipe.loss.temperature)
        loss = loss + recipe.loss.kl_weight * kl * scale
        metrics["kl"] = per_head.detach() * scale
    if adversary is not None:
        loss = adversarial_term(adversary, heads, table, rows, logits, target, labels, counts, weights, step, loss,
                                metrics, accelerator)
    return loss, metrics


def adversarial_term(adversary: Adversary, heads: DraftHeads, table: Features, rows: torch.Tensor,
                     logits: torch.Tensor, target: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor,
                     weights: torch.Tensor, step: int, loss: torch.Tensor, metrics: dict, accelerator) -> torch.Tensor:
    """Train the discriminator on this batch, then return ``loss`` + λ·adversarial (``loss``
    itself when λ = 0: the heads' graph is then exactly the supervised one)."""
    device, scale = accelerator.device, accelerator.num_processes
    draft = heads.draft_weight()
    context = table.hidden[rows.clamp(min=0)].to(device, draft.dtype)  # h_t as cached (no input noise)
    with accelerator.autocast():
        with torch.no_grad():
            real = expected_embedding(target, draft)
        fake = expected_embedding(logits, draft)
    d_metrics = adversary.train_discriminator(real, fake.detach(), context, labels, counts,
                                              lambda grad: accelerator.reduce(grad, "sum"))
    metrics.update({name: value * scale for name, value in d_metrics.items()})  # global means, like ce/kl
    lam = adversary.weight(step)
    with contextlib.nullcontext() if lam else torch.no_grad():  # λ = 0: measured, not trained on
        adv, per_head = adversary.generator_loss(fake, context, labels, weights, counts)
    metrics["adv"] = per_head.detach() * scale
    metrics["adv_weight"] = torch.tensor(float(lam), dtype=torch.float64, device=device)
    return generator_objective(loss, adv * scale, lam)


# -- schedule, heads, eval ----------------------------------------------------------------------------------
def lr_lambda(total: int, warmup_ratio: float, min_ratio: float):
    """Linear warmup, then cosine from 1 to ``min_ratio``."""
    warmup = max(1, int(total * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def new_heads(recipe: Recipe, parts: FrozenParts, label_ids: torch.Tensor, dtype: torch.dtype) -> DraftHeads:
    """Fresh heads of the recipe's family, bound to the frozen LM head and embeddings; the draft
    vocabulary is the most frequent of the training labels."""
    vocab_size, d = parts.lm_head.shape
    extra = dict(recipe.heads.extra)
    if recipe.adversarial.enabled:  # a KOALA checkpoint says so (reports label it KOALA-<family>)
        extra["koala"] = koala_info(recipe.heads.family, recipe.heads.num_layers, recipe.adversarial)
    config = HeadConfig(family=recipe.heads.family, num_heads=recipe.heads.num_heads,
                        num_layers=recipe.heads.num_layers, hidden_size=d, vocab_size=vocab_size,
                        draft_vocab_size=recipe.heads.draft_vocab_size, extra=extra)
    heads = build_heads(config).to(dtype)
    heads.vocab_ids.copy_(draft_vocab(label_ids, recipe.heads.draft_vocab_size, vocab_size))
    return heads.bind(parts.lm_head, parts.embed)


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
    whole sequence chunks, so they may stop a little past it)."""
    count = min(len(table), max_positions) if max_positions else len(table)
    if heads.contextual:
        chunks = [c for c in sequence_chunks(table.targets, chunk_length) if c[0] < count]
        batches = [chunk_rows(chunks[i: i + 8]) for i in range(0, len(chunks), 8)]
    else:
        batches = [torch.arange(s, min(s + batch_size, count)) for s in range(0, count, batch_size)]
    ranks = []
    for rows in batches:
        logits, flat = head_logits(heads, table, rows, heads.num_heads, device, dtype)
        labels = head_labels(table, flat, heads, labels_from).to(device)
        ranks.append(label_ranks(logits.float(), labels, EVAL_RANK_CAP).cpu())
    return torch.cat(ranks)


# -- run state -----------------------------------------------------------------------------------------------
class Progress:
    """Where the run is; saved in every checkpoint next to model/optimizer/scheduler/RNG."""

    def __init__(self):
        self.step = 0  # optimizer steps done
        self.positions = 0  # training positions seen (all processes)
        self.train_seconds = 0.0
        self.last_loss = float("nan")

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    return sorted(p for p in (output_dir / CHECKPOINTS).glob("step-*") if p.is_dir() and not p.name.endswith(".partial"))


def check_same_recipe(directory: Path, recipe: Recipe) -> None:
    """Refuse to resume a run made with another recipe, naming the keys that differ."""
    path = directory / RECIPE_FILE
    if not path.is_file():
        raise RecipeError(f"{directory} has no {RECIPE_FILE}: it is not a draftheads training run/checkpoint.")
    saved = json.loads(path.read_text())

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, prefix + k + ".") if isinstance(v, dict) and k != "extra" else {prefix + k: v})
        return out

    old, new = flat(saved), flat(recipe.identity())
    diffs = [f"{k}: {old.get(k)!r} → {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diffs:
        raise RecipeError(f"Cannot resume {directory}: it was made with a different recipe ({'; '.join(diffs)}). "
                          "Use another run.output_dir, or run.resume=never to start over there.")


def resume_point(recipe: Recipe, output_dir: Path) -> Path | None:
    """The checkpoint to resume from (None = fresh start), after checking it fits the recipe."""
    mode = recipe.run.resume
    if mode == "never":
        foreign = foreign_entries(output_dir / CHECKPOINTS)
        if foreign:
            raise RecipeError(f"run.resume=never deletes {output_dir / CHECKPOINTS}, but it holds entries draftheads "
                              f"did not write ({', '.join(foreign[:5])}): move them away or use another "
                              "run.output_dir.")
        shutil.rmtree(output_dir / CHECKPOINTS, ignore_errors=True)
        return None
    if mode == "auto":
        found = checkpoint_dirs(output_dir)
        if (output_dir / RECIPE_FILE).is_file():
            check_same_recipe(output_dir, recipe)
        if not found:
            return None
        chosen = found[-1]
    else:
        chosen = Path(mode)
        if not chosen.is_dir():
            raise RecipeError(f"run.resume={mode!r}: no such checkpoint directory (use auto, never or a "
                              f"{output_dir / CHECKPOINTS}/step-* directory).")
    check_same_recipe(chosen, recipe)
    return chosen


def save_checkpoint(accelerator, output_dir: Path, step: int, recipe: Recipe, keep: int,
                    own_state: dict | None = None) -> None:
    """save_state into step-N.partial (plus draftheads' own state, never pickled), renamed when
    every process has written its part: a checkpoint directory without the suffix is always complete."""
    final = output_dir / CHECKPOINTS / f"step-{step:07d}"
    tmp = final.with_name(final.name + ".partial")
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / RECIPE_FILE).write_text(json.dumps(recipe.identity(), indent=1) + "\n")
        save_run_state(tmp, own_state or {})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoint_dirs(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


class JsonlLog:
    """Local metrics log (main process). On resume, lines past the resumed step (written by the
    killed run after its last checkpoint) are dropped so the log reads like one run."""

    def __init__(self, path: Path, resume_step: int | None, enabled: bool):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        lines = path.read_text().splitlines() if path.is_file() and resume_step is not None else []
        kept = [line for line in lines if json.loads(line).get("step", 0) <= resume_step] if lines else []
        path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")


def make_accelerator(recipe: Recipe, output_dir: Path):
    """Accelerator with the recipe's precision/accumulation; wandb tracker offline unless an
    API key is set (never an interactive login), skipped with a notice if not installed."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    trackers = []
    if recipe.run.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            print("[draftheads] wandb is not installed: logging to log.jsonl only (pip install wandb).",
                  file=sys.stderr)
        else:
            if not os.environ.get("WANDB_API_KEY"):
                os.environ["WANDB_MODE"] = "offline"
            os.environ.setdefault("WANDB_DIR", str(output_dir))
            os.environ.setdefault("WANDB_SILENT", "true")
            trackers.append("wandb")
    # cpu=True without a GPU: processes started by torchrun (accelerate's multi_gpu launcher)
    # then form a gloo group instead of each training alone
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    return Accelerator(cpu=not torch.cuda.is_available() and not deepspeed, mixed_precision=recipe.train.mixed_precision,
                       gradient_accumulation_steps=recipe.train.grad_accum, log_with=trackers or None,
                       project_config=ProjectConfiguration(project_dir=str(output_dir)))


def configure_deepspeed(accelerator, recipe: Recipe) -> None:
    """DeepSpeed needs the micro-batch size up front; there is no DataLoader to infer it from."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = recipe.train.batch_size
        plugin.deepspeed_config["gradient_accumulation_steps"] = recipe.train.grad_accum
        plugin.deepspeed_config.pop("train_batch_size", None)


def preflight(recipe: Recipe) -> None:
    """What can be checked without loading anything, checked before any work: the data paths
    and a base given as a local path exist (the recipe's keys were validated when it loaded)."""
    from ..decoding.limits import check_base_path

    for path in [recipe.data.path] if isinstance(recipe.data.path, str) else recipe.data.path:
        if not resolve_data_path(path).exists():
            raise DataError(f"Recipe key data.path: {path} does not exist (tried from the working directory and the "
                            "source checkout); fix the path or pass --data.path.")
    if recipe.base not in ("embedded", ""):
        check_base_path(recipe.base)


# -- the loop ---------------------------------------------------------------------------------------------------
def train(recipe: Recipe) -> dict:
    """Train the recipe's heads; returns the training report (also written next to the
    final ``save_pretrained`` checkpoint)."""
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    preflight(recipe)
    output_dir = Path(recipe.run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = make_accelerator(recipe, output_dir)
    configure_deepspeed(accelerator, recipe)
    resume = resume_point(recipe, output_dir)
    if resume is not None:
        check_checkpoint_files(resume)  # every file is data, checked before any work (and before accelerate opens it)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (output_dir / RECIPE_FILE).write_text(json.dumps(recipe.identity(), indent=1) + "\n")
    set_seed(recipe.train.seed)
    dtype = DTYPES[recipe.train.dtype]
    k = recipe.heads.num_heads
    chunking = recipe.train.chunk_length if getattr(REGISTRY.get(recipe.heads.family), "contextual", False) else None

    with unsharded_loading(accelerator):
        base, tokenizer = load_frozen_base(recipe.base, recipe.base_dtype)
    parts = frozen_parts(base, dtype)
    paths = [recipe.data.path] if isinstance(recipe.data.path, str) else recipe.data.path
    examples = [e for path in paths
                for e in load_examples(recipe.data.kind, path, tokenizer, recipe.data.max_length, recipe.data.limit,
                                       recipe.data.sources, recipe.data.source_caps)]
    train_examples, eval_examples = split_examples(examples, recipe.data.eval_examples)
    if recipe.data.features_dir:
        cache = Path(recipe.data.features_dir)
        source = FeatureSource(cached_features(base, train_examples, cache / "train", parts.fingerprint, accelerator),
                               k, chunking)
        eval_table = cached_features(base, eval_examples, cache / "eval", parts.fingerprint, accelerator)
        label_ids = source.table.teacher[:, 1: k + 1]
        del base  # only the LM head and the embeddings are needed from here on
    else:
        eval_table = example_features(base, eval_examples)
        source = OnTheFlySource(base, train_examples, k, chunking)
        label_ids = torch.tensor([t for e in train_examples for t in e.input_ids[e.response_start:]])

    heads = new_heads(recipe, parts, label_ids, dtype).to(accelerator.device)
    heads.train()
    world, batch = accelerator.num_processes, recipe.train.batch_size
    micro_per_epoch = len(source) // (batch * world)
    if micro_per_epoch == 0:
        raise DataError(f"{len(source)} training items cannot fill one global batch of {batch} × {world} processes; "
                        "lower train.batch_size.")
    total = recipe.train.max_steps or max(1, int(recipe.train.epochs * micro_per_epoch) // recipe.train.grad_accum)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=recipe.train.lr, weight_decay=recipe.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total, recipe.train.warmup_ratio,
                                                                       recipe.train.min_lr_ratio))
    # KOALA's discriminator: built from its own generator (the global RNG is untouched), trained
    # by its own optimizer; both are checkpointed (after scheduler and progress, so the custom
    # checkpoint indices of plain runs stay as they were)
    adversary = Adversary(recipe.adversarial, heads.config.hidden_size, k, heads.draft_weight(), recipe.train.seed,
                          accelerator.device, dtype) if recipe.adversarial.enabled else None
    model, optimizer = accelerator.prepare(heads, optimizer)
    progress = Progress()
    # the scheduler is stepped by hand once per optimizer step (accelerate's wrapper would step it
    # once per process), so it is checkpointed as a plain object
    # (saved by draftheads itself as safetensors + JSON: accelerate would pickle them, see run_state.py)
    own_state = {"scheduler": scheduler, "progress": progress}
    if adversary is not None:
        own_state.update(discriminator=adversary.discriminator, discriminator_optimizer=adversary.optimizer)
    if resume is not None:
        accelerator.load_state(str(resume))
        load_run_state(resume, own_state)
        accelerator.print(f"[draftheads] resumed from {resume} at step {progress.step}")
    accelerator.init_trackers(recipe.run.wandb_project, config=recipe.to_dict(),
                              init_kwargs={"wandb": {"name": recipe.name, "dir": str(output_dir)}})
    log = JsonlLog(output_dir / "log.jsonl", progress.step if resume is not None else None,
                   accelerator.is_main_process)
    weights = head_weights(k, recipe.loss.head_decay).to(accelerator.device)
    bar = tqdm(total=total, initial=progress.step, desc=f"{recipe.name} ({recipe.heads.family})", unit="step",
               disable=not accelerator.is_local_main_process)
    unwrapped = accelerator.unwrap_model(model)
    started = time.perf_counter()
    while progress.step < total:
        step_positions, step_loss, step_metrics = 0, torch.zeros(()), {}
        for _ in range(recipe.train.grad_accum):
            micro = progress.step * recipe.train.grad_accum + _
            items = micro_batch_items(len(source), micro, batch, world, accelerator.process_index, recipe.train.seed)
            table, rows, next_rows = source.batch(items)
            with accelerator.accumulate(model):
                loss, metrics = compute_loss(model, unwrapped, table, rows, next_rows, recipe, weights, dtype,
                                             accelerator, adversary, progress.step)
                accelerator.backward(loss)
                if accelerator.sync_gradients and recipe.train.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), recipe.train.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_positions += int(accelerator.reduce(torch.tensor(int((rows >= 0).sum()), device=accelerator.device),
                                                     "sum"))
            step_loss = step_loss + accelerator.reduce(loss.detach(), "mean").cpu() / recipe.train.grad_accum
            for name, value in metrics.items():
                step_metrics[name] = step_metrics.get(name, 0) + accelerator.reduce(value, "mean").cpu() / recipe.train.grad_accum
        scheduler.step()
        progress.step += 1
        progress.positions += step_positions
        progress.last_loss = float(step_loss)
        now = time.perf_counter()
        progress.train_seconds += now - started
        started = now
        bar.update(1)
        if progress.step % recipe.run.log_every == 0 or progress.step == total:
            record = {"step": progress.step, "loss": progress.last_loss, "lr": scheduler.get_last_lr()[0],
                      "positions": progress.positions,
                      **metric_fields(step_metrics)}
            bar.set_postfix(loss=f"{progress.last_loss:.4f}")
            log.write(record)
            accelerator.log(record, step=progress.step)
        if progress.step % recipe.run.eval_every == 0 and progress.step < total:
            if accelerator.is_main_process:
                accuracy, _ = evaluate(unwrapped, eval_table, recipe, dtype, accelerator)
                record = {"step": progress.step, "eval": accuracy}
                log.write(record)
                accelerator.log({f"eval/{m}/head{h}": v for m, vals in accuracy.items() for h, v in enumerate(vals)},
                                step=progress.step)
            accelerator.wait_for_everyone()
            started = time.perf_counter()
        if progress.step % recipe.run.checkpoint_every == 0 and progress.step < total:
            save_checkpoint(accelerator, output_dir, progress.step, recipe, recipe.run.keep_checkpoints,
                            own_state)
            started = time.perf_counter()
    bar.close()
    report = {}
    if accelerator.is_main_process:
        report = finish(unwrapped, eval_table, recipe, parts, progress, dtype, accelerator, total)
        log.write({"step": progress.step, "eval": report["accuracy"], "final": True})
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return report


def metric_fields(metrics: dict) -> dict:
    """Per-head metrics (K,) → ``name/head<h>``; scalars (e.g. adv_weight) keep their name."""
    out = {}
    for name, vals in metrics.items():
        if vals.dim() == 0:
            out[name] = float(vals)
        else:
            out.update({f"{name}/head{h}": float(v) for h, v in enumerate(vals)})
    return out


def finish(heads: DraftHeads, eval_table: Features, recipe: Recipe, parts: FrozenParts, progress: Progress,
           dtype: torch.dtype, accelerator, total: int) -> dict:
    """Held-out accuracy, trees for each node budget, ``save_pretrained`` + model card + report."""
    accuracy, ranks = evaluate(heads, eval_table, recipe, dtype, accelerator)
    trees = {}
    for budget in recipe.run.tree_budgets:
        paths, tau = tree_from_ranks(ranks, budget)
        trees[str(budget)] = {"paths": [list(p) for p in paths], "expected_tau": round(tau, 4)}
    config = heads.config
    config.trees = {b: t["paths"] for b, t in trees.items()}
    config.base_fingerprint = parts.checkpoint_fingerprint or parts.fingerprint
    config.base_name = "embedded:smollm2-135m-instruct" if recipe.base == "embedded" else recipe.base
    config.base_revision = parts.revision
    config.extra = {**config.extra, "recipe": recipe.to_dict(), "held_out_accuracy": accuracy}
    config.default_budget = recipe.run.default_budget
    config.expected_tau = {b: t["expected_tau"] for b, t in trees.items()}
    out = Path(recipe.run.final_dir or Path(recipe.run.output_dir) / "final")
    seconds = progress.train_seconds
    report = {"recipe": recipe.to_dict(), "steps": progress.step, "planned_steps": total,
              "final_loss": progress.last_loss, "train_positions_seen": progress.positions,
              "train_tokens_per_second": round(progress.positions / seconds, 1) if seconds else None,
              "train_wall_seconds": round(seconds, 1), "processes": accelerator.num_processes,
              "distributed_type": str(accelerator.distributed_type).split(".")[-1],
              "mixed_precision": recipe.train.mixed_precision, "held_out_positions": int(ranks.shape[0]),
              "accuracy": accuracy, "trees": trees, "base_fingerprint": parts.fingerprint,
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}
    heads.save_pretrained(out, dtype=DTYPES[recipe.run.save_dtype], card=model_card(config, report, name=str(out)),
                          files={"training_report.json": json.dumps(report, indent=2) + "\n"})
    return report


def quiet_library_bars() -> None:
    """Without a terminal on stderr (logs, CI, ``accelerate launch`` workers) the libraries'
    own bars (transformers' weight loading, datasets' split generation) are switched off: a log
    should hold the run's own progress and, on failure, one ``error:`` line."""
    if sys.stderr.isatty():
        return
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    path, overrides = (None, argv) if argv[0].startswith("--") else (argv[0], argv[1:])
    try:
        recipe = load_recipe(path, overrides)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    quiet_library_bars()
    try:
        report = train(recipe)
    except (RecipeError, DataError, CheckpointError, FileNotFoundError) as err:  # one clear line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    if report:
        print(json.dumps({k: report[k] for k in ("steps", "final_loss", "train_tokens_per_second",
                                                  "train_wall_seconds", "accuracy")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
