"""The self-distillation job: the base answers the training prompts with draftheads' own batched
greedy decoder, keeping the hidden states its forwards compute as the training features, in
shards that resume after a stop (format: :mod:`.distill_shards`).

    python -m draftheads.training.data.distill_job --out /data/selfdistill-smollm2      # run or resume
    python -m draftheads.training.data.distill_job --out DIR --export recipes/data/selfdistill-smollm2
    python -m draftheads.training.data.distill_job --from-tokens recipes/data/selfdistill-smollm2 --out DIR
    python -m draftheads.training.data.distill_job --from-tokens recipes/data/selfdistill-smollm2 --out DIR --layers 8 22

Prompts: every prompt file given (records with ``prompt``, or conversations whose first user
turn is taken), a text asked twice answered once; the sources are interleaved by their relative
position so every prefix of shards is a proportional sample (a data-scaling table takes prefixes).
Answers already made elsewhere (``--answers``: records with ``id``, ``prompt``, ``response_ids``)
are reused and get their features from one plain forward; ``--from-tokens`` does that for a whole
committed set of token ids, so a clone rebuilds the features with one command. ``--layers 8 22``
(``--from-tokens`` only) keeps, from the same forward, the states after those decoder layers beside
the final one (``layers.npy``), for heads that read them (``heads.feature_layers``); ``default`` names
the base's default pair (:func:`draftheads.heads.fusion.default_feature_layers`).

Every shard it writes also keeps the base's own choice after every token (``predicted.npy``: the
argmax of its LM head over the final states the forwards computed, no second forward), what
training labels prompt positions with (``data.prompt_positions``); ``--from-tokens ... --predicted``
rebuilds the shards made before that (a rebuild otherwise keeps a good shard as it is).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...decoding.base.loading import dtype_name, load_base
from ...decoding.base.fingerprint import fingerprint
from ...decoding.generate import DraftHeadsModel
from ...decoding.request import eos_token_ids
from ...core.atomic import write_text_atomic
from ...core.errors import DraftheadsError
from .config_cli import parse_config, run_cli
from .records import DataError
from .distill_prompts import Prompt, attach_answers, interleave, read_prompts
from .distill_capture import answer_with_states, base_predictions, forward_states
from .distill_shards import Shard, ShardError, discard, load_token_ids, manifest_for, open_shard, save_token_ids
from .distill_shards import shard_problem, write_shard
from .job_checks import INDEX, PLAN, check_discardable, check_entries, check_export, check_options, check_out
from .job_checks import check_vocabulary, job_layers, read_index
from ..features import chat_prompt_ids



@dataclass
class DistillJobConfig:
    """What the job answers and how; ``prompts``, ``max_new_tokens`` and ``shard_size`` fix the
    plan (a resume with others is refused), the rest may change between resumes."""

    out: str = ""
    prompts: list[str] = field(default_factory=list)  # prompt files (records with id + prompt, or messages)
    answers: list[str] = field(default_factory=list)  # answers made before (id + response_ids), reused as given
    from_tokens: str = ""  # a folder of committed token ids: rebuild their features, answer nothing
    export: str = ""  # write the finished shards' token ids here (the committed form) and stop
    heads: str = "checkpoints/smollm2-135m-hydra"
    base: str | None = None
    dtype: str = "bfloat16"
    tree: str = "adaptive"  # the batch-size-adaptive policy: the stored tree is chosen for bs 1
    sources: str = "auto"
    max_new_tokens: int = 384
    shard_size: int = 64
    batch_size: int = 32
    forward_tokens: int = 8192  # padded tokens per plain forward (features of given answers)
    shards: int = 0  # stop once this many shards exist (0: all)
    start_at: int = 0  # build shards from this index first, then the earlier ones (e.g. the decoded ones before the reused)
    seconds: int = 0  # > 0: a time budget from the start; no shard (group) is begun that would end past it
    device: str = "cpu"
    # --from-tokens: the base layers whose states the shards keep beside the final one (numbers, or
    # default); a shard without one of them is rebuilt, one holding more is kept
    layers: list[str] = field(default_factory=list)
    # --from-tokens: rebuild the shards that lack the base's predictions (predicted.npy: made before them);
    # every shard written holds them either way
    predicted: bool = False


def digest(items) -> str:
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def make_plan(config: DistillJobConfig) -> tuple[dict, list[Prompt]]:
    if not config.prompts:
        raise DataError("the job needs --prompts FILE [FILE ...] (e.g. the training prompts and conversations) and, "
                        "to reuse answers made before, --answers FILE; recipes/data/selfdistill-smollm2/README.md "
                        "has the command.")
    prompts = interleave([read_prompts(p) for p in config.prompts])
    reused = attach_answers(prompts, config.answers)
    key = digest([[p.id, p.text] for p in prompts] + [config.max_new_tokens, config.shard_size])
    plan = {"plan_key": key, "prompts": len(prompts), "reused_answers": reused,
            "shards": -(-len(prompts) // config.shard_size), "shard_size": config.shard_size,
            "max_new_tokens": config.max_new_tokens, "prompt_files": [Path(p).name for p in config.prompts],
            "answer_files": [Path(p).name for p in config.answers]}
    return plan, prompts


def check_plan(out: Path, plan: dict) -> None:
    """Write ``plan.json`` on the first run; a resume with another plan is refused (one line)."""
    path = out / PLAN
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("plan_key") != plan["plan_key"]:
            raise DataError(f"{path} is a job with other prompts or settings (plan {saved.get('plan_key')}, this run "
                            f"{plan['plan_key']}); use another --out, or delete {out} to start over.")
        return
    write_text_atomic(path, json.dumps(plan, indent=1) + "\n")


class Job:
    """The base, loaded once; the decoder, built on the first shard that needs answers."""

    def __init__(self, config: DistillJobConfig):
        self.config = config
        self.base, self.tokenizer = load_base(config.base, dtype=config.dtype, device=config.device)
        self.fingerprint = fingerprint(self.base).to_dict()
        self.dtype = dtype_name(self.base.dtype)
        self.decoder = None
        pad = self.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.tokenizer.eos_token_id
        self.eos = set(eos_token_ids(self.base.generation_config))
        self.layers = job_layers(config.layers, int(self.base.config.get_text_config().num_hidden_layers))

    def expected(self, plan_key: str, ids: list[str]) -> dict:
        return {"plan_key": plan_key, "prompt_key": digest(ids), "base_fingerprint": self.fingerprint,
                "dtype": self.dtype, "feature_dtype": "float16", **({"layers": self.layers} if self.layers else {}),
                **({"predicted": True} if self.config.predicted else {})}

    def answerer(self):
        if self.decoder is None:
            c = self.config
            self.decoder = DraftHeadsModel.from_pretrained(c.heads, base=self.base, tokenizer=self.tokenizer,
                                                           tree=c.tree, sources=c.sources)
        return self.decoder

    def build(self, prompts: list[Prompt]) -> tuple[list[Shard], dict]:
        """Answer (or take) each prompt and collect its states: one shard per ``shard_size``
        prompts, in prompt order (several shards decode together when the batch is larger)."""
        encoded = [chat_prompt_ids(self.tokenizer, p.text) for p in prompts]
        answers: list[list[int] | None] = [p.answer for p in prompts]
        states: list[torch.Tensor | None] = [None] * len(prompts)
        todo = sorted((i for i, a in enumerate(answers) if a is None), key=lambda i: len(encoded[i]))
        steps = accepted = 0
        for start in range(0, len(todo), self.config.batch_size):
            batch = todo[start: start + self.config.batch_size]
            decoder = self.answerer()
            for i, done in zip(batch, answer_with_states(decoder, [encoded[i] for i in batch],
                                                         self.config.max_new_tokens, self.pad)):
                answers[i], states[i] = done.answer, done.states
            steps += len(decoder.last_stats.accepted)
            accepted += sum(decoder.last_stats.accepted)
        given = [i for i, s in enumerate(states) if s is None]
        for i, s in zip(given, forward_states(self.base, [encoded[i] + answers[i] for i in given],
                                              self.config.forward_tokens)):
            states[i] = s
        shards = []
        size = self.config.shard_size
        for first in range(0, len(prompts), size):
            part = range(first, min(len(prompts), first + size))
            hidden = [states[i].to(torch.float32).numpy() for i in part]
            shard = Shard.from_sequences([prompts[i].id for i in part], [encoded[i] for i in part],
                                         [answers[i] for i in part], self.eos, hidden)
            shard.predicted = base_predictions(self.base, [states[i] for i in part])
            if not np.isfinite(shard.hidden).all():
                raise ShardError("a hidden state overflows float16; store this base's features in another dtype.")
            shards.append(shard)
        made = {"decoded": len(todo), "given": len(given), "tau": round((accepted + steps) / steps, 3) if steps else None}
        return shards, made


def out_of_time(started: float, budget: int, next_takes: float) -> bool:
    """With a budget (``--seconds``): whether the next unit of work, expected to take as long as
    the last one, would end past it. What is stopped before is never begun, so every shard
    written stays whole; a resume continues from there."""
    if budget <= 0 or time.perf_counter() - started + next_takes <= budget:
        return False
    print(json.dumps({"stopped": "seconds", "budget": budget, "time": time.strftime("%H:%M:%S")}), flush=True)
    return True


def needs_building(folder: Path, expected: dict) -> bool:
    """A shard folder that is missing, or holds another shard than ``expected`` (truncated, another
    base or dtype: named in one line and discarded), is built; a good one is kept, never redone."""
    if not folder.exists():
        return True
    problem = shard_problem(folder, expected)
    if problem is None:
        return False
    check_discardable(folder, problem)
    print(f"{folder}: {problem}; rebuilding it.", flush=True)
    discard(folder)
    return True


def run(config: DistillJobConfig) -> int:
    """Build every missing or bad shard, in order; ``batch_size`` larger than ``shard_size``
    decodes that many shards' prompts together (a GPU's batch of 256: four shards at a time)."""
    begun, last = time.perf_counter(), 0.0
    out = Path(config.out)
    check_options(config)
    check_out(out)
    plan, prompts = make_plan(config)
    check_plan(out, plan)
    job = Job(config)
    remove_leftovers(out)
    total = plan["shards"] if not config.shards else min(plan["shards"], config.shards)
    todo = []
    for index in range(total):
        folder = out / "shards" / f"shard-{index:05d}"
        expected = job.expected(plan["plan_key"], [p.id for p in shard_prompts(prompts, index, config)])
        if needs_building(folder, expected):
            todo.append((index, folder, expected))
    todo.sort(key=lambda item: item[0] < config.start_at)  # stable: in order from start_at, then the rest
    together = max(1, config.batch_size // config.shard_size)
    for first in range(0, len(todo), together):
        if out_of_time(begun, config.seconds, last):
            break
        group = todo[first: first + together]
        started, cpu = time.perf_counter(), time.process_time()
        shards, made = job.build([p for index, *_ in group for p in shard_prompts(prompts, index, config)])
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu  # cpu: all threads' seconds
        last = seconds
        for (index, folder, expected), shard in zip(group, shards):
            write_shard(folder, shard, manifest_for(shard, index, expected, {
                "sources": sorted({p.source.split(":")[0] for p in shard_prompts(prompts, index, config)}),
                "sequence_sources": [p.source for p in shard_prompts(prompts, index, config)],
                "seconds": round(seconds / len(group), 1), "max_new_tokens": config.max_new_tokens, **made}))
        answer_tokens = sum(s.answer_tokens for s in shards)
        print(json.dumps({"shards": [g[0] for g in group], "of": plan["shards"], **made,
                          "sequences": sum(len(s) for s in shards), "answer_tokens": answer_tokens,
                          "tokens": sum(int(s.offsets[-1]) for s in shards), "seconds": round(seconds, 1),
                          "cpu_seconds": round(cpu, 1), "answer_positions_per_s": round(answer_tokens / seconds, 1),
                          "time": time.strftime("%H:%M:%S")}), flush=True)
    return 0


def remove_leftovers(out: Path) -> None:
    """The staging folders a killed run left (a shard being written when the process died)."""
    for staging in (out / "shards").glob(".shard-[0-9]*.tmp-*"):
        shutil.rmtree(staging, ignore_errors=True)


def shard_prompts(prompts: list[Prompt], index: int, config: DistillJobConfig) -> list[Prompt]:
    return prompts[index * config.shard_size: (index + 1) * config.shard_size]


def open_job(out: str | Path, fingerprint: dict, dtype: str, layers: list[int] | tuple[int, ...] = (),
             predicted: bool = False) -> list[Shard]:
    """What training reads: every shard of a job, checked against the job's plan and the base it
    trains for (fingerprint, the dtype the features were computed in) and memory-mapped; a bad
    one is one :class:`ShardError` naming it and the command that rebuilds it. ``layers``: the
    base layers whose states each shard must hold beside the final one (:func:`rebuild_command`);
    ``predicted``: each shard must hold the base's predictions (``predicted.npy``)."""
    out = Path(out)
    try:
        plan = json.loads((out / PLAN).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ShardError(f"{out / PLAN} cannot be read ({err}); run the self-distillation job with --out {out}.") from None
    expected = {"plan_key": plan.get("plan_key"), "base_fingerprint": fingerprint, "dtype": dtype,
                "feature_dtype": "float16", **({"layers": list(layers)} if layers else {}),
                **({"predicted": True} if predicted else {})}
    rebuild = rebuild_command(out, layers, predicted)
    return [open_shard(folder, expected, rebuild) for folder in sorted((out / "shards").glob("shard-[0-9]*"))]


def rebuild_command(out: Path, layers: list[int] | tuple[int, ...] = (), predicted: bool = False) -> str:
    """The command that rebuilds a job's bad shards: the job itself, or, for the states of base
    layers or the base's predictions (which a shard made before them lacks, and only a rebuild
    from token ids adds), ``--from-tokens`` with ``--layers`` / ``--predicted``."""
    if not layers and not predicted:
        return f"python -m draftheads.training.data.distill_job --out {out}"
    return (f"python -m draftheads.training.data.distill_job --from-tokens <the job's token ids, as --export wrote "
            f"them> --out {out}" + (" --predicted" if predicted else "")
            + (f" --layers {' '.join(map(str, layers))}" if layers else ""))


def finished_shards(out: Path, with_hidden: bool = False) -> list[tuple[int, Path]]:
    """The shard folders of a job (index, folder), in order, whose manifest and arrays read whole."""
    found = []
    for folder in sorted((out / "shards").glob("shard-[0-9][0-9][0-9][0-9][0-9]")):
        manifest = json.loads((folder / "manifest.json").read_text()) if (folder / "manifest.json").is_file() else {}
        if manifest and shard_problem(folder, {}, with_hidden) is None:
            found.append((int(manifest["shard"]), folder))
    return found


def export(out: Path, target: Path) -> int:
    """The finished shards' token ids in the committed form: ``shard-NNNNN.npz`` + ``index.json``.

    Shards committed in ``target`` for the same plan and absent from ``out`` are kept (read back whole
    first): a clone that resumes without the earlier shards' features adds to them, drops none."""
    check_export(out, target)
    plan = json.loads((out / PLAN).read_text(encoding="utf-8"))
    entries = {entry["shard"]: entry for entry in committed_entries(target, plan)}
    for number, folder in finished_shards(out):
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        shard = open_shard(folder, {}, "", with_hidden=False)
        save_token_ids(target / f"shard-{number:05d}.npz", shard)
        entries[number] = {k: manifest[k] for k in ("shard", "ids", "sequences", "tokens", "answer_tokens",
                                                    "prompt_key", "dtype", "base_fingerprint")}
    index = {"plan": plan, "shards": [entries[number] for number in sorted(entries)]}
    write_text_atomic(target / INDEX, json.dumps(index) + "\n")
    print(f"{len(index['shards'])} shards' token ids in {target}")
    return 0


def committed_entries(target: Path, plan: dict) -> list[dict]:
    """The index entries already in ``target`` (none without an index), each shard file checked; another
    plan's index is refused: its shards would sit beside this plan's under one index."""
    index = read_index(target) if (target / INDEX).is_file() else {"plan": plan, "shards": []}
    if (kept := index["plan"]["plan_key"]) != plan["plan_key"]:
        raise ShardError(f"{target / INDEX} holds another plan's shards (plan_key {kept}); export to an empty "
                         "folder or remove that one first.")
    for entry in index["shards"]:
        load_token_ids(target / f"shard-{entry['shard']:05d}.npz", entry["ids"])
    return index["shards"]


def rebuild(config: DistillJobConfig) -> int:
    """Features for committed token ids, by a plain forward: shards as the job writes them."""
    begun, last, source, out = time.perf_counter(), 0.0, Path(config.from_tokens), Path(config.out)
    check_options(config)
    check_out(out)
    index = read_index(source)
    committed = {entry["shard"]: (source / f"shard-{entry['shard']:05d}.npz", load_token_ids(
        source / f"shard-{entry['shard']:05d}.npz", entry["ids"])) for entry in check_entries(source, index)}
    job = Job(config)  # every input checked (the ids against the base's vocabulary) before a file is written
    check_vocabulary(committed, job.base.get_output_embeddings().weight.shape[0])
    check_plan(out, index["plan"])
    for entry in index["shards"][: config.shards or None]:  # --shards N: the first N (every prefix is a sample)
        number, ids = entry["shard"], entry["ids"]
        folder = out / "shards" / f"shard-{number:05d}"
        expected = job.expected(index["plan"]["plan_key"], ids)
        if not needs_building(folder, expected):
            continue
        if out_of_time(begun, config.seconds, last):
            break
        started = time.perf_counter()
        given = committed[number][1]
        sequences = [given.sequence(k).astype(np.int64).tolist() for k in range(len(given))]
        forwarded = forward_states(job.base, sequences, config.forward_tokens, job.layers)
        width = job.base.config.get_text_config().hidden_size
        given.predicted = base_predictions(job.base, [s[:, :width] for s in forwarded])  # the final states' argmax
        states = np.concatenate([s.to(torch.float32).numpy() for s in forwarded])
        del forwarded
        given.hidden, given.layers = states[:, :width].astype(np.float16), states[:, width:].astype(np.float16)
        given.feature_layers = list(job.layers)
        if not job.layers:
            given.layers = None
        elif not np.isfinite(given.layers).all():
            raise ShardError(f"--layers {' '.join(map(str, job.layers))}: a state of these layers overflows float16 "
                             "(this base's residual stream is too large there); pass other layers.")
        write_shard(folder, given, manifest_for(given, number, expected, {  # seconds: what scaling tables count
            "given": len(given), "decoded": 0, "seconds": round(time.perf_counter() - started, 1)}))
        last = time.perf_counter() - started
        print(f"shard {number}: {len(given)} sequences, {given.answer_tokens} answer tokens", flush=True)
    return 0


def parse_args(argv: list[str] | None = None) -> DistillJobConfig:
    return parse_config(DistillJobConfig, argv, "python -m draftheads.training.data.distill_job", __doc__, required=("out",))


def dispatch(config: DistillJobConfig) -> int:
    if config.export:
        return export(Path(config.out), Path(config.export))
    return rebuild(config) if config.from_tokens else run(config)


def main(argv: list[str] | None = None) -> int:
    return run_cli(dispatch, parse_args(argv), (DraftheadsError,))


if __name__ == "__main__":
    raise SystemExit(main())
