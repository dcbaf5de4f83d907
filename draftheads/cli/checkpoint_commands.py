"""``draftheads`` commands for checkpoints that travel: ``export`` (to vLLM), ``import-medusa``
(FasterDecoding Medusa checkpoints), ``card`` (regenerate a model card from recorded figures)
and ``push`` (upload to the Hub). Registered on the main parser by :func:`add_commands`."""
from __future__ import annotations

import datetime
import json
import shutil
import sys
from pathlib import Path

import torch

from ..core.errors import CheckpointError, DraftheadsError, InputError, one_line
from ..decoding.base.dtypes import parse_dtype
from ..core.atomic import link_or_copy, write_text_atomic

#: the dtypes export and import-medusa write (``--save-dtype keep``: each tensor keeps its own)
WRITE_DTYPES = ("float32", "bfloat16", "float16")


def write_dtype(name: str, option: str) -> torch.dtype | None:
    """A ``--dtype``/``--save-dtype`` value as a torch dtype (the package's one parser), ``keep`` → None."""
    return None if name == "keep" else parse_dtype(name, option)


def load_base_model(name: str | None):
    """The frozen base alone (no tokenizer: these commands only need its LM head and fingerprint);
    a base the decoder cannot verify a tree on (no attention layers) is refused before it loads."""
    from transformers import AutoModelForCausalLM

    from ..decoding.base.loading import check_base_architecture, resolve_base

    path, _ = resolve_base(name)
    check_base_architecture(path, name if name is not None else path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)


def base_label(name: str | None) -> str:
    from ..decoding.base.loading import EMBEDDED_NAME

    return name or EMBEDDED_NAME


def cmd_export(args) -> int:
    from ..decoding.base.fingerprint import fingerprint
    from ..heads import load_heads
    from ..core.atomic import FolderNotOursError, beside_candidates, check_output_dir, choose_destination
    from ..heads.checkpoint.io import check_heads_base
    from ..heads.checkpoint.vllm_export import EAGLE3_TARGETS, check_exportable, export_heads

    try:
        heads = load_heads(args.checkpoint)
    except ValueError as err:  # a config.json the family's constructor refuses (EAGLE-3 without feature_layers)
        if isinstance(err, DraftheadsError):
            raise
        raise CheckpointError(f"{args.checkpoint}/config.json: {one_line(str(err))}") from None
    try:
        if args.to == CUSTOM_GENERATE:
            return export_custom_generate(heads, args.out, args.source, args.beside)
        if args.to in EAGLE3_TARGETS:
            return export_eagle3_command(heads, args)
        check_exportable(heads, args.to, args.share_lm_head)  # refuse before loading a base
        check_output_dir(args.out, heads.checkpoint_dir)
        choose_destination(args.out, beside=args.beside)  # someone else's folder: refused before a base loads
        lm_head = None
        if not heads.config.owns_lm_head:
            base = load_base_model(args.base)
            check_heads_base(heads.config, fingerprint(base).to_dict(), base_label(args.base), args.checkpoint)
            lm_head = base.get_output_embeddings().weight
        out = export_heads(heads, args.to, args.out, lm_head, args.share_lm_head, write_dtype(args.dtype, "--dtype"),
                           beside=args.beside)
    except FolderNotOursError as err:
        raise FolderNotOursError(f"{str(err).removesuffix('.')}, or pass --beside to write "
                                 f"{next(beside_candidates(err.target))} next to it.", err.target) from None
    print(f"wrote {out} ({args.to}); serve with vLLM as a Medusa speculator of {heads.config.base_name}", file=sys.stderr)
    return 0


def export_eagle3_command(heads, args) -> int:
    """``export --to speculators | specforge``: EAGLE-3 heads with the base's config, LM-head rows
    and embeddings; every refusal before the base loads where it can, and before anything is written."""
    from ..decoding.base.fingerprint import fingerprint
    from ..core.atomic import check_output_dir, choose_destination
    from ..heads.checkpoint.eagle3_export import check_eagle3_exportable, export_eagle3
    from ..heads.checkpoint.io import check_heads_base

    check_eagle3_exportable(heads, args.to)
    if args.share_lm_head:
        raise InputError(f"--share-lm-head is vllm-medusa's: --to {args.to} always carries the draft vocabulary's "
                         "LM-head rows; drop it.")
    check_output_dir(args.out, heads.checkpoint_dir)
    choose_destination(args.out, beside=args.beside)  # someone else's folder: refused before a base loads
    base = load_base_model(args.base)
    check_heads_base(heads.config, fingerprint(base).to_dict(), base_label(args.base), args.checkpoint)
    out = export_eagle3(heads, args.to, base, args.out, write_dtype(args.dtype, "--dtype"), beside=args.beside)
    how = (f"vLLM: LLM({str(base.name_or_path)!r}, speculative_config={{'model': {str(out)!r}, 'method': 'eagle3', "
           f"'num_speculative_tokens': {heads.num_heads}}})" if args.to == "speculators" else
           f"SGLang: --speculative-algorithm EAGLE3 --speculative-draft-model-path {out}")
    print(f"wrote {out} ({args.to}); serve with {how}", file=sys.stderr)
    return 0


