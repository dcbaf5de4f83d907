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

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..decoding.base.loading import dtype_name
from ..decoding.base.dtypes import DTYPES
from ..heads import REGISTRY, DraftHeads
from ..core.errors import DraftheadsError, one_line
from .adversarial import Adversary
from .data.records import DataError, example_features, load_examples, resolve_data_path
from .evaluation import DEV, HELD_OUT, eval_tables, evaluate, load_eval_table
from .frozen import feature_layers_for, frozen_parts, load_frozen_base, unsharded_loading
from .final_checkpoint import write_final_checkpoint
from .head_init import new_heads
from .losses import head_weights
from .objective import compute_loss, lr_lambda
from .recipe import load_recipe
from .recipe_sections import Recipe, RecipeError
from .report import JsonlLog, epoch_ended, metric_fields, record_epoch, start_summary
from .resume import RECIPE_FILE, Curves, Progress, resume_point, save_checkpoint
from .run_state import check_checkpoint_files, load_run_state
from .batches import FeatureBatches, OnTheFlyBatches, cached_features, micro_batch_items, split_examples
from .data.job_data import job_batches
from .preflight import data_paths, preflight


# -- data -----------------------------------------------------------------------------------------------


# -- one step's loss ------------------------------------------------------------------------------------


# -- schedule, heads, eval ----------------------------------------------------------------------------------


# -- run state -----------------------------------------------------------------------------------------------


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


# -- the loop ---------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One training run's live state: what the loop reads and updates every step."""

    recipe: Recipe
    accelerator: object
    output_dir: Path
    dtype: torch.dtype
    model: torch.nn.Module  # the heads as accelerate prepared them (DDP/DeepSpeed wrapper)
    heads: DraftHeads  # the same heads unwrapped
    optimizer: object
    scheduler: object
    adversary: Adversary | None
    progress: Progress
    own_state: dict  # what draftheads checkpoints itself (run_state.py), never pickled
    total: int  # optimizer steps of the whole run
    weights: torch.Tensor  # (K,) per-head loss weights
    epoch_micros: int  # micro-steps (global batches) of one epoch
    curves: Curves  # per-epoch records and the best epoch so far (part of own_state)


def train(recipe: Recipe) -> dict:
    """Train the recipe's heads; returns the training report (also written next to the
    final ``save_pretrained`` checkpoint)."""
    from tqdm.auto import tqdm

    accelerator, output_dir, resume = start_run(recipe)
    dtype = DTYPES[recipe.train.dtype]
    parts, batches, eval_sets, label_ids = prepare_data(recipe, accelerator, dtype)
    run = prepare_run(recipe, accelerator, output_dir, dtype, parts, batches, label_ids)
    if resume is not None:
        accelerator.load_state(str(resume))
        load_run_state(resume, run.own_state, optional=("curves",))
        accelerator.print(f"[draftheads] resumed from {resume} at step {run.progress.step}")
    accelerator.init_trackers(recipe.run.wandb_project, config=recipe.to_dict(),
                              init_kwargs={"wandb": {"name": recipe.name, "dir": str(output_dir)}})
    log = JsonlLog(output_dir / "log.jsonl", run.progress.step if resume is not None else None,
                   accelerator.is_main_process)
    bar = tqdm(total=run.total, initial=run.progress.step, desc=f"{recipe.name} ({recipe.heads.family})",
               unit="step", disable=not accelerator.is_local_main_process)
    started = time.perf_counter()
    while run.progress.step < run.total:
        metrics = optimizer_step(run, batches)
        now = time.perf_counter()
        run.progress.train_seconds += now - started
        bar.update(1)
        if after_step(run, metrics, eval_sets, log, bar):  # evaluated or checkpointed: not training time
            now = time.perf_counter()
        started = now
    bar.close()
    report = {}
    if accelerator.is_main_process:
        trees_on = eval_sets[DEV][0] if recipe.run.trees_from == "dev" else None
        report = write_final_checkpoint(run.heads, eval_sets[HELD_OUT][0], recipe, parts, run.progress, dtype,
                                        accelerator, run.total, run.curves, trees_on)
        log.write({"step": run.progress.step, "eval": report["accuracy"], "final": True})
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return report


