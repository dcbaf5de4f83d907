"""The self-distillation job's shards (:mod:`.distill_job`) as training positions.

The job already kept the base's final hidden state after every token (the prefill's over the
prompt, the verification forwards' over the answer), so training reads them where they lie:
no feature pass, and the (P, d) states stay memory-mapped (:class:`MappedRows` gathers a
batch's rows on demand) — a run over millions of positions holds their token ids in RAM, not
their states.

Heads that read base layers beside the final state (``heads.feature_layers``) read their states
from ``layers.npy``, where a rebuild from token ids kept them (``distill_job --from-tokens ...
--layers``; a shard without one is refused by name), mapped the same way.

Rows follow :mod:`draftheads.training.features`: row t holds h_t, the text tokens x_{t+1..t+MAX_TARGETS}
(``targets``) and the base's own choice for each (``teacher``: on self-distilled text the text
itself). Per-position families read the answer's rows (t = prompt length − 1 .. L − 2). A
family whose layer reads the context (Hydra++ with ``prefix_context: sequence``) reads whole
sequences: the prompt's rows come first with every target −1 (they feed the layer, they are
never a label), and ``Features.sequences`` marks where each sequence's rows start and end.

With ``data.prompt_positions`` every position trains (:func:`labelled_sequence_rows`): the
prompt's rows t = 0 .. prompt length − 2 join the answer's, labelled with the base's own choices
(``predicted.npy``, which a rebuild from token ids keeps: the text there is the user's, not the
base's distribution); the answer's rows keep their labels. The held-out and evaluation tables
stay the answer's (what decoding drafts).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .distill_shards import Shard
from ..features import (MAX_TARGETS, Features, layer_columns, layers_problem, layers_text, shift_targets,
                        shift_teacher)


class MappedRows:
    """(P, d) float16 rows gathered from memory-mapped shard arrays: ``rows[index]`` → tensor
    of ``index.shape + (d,)``; row r is ``arrays[shard[r]][local[r]]`` (its ``columns[shard[r]]``
    only, where ``columns`` gives a shard's: the layers a run reads of those a shard holds)."""

    def __init__(self, arrays: list[np.ndarray], shard: np.ndarray, local: np.ndarray,
                 columns: list[np.ndarray | None] | None = None):
        self.arrays, self.shard, self.local = arrays, shard.astype(np.int32), local.astype(np.int64)
        self.columns = columns or [None] * len(arrays)
        width = (len(self.columns[0]) if self.columns[0] is not None else int(arrays[0].shape[1])) if arrays else 0
        self.shape = torch.Size((len(self.local), width))
        self.dtype = torch.float16

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, slice):
            index = torch.arange(*index.indices(len(self)))
        index = torch.as_tensor(index, dtype=torch.long)
        flat = index.reshape(-1).numpy()
        shard, local = self.shard[flat], self.local[flat]
        out = np.empty((len(flat), self.shape[1]), np.float16)
        for s in np.unique(shard):
            pick = shard == s
            rows = self.arrays[s][local[pick]]
            out[pick] = rows if self.columns[s] is None else rows[:, self.columns[s]]
        return torch.from_numpy(out).reshape(*index.shape, self.shape[1])


def sequence_rows(shard: Shard, k: int, with_prompt: bool) -> tuple[np.ndarray, torch.Tensor]:
    """Sequence ``k`` of ``shard``: its rows' indices into the shard's arrays and their targets
    (R, MAX_TARGETS), −1 where no label exists (past the end; the prompt's own rows)."""
    first, end = int(shard.offsets[k]), int(shard.offsets[k + 1])
    start = int(shard.answer_starts[k])
    tokens = torch.from_numpy(shard.tokens[first:end].astype(np.int64))
    targets = shift_targets(tokens, start)  # rows start-1 .. L-2
    lead = start - 1 if with_prompt else 0
    if lead:
        targets = torch.cat([torch.full((lead, MAX_TARGETS), -1, dtype=targets.dtype), targets])
    rows = np.arange(first + (0 if with_prompt else start - 1), end - 1)
    return rows, targets