#: ``export --to custom-generate``: the checkpoint with transformers' custom_generate/ folder
CUSTOM_GENERATE = "custom-generate"


def export_custom_generate(heads, out: str, source: str | None, beside: bool = False) -> int:
    """A copy of the head checkpoint with ``custom_generate/generate.py`` in it, so plain
    transformers code decodes with the heads (``custom_generate=<folder or repo>,
    trust_remote_code=True``). ``source``: where that code finds the heads — the Hub repo id the
    folder will be pushed to, else the folder's own absolute path. Written whole, never over a
    folder of someone else's (``beside``: next to it instead; :class:`~draftheads.core.atomic.atomic_directory`)."""
    from ..custom_generate import check_source, write_custom_generate
    from ..core.atomic import atomic_directory, check_links, check_output_dir

    check_output_dir(out, heads.checkpoint_dir)
    check_links(heads.checkpoint_dir, skip=("custom_generate",))  # before anything is written
    if source is not None:
        check_source(source)
    writer = atomic_directory(out, beside=beside)
    with writer as staging:
        shutil.copytree(heads.checkpoint_dir, staging, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("custom_generate"))
        write_custom_generate(staging, source or str(writer.target))
    print(f"wrote {writer.target}: model.generate(..., custom_generate={source or str(writer.target)!r}, "
          "trust_remote_code=True) decodes with these heads", file=sys.stderr)
    return 0


def cmd_import_medusa(args) -> int:
    from ..decoding.base.fingerprint import fingerprint
    from ..core.atomic import check_output_dir
    from ..heads.checkpoint.hub import resolve_checkpoint
    from ..heads.checkpoint.medusa_import import import_medusa
    from ..tree_fit import prompt_records

    source = resolve_checkpoint(args.source, revision=args.revision)
    check_output_dir(args.out, source)  # before a base loads: never over the checkpoint being read
    records = prompt_records(args.trees_from, args.limit) if args.trees_from else None  # a bad file fails now
    if args.trees_from:
        from ..decoding.base.loading import load_base

        base, tokenizer = load_base(args.base)
    else:
        base = load_base_model(args.base)
    heads = import_medusa(source, fingerprint(base).to_dict(), base_label(args.base),
                          base_revision=getattr(base.config, "_commit_hash", None))
    if records is not None:
        fit_imported_trees(heads, base, tokenizer, records, args)
    heads.save_pretrained(args.out, dtype=write_dtype(args.save_dtype, "--save-dtype"))
    print(f"wrote {args.out}: {heads.num_heads} Medusa heads ({heads.config.num_layers} layer(s), "
          f"{'own' if heads.config.owns_lm_head else 'shared'} LM head)", file=sys.stderr)
    return 0


def fit_imported_trees(heads, base, tokenizer, prompts: list[dict], args) -> None:
    """Trees + expected τ from the heads' ranks on the base's greedy answers to ``--trees-from``."""
    from ..head_scoring import answer_features, base_answers
    from ..tree_fit import fit_trees

    records = base_answers(base, tokenizer, prompts, args.max_new_tokens)
    taus = fit_trees(heads, base, answer_features(base, tokenizer, records),
                     source=f"{args.trees_from} (first {args.limit} prompts, {args.max_new_tokens} tokens)")
    print(f"fitted trees, expected τ per node budget: {taus}", file=sys.stderr)


def record_cited(checkpoint: Path, key: str, entry: dict, flag: str) -> None:
    """Point the checkpoint's training report at results its card cites: ``measured`` (a benchmark's
    results JSON, with its command and date) or ``served`` (``scripts/engine_check.py``'s JSON,
    which carries its own)."""
    from ..heads.head_config import read_json_object

    path = checkpoint / "training_report.json"
    report = read_json_object(path, "a training report", f"{flag} needs a trained checkpoint's training report "
                                                         "(written by `draftheads train`).")
    report[key] = entry
    write_text_atomic(path, json.dumps(report, indent=2) + "\n")


def cmd_card(args) -> int:
    from ..heads.checkpoint.card import card_for_checkpoint
    from ..heads.head_config import CARD_NAME

    checkpoint = Path(args.checkpoint)
    if args.results:
        if not args.command_line:
            raise InputError("--results needs --command, the exact command that wrote the results.")
        record_cited(checkpoint, "measured", {"results": args.results, "command": args.command_line,
                                              "date": args.date or datetime.date.today().isoformat()}, "--results")
    if args.served:
        record_cited(checkpoint, "served", {"results": args.served}, "--served")
    card = card_for_checkpoint(checkpoint, name=args.name, root=args.root)
    target = checkpoint / CARD_NAME
    if args.check:
        same = target.is_file() and target.read_text() == card
        print(f"{target}: {'up to date' if same else 'differs from the generated card'}", file=sys.stderr)
        return 0 if same else 1
    write_text_atomic(target, card)
    print(f"wrote {target}", file=sys.stderr)
    return 0