def start_run(recipe: Recipe):
    """Everything checked before any work, then the accelerator, the checkpoint to resume from
    (its files checked to be data before accelerate opens them) and the seed."""
    from accelerate.utils import set_seed

    preflight(recipe)
    output_dir = Path(recipe.run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = make_accelerator(recipe, output_dir)
    configure_deepspeed(accelerator, recipe)
    resume = resume_point(recipe, output_dir)
    if resume is not None:
        check_checkpoint_files(resume)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (output_dir / RECIPE_FILE).write_text(json.dumps(recipe.identity(), indent=1) + "\n")
    set_seed(recipe.train.seed)
    return accelerator, output_dir, resume


def prepare_data(recipe: Recipe, accelerator, dtype: torch.dtype):
    """The frozen parts, the training batches, the tables each epoch is scored on (the
    held-out split, and ``data.eval_path``'s) and the label ids the draft vocabulary is counted
    from; the base is loaded once for all of them (kept only by on-the-fly batches). Every table
    holds the states of the base layers the heads read beside the final one (``heads.feature_layers``)."""
    with unsharded_loading(accelerator):
        base, tokenizer = load_frozen_base(recipe.base, recipe.base_dtype)
    parts = frozen_parts(base, dtype, feature_layers_for(recipe, base))
    batches, held_out, label_ids = training_data(recipe, accelerator, base, tokenizer, parts)
    return parts, batches, eval_tables(held_out, load_eval_table(recipe, accelerator, parts.fingerprint, base,
                                                                 tokenizer)), label_ids


def training_data(recipe: Recipe, accelerator, base, tokenizer, parts):
    """(batches, held-out table, label ids) from a job folder, the feature cache or the base on the fly."""
    k, layers = recipe.heads.num_heads, parts.feature_layers
    chunking = recipe.train.chunk_length if getattr(REGISTRY.get(recipe.heads.family), "contextual", False) else None
    if recipe.data.kind == "job":
        paths = [resolve_data_path(path) for path in data_paths(recipe)]
        return job_batches(recipe, paths, parts.fingerprint, dtype_name(base.dtype), chunking, layers)
    examples = [e for path in data_paths(recipe)
                for e in load_examples(recipe.data.kind, path, tokenizer, recipe.data.max_length, recipe.data.limit,
                                       recipe.data.sources, recipe.data.source_caps, recipe.data.name,
                                       recipe.data.split, recipe.data.columns)]
    train_examples, eval_examples = split_examples(examples, recipe.data.eval_examples)
    if recipe.data.features_dir:
        cache = Path(recipe.data.features_dir)
        batches = FeatureBatches(cached_features(base, train_examples, cache / "train", parts.fingerprint, accelerator,
                                                 layers), k, chunking)
        eval_table = cached_features(base, eval_examples, cache / "eval", parts.fingerprint, accelerator, layers)
        return batches, eval_table, batches.table.teacher[:, 1: k + 1]
    label_ids = torch.tensor([t for e in train_examples for t in e.input_ids[e.response_start:]])
    return (OnTheFlyBatches(base, train_examples, k, chunking, layers), example_features(base, eval_examples, layers),
            label_ids)


def prepare_run(recipe: Recipe, accelerator, output_dir: Path, dtype: torch.dtype, parts, batches,
                label_ids: torch.Tensor) -> Run:
    """Fresh heads, the step count, optimizer and schedule, KOALA's discriminator, accelerate's
    wrapping, and the state draftheads checkpoints itself."""
    heads = new_heads(recipe, parts, label_ids, dtype, getattr(batches, "prompt_ids", None)).to(accelerator.device)
    heads.train()
    world, batch = accelerator.num_processes, recipe.train.batch_size
    micro_per_epoch = len(batches) // (batch * world)
    if micro_per_epoch == 0:
        raise DataError(f"{len(batches)} training items cannot fill one global batch of {batch} × {world} processes; "
                        "lower train.batch_size.")
    total = recipe.train.max_steps or max(1, int(recipe.train.epochs * micro_per_epoch) // recipe.train.grad_accum)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=recipe.train.lr, weight_decay=recipe.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total, recipe.train.warmup_ratio,
                                                                       recipe.train.min_lr_ratio))
    # KOALA's discriminator: built from its own generator (the global RNG is untouched), trained
    # by its own optimizer; both are checkpointed
    adversary = Adversary(recipe.adversarial, heads.config.hidden_size, recipe.heads.num_heads, heads.draft_weight(),
                          recipe.train.seed, accelerator.device, dtype) if recipe.adversarial.enabled else None
    model, optimizer = accelerator.prepare(heads, optimizer)
    progress = Progress()
    if recipe.heads.init_from:  # pinned now: the folder may be overwritten by this run (run.final_dir) or another
        progress.start = start_summary(recipe.heads.init_from)
    # the scheduler is stepped by hand once per optimizer step (accelerate's wrapper would step it
    # once per process); draftheads saves it itself as safetensors + JSON (accelerate would pickle it)
    own_state = {"scheduler": scheduler, "progress": progress}
    if adversary is not None:
        own_state.update(discriminator=adversary.discriminator, discriminator_optimizer=adversary.optimizer)
    own_state["curves"] = curves = Curves()  # last: checkpoints from before it existed still resume
    weights = head_weights(recipe.heads.num_heads, recipe.loss.head_decay).to(accelerator.device)
    return Run(recipe, accelerator, output_dir, dtype, model, accelerator.unwrap_model(model), optimizer, scheduler,
               adversary, progress, own_state, total, weights, micro_per_epoch, curves)