def labelled_sequence_rows(shard: Shard, k: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Sequence ``k`` of ``shard`` with every row labelled (``data.prompt_positions``): its rows'
    indices t = 0 .. L − 2 into the shard's arrays, their text targets (R, MAX_TARGETS) as
    :func:`~draftheads.training.features.shift_targets` lays them out, and the base's own choices
    lined up the same way (:func:`~draftheads.training.features.shift_teacher`): after a prompt
    token its prediction there (``predicted.npy``: argmax of its LM head after the text up to
    that token), after an answer token the answer itself (the base's own greedy choice, as the
    answer's rows are labelled without prompt positions). −1 past the end."""
    if shard.predicted is None:
        raise ValueError("prompt positions need shards opened with the base's predictions: "
                         "open_job(..., predicted=True).")
    first, end = int(shard.offsets[k]), int(shard.offsets[k + 1])
    start = max(int(shard.answer_starts[k]), 1)
    tokens = torch.from_numpy(shard.tokens[first:end].astype(np.int64))
    predicted = torch.from_numpy(np.asarray(shard.predicted[first: first + start - 1], dtype=np.int64))
    choices = torch.cat([predicted, tokens[start:], torch.tensor([-1])])  # the choice after each token 0 .. L-1
    return np.arange(first, end - 1), shift_targets(tokens, 1), shift_teacher(choices)


def answer_rows(shards: list[Shard], sequences: list[tuple[int, int]]) -> torch.Tensor:
    """Which rows of ``job_table(shards, sequences=sequences, prompt_labels=True)`` are the
    answers' (bool (P,)): each sequence's rows from its prompt length − 1 on."""
    parts = []
    for s, k in sequences:
        length = int(shards[s].offsets[k + 1] - shards[s].offsets[k])
        if length >= 2:
            parts.append(torch.arange(length - 1) >= max(int(shards[s].answer_starts[k]), 1) - 1)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def job_table(shards: list[Shard], with_prompt: bool = False, sequences: list[tuple[int, int]] | None = None,
              layers: list[int] | tuple[int, ...] = (), prompt_labels: bool = False) -> Features:
    """The positions of ``shards`` (every sequence, or the (shard, k) pairs of ``sequences``)
    as one :class:`Features` table, states mapped; ``with_prompt``: whole sequences, prompt rows
    unlabelled, bounds in ``Features.sequences`` (S, 2); ``layers``: the states of those base
    layers too (``Features.layers``, mapped; each shard holds them: :func:`.distill_job.open_job`);
    ``prompt_labels``: whole sequences, prompt rows labelled with the base's own predictions
    (:func:`labelled_sequence_rows`; each shard holds them)."""
    pairs = sequences if sequences is not None else [(s, k) for s, shard in enumerate(shards) for k in range(len(shard))]
    shard_of, local, targets, choices, bounds, following, count = [], [], [], [], [], [], 0
    for s, k in pairs:
        if shards[s].hidden is None:
            raise ValueError("job_table needs shards opened with their hidden states.")
        if prompt_labels:
            rows, labels, chosen = labelled_sequence_rows(shards[s], k)
        else:
            (rows, labels), chosen = sequence_rows(shards[s], k, with_prompt), None
        if len(rows) < 1:
            continue
        shard_of.append(np.full(len(rows), s))
        local.append(rows)
        following.append(shards[s].tokens[rows + 1].astype(np.int64))  # row t's next text token (t < L − 1)
        targets.append(labels)
        choices.append(chosen)
        bounds.append((count, count + len(rows)))
        count += len(rows)
    if not targets:
        raise ValueError("the job's shards hold no answer of two tokens or more to train on.")
    shard_of, local = np.concatenate(shard_of), np.concatenate(local)
    hidden = MappedRows([shard.hidden for shard in shards], shard_of, local)
    table = torch.cat(targets)
    teacher = torch.cat(choices) if prompt_labels else table  # answer rows only: the text is the base's choice
    return Features(hidden, table, teacher, torch.tensor(bounds, dtype=torch.long) if with_prompt else None,
                    mapped_layers(shards, shard_of, local, layers),
                    torch.from_numpy(np.concatenate(following)) if with_prompt else None)


def mapped_layers(shards: list[Shard], shard_of: np.ndarray, local: np.ndarray, layers) -> MappedRows | None:
    """The states of ``layers`` at the table's rows, mapped (None for none): a shard that lacks
    one is refused by name, never read as the final state only."""
    if not layers:
        return None
    columns = []
    for shard in shards:
        width = int(shard.hidden.shape[1])
        picked = layer_columns(shard.feature_layers, layers, width) if shard.layers is not None else None
        if picked is None:
            raise ValueError(f"a shard holds {layers_text(shard.feature_layers)}, but the heads read "
                             f"{layers_text(layers)}: open the job with open_job(..., layers={list(layers)}).")
        columns.append(None if picked == list(range(shard.layers.shape[1])) else np.array(picked, np.int64))
    return MappedRows([shard.layers for shard in shards], shard_of, local, columns)


def split_sequences(shards: list[Shard], held_out: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, held-out) (shard, k) pairs: the last ``held_out`` sequences are held out."""
    pairs = [(s, k) for s, shard in enumerate(shards) for k in range(len(shard))]
    if held_out >= len(pairs):
        raise ValueError(f"the job holds {len(pairs)} sequences, not more than data.eval_examples={held_out}; "
                         "lower data.eval_examples or let the job answer more prompts.")
    return pairs[: len(pairs) - held_out], pairs[len(pairs) - held_out:]


def sequence_sources(folder: Path, count: int) -> list[str]:
    """Each sequence's prompt source as the job's manifest records it (``sequence_sources``),
    else the shard's one source, else ``"?"``."""
    import json

    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    sources = manifest.get("sequence_sources")
    if isinstance(sources, list) and len(sources) == count:
        return [str(s) for s in sources]
    shard_sources = manifest.get("sources") or ["?"]
    return [str(shard_sources[0]) if len(shard_sources) == 1 else "?"] * count


def reads_prompt(recipe) -> bool:
    """Whether the recipe's heads read whole sequences, prompt included (Hydra++'s
    ``prefix_context: sequence``; EAGLE-3, whose layer pairs every position with the token after
    it): their tables then carry the prompt's rows."""
    from ...heads import REGISTRY

    family = REGISTRY.get(recipe.heads.family)
    return recipe.heads.extra.get("prefix_context") == "sequence" or getattr(family, "reads_next_tokens", False)


def check_job_folder(path: Path) -> None:
    """A recipe's job folder exists and is a job's (its plan), checked before the base loads."""
    from .records import DataError
    from .distill_job import PLAN

    if not (path / PLAN).is_file():
        raise DataError(f"Recipe key data.path: {path} is not a self-distillation job's folder (no {PLAN}); make it "
                        f"with python -m draftheads.training.data.distill_job --out {path} --prompts FILE [FILE ...] "
                        "(recipes/data/selfdistill-smollm2/README.md), or use data.kind selfdistill for answer files.")


def check_job_layers(path: Path, layers: list[int] | tuple[int, ...]) -> None:
    """Every shard of the job folder ``path`` holds the states of ``layers`` (its manifest says
    so), checked before the base loads: one line naming the first that does not and the command
    that rebuilds it (a manifest that cannot be read is named when the job opens)."""
    import json

    from .distill_job import rebuild_command
    from .distill_shards import MANIFEST, ShardError

    if not layers:
        return
    for folder in sorted((path / "shards").glob("shard-[0-9]*")):
        try:
            recorded = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("layers", [])
        except (OSError, ValueError, AttributeError):
            continue
        problem = layers_problem(recorded if isinstance(recorded, list) else [], layers)
        if problem:
            raise ShardError(f"{folder}: {problem}; rebuild it: `{rebuild_command(path, layers)}` (it rebuilds every "
                             "bad shard), or drop heads.feature_layers.")


def check_job_predicted(path: Path, layers: list[int] | tuple[int, ...] = ()) -> None:
    """Every shard of the job folder ``path`` holds the base's predictions (``predicted.npy``, its
    manifest says so), as ``data.prompt_positions`` needs, checked before the base loads: one line
    naming the first that does not and the command that rebuilds it (with the ``layers`` the heads
    read, so the rebuilt shards keep them)."""
    import json

    from .distill_job import rebuild_command
    from .distill_shards import MANIFEST, PREDICTED_TEXT, ShardError

    for folder in sorted((path / "shards").glob("shard-[0-9]*")):
        try:
            predicted = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("predicted", False)
        except (OSError, ValueError, AttributeError):
            continue  # named when the job opens
        if predicted is not True:
            raise ShardError(f"{folder}: it holds no predicted.npy ({PREDICTED_TEXT}: data.prompt_positions); rebuild "
                             f"it: `{rebuild_command(path, layers, predicted=True)}` (it rebuilds every shard without "
                             "them), or set data.prompt_positions: false.")


def job_batches(recipe, paths: list[Path], fingerprint: dict, dtype: str, chunking: int | None,
                layers: list[int] | tuple[int, ...] = ()):
    """Training batches, held-out table and draft-vocabulary label ids from job folders: the
    last ``data.eval_examples`` sequences are held out; whole sequences (prompt rows unlabelled) when the heads' context layer
    reads the prompt (``heads.extra.prefix_context: sequence``). ``data.limit`` > 0 keeps a
    seeded random N of the training sequences (``train.seed``), in job order: a job's shards are
    not a uniform mixture (the answers it reused come first), so a smaller data set is a sample
    of the same mixture, as a data-scaling table needs. ``layers``: the base layers the heads read
    beside the final state (every shard must hold their states). ``data.prompt_positions``: the
    training sequences' prompt rows are labelled too (:func:`labelled_sequence_rows`; every shard
    must hold the base's predictions), the held-out table and the draft vocabulary's counts stay
    the answers'."""
    from ..batches import FeatureBatches
    from .distill_job import open_job

    k = recipe.heads.num_heads
    with_prompt = reads_prompt(recipe)
    every = recipe.data.prompt_positions
    shards = [shard for path in paths for shard in open_job(path, fingerprint, dtype, layers, every)]
    train, held_out = split_sequences(shards, recipe.data.eval_examples)
    if 0 < recipe.data.limit < len(train):
        keep = torch.randperm(len(train), generator=torch.Generator().manual_seed(recipe.train.seed))[: recipe.data.limit]
        train = [train[i] for i in keep.sort().values.tolist()]
    prompts = torch.from_numpy(np.concatenate([shards[s].tokens[shards[s].offsets[q]: shards[s].offsets[q]
                                                                 + shards[s].answer_starts[q]] for s, q in train]
                                               ).astype(np.int64))
    batches = FeatureBatches(job_table(shards, with_prompt, train, layers, every), k, chunking, prompts)
    answers = answer_rows(shards, train) if every else None
    labelled = int((batches.table.targets[:, 0] >= 0).sum()) if answers is None else int(answers.sum())
    summary = {"jobs": [str(p) for p in paths], "shards": len(shards), "sequences": len(train),
               "held_out_sequences": len(held_out), "share": round(len(train) / sum(len(shard) for shard in shards), 6),
               "answer_positions": labelled, "rows": len(batches.table),
               **({"prompt_positions": len(batches.table) - labelled} if every else {})}
    check_same_data(Path(recipe.run.output_dir), summary)
    write_data_summary(Path(recipe.run.output_dir), summary)
    label_ids = batches.table.teacher[:, 1: k + 1] if answers is None else batches.table.teacher[answers, 1: k + 1]
    return batches, job_table(shards, with_prompt, held_out, layers), label_ids


DATA_SUMMARY = "data.json"


def check_same_data(output_dir: Path, summary: dict) -> None:
    """A run that has checkpoints resumes only onto the data it started on: a job folder that
    grew (or shrank) since would change the data order under it, so it is one line, not a
    silently different run."""
    from .records import DataError

    before = read_data_summary(output_dir)
    if before is None or not any((output_dir / "checkpoints").glob("step-*")):
        return  # missing or unreadable: nothing to compare with, the new summary replaces it
    changed = [f"{k} {before.get(k)} → {summary[k]}" for k in ("shards", "sequences", "answer_positions")
               if before.get(k) != summary[k]]
    if changed:
        raise DataError(f"Cannot resume {output_dir}: its data changed since the run started ({', '.join(changed)}); "
                        "set data.limit to the sequences it started on, or use another run.output_dir "
                        "(or run.resume=never to start over there).")


def read_data_summary(output_dir: Path) -> dict | None:
    """What a run wrote it trained on (:func:`write_data_summary`), or None where it wrote none or
    the file is unreadable."""
    import json

    try:
        summary = json.loads((output_dir / DATA_SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def write_data_summary(output_dir: Path, summary: dict) -> None:
    """What a run trained on (``output_dir/data.json``): the job folders, shards, sequences and
    answer positions, and the share of the job's sequences it used (what a scaling table reads)."""
    import json

    from ...core.atomic import atomic_file

    output_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(output_dir / DATA_SUMMARY) as tmp:
        tmp.write_text(json.dumps(summary, indent=1) + "\n")


def job_eval_table(path: Path, fingerprint: dict, dtype: str, with_prompt: bool,
                   layers: list[int] | tuple[int, ...] = ()) -> tuple[Features, dict[str, torch.Tensor]]:
    """An evaluation job (e.g. the base's answers to MT-Bench and Spec-Bench dev) as a table and
    its groups, {each sequence's source: indices of its labelled rows} (scores count labelled
    rows only, in table order: :func:`~draftheads.training.evaluation.rank_table`), with the
    states of the base ``layers`` the heads read."""
    from .distill_job import open_job

    shards = open_job(path, fingerprint, dtype, layers)
    folders = sorted((path / "shards").glob("shard-[0-9]*"))
    sources = [src for folder, shard in zip(folders, shards) for src in sequence_sources(folder, len(shard))]
    table = job_table(shards, with_prompt, layers=layers)
    counts = [int(s.offsets[k + 1] - s.offsets[k] - s.answer_starts[k]) for s in shards for k in range(len(s))]
    starts = np.cumsum([0] + counts)
    groups: dict[str, list[torch.Tensor]] = {}
    for source, start, count in zip(sources, starts, counts):
        groups.setdefault(source, []).append(torch.arange(int(start), int(start) + count))
    return table, {source: torch.cat(rows) for source, rows in groups.items()}
