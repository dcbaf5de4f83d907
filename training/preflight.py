"""What a recipe is checked for before any work: the data paths (and their records), a base
given as a path, the heads against the base's vocabulary, hidden size and layers (from its
config, no weights), a job folder against the layers the heads read, and the final checkpoint's
folder. A problem is one line naming the recipe key and the fix.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..core.errors import DraftheadsError, one_line
from .data.records import DATA_OPTIONS, DataError, is_hub_id, load_records, resolve_data_path
from .data.data_checks import check_data
from .frozen import base_depth, base_dims
from .data.job_data import check_job_folder, check_job_layers, check_job_predicted
from .recipe_checks import resolve_feature_layers
from .recipe_sections import Recipe, RecipeError


def data_paths(recipe: Recipe) -> list[str]:
    """data.path as a list (one path or several, concatenated in order)."""
    return [recipe.data.path] if isinstance(recipe.data.path, str) else list(recipe.data.path)


def preflight(recipe: Recipe) -> None:
    """What can be checked without loading the base, checked before any work (the recipe's keys
    were validated when it loaded): the data paths and a base given as a local path exist, every
    data record holds what training reads with its token ids inside the base's vocabulary, the
    heads fit that vocabulary and hidden size (both read from the base's config, no weights),
    the base has the layers they read (``heads.feature_layers``) and a job folder holds their
    states (and, for ``data.prompt_positions``, the base's predictions), and the final
    checkpoint's folder may be written."""
    from ..decoding.base.loading import check_base_path

    paths = data_paths(recipe)
    if not paths or not all(paths):
        raise DataError(f"Recipe key data.path is not set (--data.path PATH_OR_HUB_ID); {DATA_OPTIONS}.")
    for path in paths:
        if recipe.data.kind == "job":
            check_job_folder(resolve_data_path(path))
            continue
        if resolve_data_path(path).exists():
            continue
        if not is_hub_id(path):
            raise DataError(f"Recipe key data.path: {path} does not exist (tried from the working directory and the "
                            f"source checkout); {DATA_OPTIONS}.")
        load_records(path, recipe.data.name, recipe.data.split)  # a Hub id: cached (or fetched) now, or one line
    if recipe.base not in ("embedded", ""):
        check_base_path(recipe.base)
    depth = base_depth(recipe.base)
    layers = resolve_feature_layers(recipe.heads.feature_layers, depth)  # a layer the base lacks: one line
    dims = base_dims(recipe.base)
    if dims is not None:
        check_heads_fit(recipe, *dims, layers)
    if depth is not None:  # the layers known: a job's shards must hold their states (its manifests say)
        jobs = [resolve_data_path(p) for p in paths] if recipe.data.kind == "job" else []
        eval_path = Path(recipe.data.eval_path) if recipe.data.eval_path else None
        for folder in jobs + ([eval_path] if eval_path is not None and eval_path.is_dir() else []):
            check_job_layers(folder, layers)
    if recipe.data.kind == "job" and recipe.data.prompt_positions:  # the training jobs (evaluation: answers only)
        for path in paths:
            check_job_predicted(resolve_data_path(path), layers)
    for path in paths if recipe.data.kind != "job" else ():  # a job's shards are checked as they open
        check_data(path, recipe.data.kind, dims[0] if dims else None, recipe.data.name, recipe.data.split,
                   recipe.data.columns, bool(recipe.data.sources or recipe.data.source_caps))
    if recipe.heads.init_from:  # "default" resolves only once the base's depth is known
        known = depth is not None or recipe.heads.feature_layers != "default"
        check_start(recipe.heads.init_from, layers if known else None)
    check_final_dir(recipe)


def check_start(path: str, layers: list[int] | None = None) -> None:
    """``heads.init_from`` names a checkpoint folder holding config.json (or a Hub id, resolved
    when the heads are built): a typo is one line now, not after the data and the base load;
    so is a folder whose heads read other base layers than the recipe's ``layers`` (when known:
    heads that read the final state only may start heads that read layers too)."""
    import json

    folder = Path(path)
    if folder.exists() and not (folder / "config.json").is_file():
        raise RecipeError(f"Recipe key heads.init_from: {path} holds no config.json; name a heads checkpoint "
                          "folder (e.g. checkpoints/smollm2-135m-hydra) or drop the key.")
    if not folder.exists() and not is_hub_id(path):
        raise RecipeError(f"Recipe key heads.init_from: {path} does not exist; name a heads checkpoint folder "
                          "(e.g. checkpoints/smollm2-135m-hydra) or a Hub id, or drop the key.")
    if layers is None or not folder.exists():
        return
    try:
        start = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("feature_layers") or []
    except (OSError, ValueError, AttributeError):
        return  # loading the checkpoint names what is wrong with it
    if start and start != layers:
        raise RecipeError(f"heads.init_from {path} holds other heads than the recipe trains: feature_layers {start} "
                          f"(recipe: {layers}); set the recipe's heads.feature_layers to {start}, or drop "
                          "heads.init_from.")


def check_heads_fit(recipe: Recipe, vocab_size: int, hidden_size: int, feature_layers: list[int] | None = None) -> None:
    """The recipe's heads against the base's vocabulary and hidden size: the draft vocabulary
    is a part of the base's, and the family's options fit the hidden size (the heads are built
    on the meta device: their own checks run, no memory is used)."""
    if recipe.heads.draft_vocab_size > vocab_size:
        raise RecipeError(f"Recipe key heads.draft_vocab_size={recipe.heads.draft_vocab_size} is larger than the "
                          f"base's vocabulary ({vocab_size} tokens, {recipe.base}): use at most {vocab_size}, or 0 for "
                          "all of it.")
    if recipe.loss.kl_topk > (recipe.heads.draft_vocab_size or vocab_size):
        raise RecipeError(f"Recipe key loss.kl_topk={recipe.loss.kl_topk} is larger than the draft vocabulary (the "
                          f"base's {vocab_size} tokens, heads.draft_vocab_size: 0) the teacher's top-K is taken over: "
                          f"use at most {vocab_size}, or 0 for the full KL.")
    from ..heads import HeadConfig, build_heads

    config = HeadConfig(family=recipe.heads.family, num_heads=recipe.heads.num_heads,
                        num_layers=recipe.heads.num_layers, hidden_size=hidden_size, vocab_size=vocab_size,
                        draft_vocab_size=recipe.heads.draft_vocab_size, extra=dict(recipe.heads.extra),
                        feature_layers=list(feature_layers or []))
    try:
        with torch.device("meta"):
            build_heads(config)
    except (ValueError, TypeError) as err:
        raise RecipeError(f"Recipe key heads.extra does not fit the base ({recipe.base}: hidden size {hidden_size}): "
                          f"{one_line(str(err))}") from None


def check_final_dir(recipe: Recipe) -> None:
    """The final checkpoint's folder may be written: absent, empty or a checkpoint of ours, so a
    folder of the user's is refused now and not after the whole run."""
    from ..core.atomic import choose_destination

    final = Path(recipe.run.final_dir or Path(recipe.run.output_dir) / "final")
    key = "run.final_dir" if recipe.run.final_dir else "run.output_dir (its final/ folder)"
    try:
        choose_destination(final)
    except DraftheadsError as err:
        raise RecipeError(f"Recipe key {key}: {err}") from None