def cmd_push(args) -> int:
    """Upload the checkpoint with ``custom_generate/`` written for the repo id, so that plain
    transformers code runs the pushed heads (``custom_generate="<repo>", trust_remote_code=True``).
    The folder is staged (files linked where the filesystem allows, else copied): the local
    checkpoint is left as it is, and a ``custom_generate/`` already in it is replaced."""
    import tempfile

    from ..core.atomic import check_links
    from ..custom_generate import FOLDER, write_custom_generate
    from ..heads.checkpoint.hub import check_checkpoint_folder, check_repo_id, upload_checkpoint

    source = Path(args.checkpoint)
    check_checkpoint_folder(source)  # before staging anything: the same checks the upload makes
    check_links(source, skip=(FOLDER,))
    check_repo_id(args.repo_id)
    with tempfile.TemporaryDirectory(prefix="draftheads-push-") as tmp:
        staged = Path(tmp) / source.name
        shutil.copytree(source, staged, ignore=shutil.ignore_patterns(FOLDER), copy_function=link_or_copy)
        write_custom_generate(staged, args.repo_id)
        url = upload_checkpoint(staged, args.repo_id, private=args.private or None, revision=args.revision)
    print(url)
    print(f"plain transformers code runs these heads: model.generate(..., custom_generate={args.repo_id!r}, "
          "trust_remote_code=True)", file=sys.stderr)
    return 0


def add_commands(sub) -> None:
    """Add ``export``, ``import-medusa``, ``card`` and ``push`` to the ``draftheads`` parser."""
    from ..heads.checkpoint.vllm_export import TARGETS

    export = sub.add_parser("export", help="write a head checkpoint in a serving engine's format (vLLM Medusa; "
                                           "EAGLE-3 as speculators or SpecForge) or with transformers' "
                                           "custom_generate/ folder")
    export.add_argument("--to", required=True, choices=(*TARGETS, CUSTOM_GENERATE), help="target format")
    export.add_argument("--source", default=None, help="custom-generate: where the written code finds the heads "
                                                       "(the Hub repo id you will push to; default: the output folder)")
    export.add_argument("checkpoint", help="draftheads head checkpoint folder or Hub id")
    export.add_argument("out", help="folder to write")
    export.add_argument("--base", default=None, help="the base the heads were made for (default: embedded SmolLM2); "
                                                      "its LM head is written into the export")
    export.add_argument("--share-lm-head", action="store_true",
                        help="vllm-medusa: one LM head for every head (vLLM's original_lm_head) — what heads reading "
                             "out through the base's LM head always get; refused for heads owning their projections")
    export.add_argument("--dtype", choices=WRITE_DTYPES, default="bfloat16")
    export.add_argument("--beside", action="store_true",
                        help="if OUT exists and holds files draftheads did not write, write OUT-draftheads next to it "
                             "(default: refuse; such a folder is never replaced or emptied)")
    export.set_defaults(func=cmd_export)
    imp = sub.add_parser("import-medusa", help="convert a FasterDecoding Medusa checkpoint into draftheads heads")
    imp.add_argument("source", help="folder or Hub id with config.json + medusa_lm_head.{safetensors,pt}")
    imp.add_argument("out", help="draftheads checkpoint folder to write")
    imp.add_argument("--base", default=None, help="the base the Medusa heads were trained for")
    imp.add_argument("--revision", default=None, help="Hub revision of the source")
    imp.add_argument("--save-dtype", choices=[*WRITE_DTYPES, "keep"], default="keep")
    imp.add_argument("--trees-from", default=None, help="prompt file (JSON lines, like bench's): fit stored trees and "
                                                        "expected τ on the base's answers, for tree=<budget>/adaptive")
    imp.add_argument("--limit", type=int, default=20, help="prompts of --trees-from to use")
    imp.add_argument("--max-new-tokens", type=int, default=128, help="answer length for --trees-from")
    imp.set_defaults(func=cmd_import_medusa)
    card = sub.add_parser("card", help="regenerate a checkpoint's README.md model card from its recorded figures")
    card.add_argument("checkpoint")
    card.add_argument("--name", default=None, help="how the usage snippet names the checkpoint (Hub id or path)")
    card.add_argument("--root", default=".", help="folder the recorded results paths are relative to")
    card.add_argument("--results", default=None, help="record this benchmark results JSON as the measured figures")
    card.add_argument("--command", dest="command_line", default=None, help="the exact command that wrote --results")
    card.add_argument("--date", default=None, help="when --results was measured (default: today)")
    card.add_argument("--served", default=None, help="record this scripts/engine_check.py JSON (the heads run in a "
                                                     "serving engine) for the card to cite")
    card.add_argument("--check", action="store_true", help="only compare; exit 1 if README.md is out of date")
    card.set_defaults(func=cmd_card)
    push = sub.add_parser("push", help="upload a checkpoint folder to the Hugging Face Hub, with custom_generate/ "
                                       "written for the repo (transformers' custom_generate=<repo>)")
    push.add_argument("checkpoint")
    push.add_argument("repo_id")
    push.add_argument("--private", action="store_true")
    push.add_argument("--revision", default=None, help="branch to commit to")
    push.set_defaults(func=cmd_push)