def optimizer_step(run: Run, batches) -> dict:
    """One optimizer step over ``grad_accum`` micro-batches (the data order a pure function of
    seed and step); updates the progress and returns the step's reduced per-head metrics."""
    recipe, accelerator = run.recipe, run.accelerator
    accum, batch = recipe.train.grad_accum, recipe.train.batch_size
    positions, step_loss, step_metrics = 0, torch.zeros(()), {}
    for micro_in_step in range(accum):
        micro = run.progress.step * accum + micro_in_step
        items = micro_batch_items(len(batches), micro, batch, accelerator.num_processes, accelerator.process_index,
                                  recipe.train.seed)
        table, rows, next_rows = batches.batch(items)
        with accelerator.accumulate(run.model):
            loss, metrics = compute_loss(run.model, run.heads, table, rows, next_rows, recipe, run.weights, run.dtype,
                                         accelerator, run.adversary, run.progress.step)
            accelerator.backward(loss)
            if accelerator.sync_gradients and recipe.train.max_grad_norm > 0:
                accelerator.clip_grad_norm_(run.model.parameters(), recipe.train.max_grad_norm)
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
        positions += int(accelerator.reduce(torch.tensor(int((rows >= 0).sum()), device=accelerator.device), "sum"))
        step_loss = step_loss + accelerator.reduce(loss.detach(), "mean").cpu() / accum
        for name, value in metrics.items():
            step_metrics[name] = step_metrics.get(name, 0) + accelerator.reduce(value, "mean").cpu() / accum
    run.scheduler.step()
    run.progress.step += 1
    run.progress.positions += positions
    run.progress.last_loss = float(step_loss)
    return step_metrics


def after_step(run: Run, metrics: dict, eval_sets: dict, log: JsonlLog, bar) -> bool:
    """Log, evaluate (also at each epoch's end: :func:`.report.record_epoch`) and checkpoint on
    their schedules; True when it evaluated or checkpointed (time that does not count as training)."""
    recipe, accelerator, progress = run.recipe, run.accelerator, run.progress
    run.curves.add_step(progress.last_loss)
    if progress.step % recipe.run.log_every == 0 or progress.step == run.total:
        record = {"step": progress.step, "loss": progress.last_loss, "lr": run.scheduler.get_last_lr()[0],
                  "positions": progress.positions, **metric_fields(metrics)}
        bar.set_postfix(loss=f"{progress.last_loss:.4f}")
        log.write(record)
        accelerator.log(record, step=progress.step)
    paused = False
    if progress.step % recipe.run.eval_every == 0 and progress.step < run.total:
        if accelerator.is_main_process:
            accuracy, _ = evaluate(run.heads, eval_sets[HELD_OUT][0], recipe, run.dtype, accelerator)
            log.write({"step": progress.step, "eval": accuracy})
            accelerator.log({f"eval/{m}/head{h}": v for m, vals in accuracy.items() for h, v in enumerate(vals)},
                            step=progress.step)
        accelerator.wait_for_everyone()
        paused = True
    if recipe.run.eval_each_epoch and epoch_ended(progress.step, recipe.train.grad_accum, run.epoch_micros, run.total):
        record_epoch(run, eval_sets, log)
        paused = True
    if progress.step % recipe.run.checkpoint_every == 0 and progress.step < run.total:
        save_checkpoint(accelerator, run.output_dir, progress.step, recipe, recipe.run.keep_checkpoints, run.own_state)
        paused = True
    return paused


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
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        return 2
    quiet_library_bars()
    try:
        report = train(recipe)
    except DraftheadsError as err:  # every project error: one clear line, no traceback
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        return 2
    if report:
        print(json.dumps({k: report[k] for k in ("steps", "final_loss", "train_tokens_per_second",
                                                  "train_wall_seconds", "accuracy")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
