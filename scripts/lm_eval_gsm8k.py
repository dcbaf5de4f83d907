"""lm-evaluation-harness with the heads, as its users run it: GSM8K (zero-shot, greedy) on the
committed local problems (``draftheads/data/gsm8k_test_sample.jsonl`` through the task
``draftheads/data/gsm8k_sample.yaml``, ``dataset_path: json`` — no Hub access) through lm-eval's
own HF model class, plain and with ``gen_kwargs={"custom_generate": draftheads.custom_generate(heads)}``
on the same model object. Reports both scores, whether every generation is identical, and the
wall-time ratio (plain seconds / seconds with the heads; ``--rounds 2`` runs plain, heads, heads,
plain and sums each side, so a drift of the machine's speed falls on both).

    python scripts/lm_eval_gsm8k.py --limit 30 --out results/lm_eval
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import yaml

import draftheads
from draftheads.decoding.base.loading import load_base
from draftheads.prompts import DATA_DIR

REPO = Path(__file__).resolve().parents[1]
TASK_FILE = DATA_DIR / "gsm8k_sample.yaml"


def task_config(task_file: Path, problems: str | None, max_gen_toks: int | None) -> dict:
    """The committed task YAML as lm-eval's task dict: ``data_files`` resolved against the YAML's
    folder (or ``problems``), and the generation length if given."""
    config = yaml.safe_load(task_file.read_text(encoding="utf-8"))
    files = config["dataset_kwargs"]["data_files"]
    files["test"] = str(Path(problems).resolve() if problems else (task_file.parent / files["test"]).resolve())
    if not Path(files["test"]).is_file():
        raise SystemExit(f"error: {files['test']} not found (--problems: a GSM8K JSON-lines file)")
    if max_gen_toks:
        config["generation_kwargs"]["max_gen_toks"] = max_gen_toks
    return config


def evaluate(lm, config: dict, limit: int | None, gen_kwargs: dict | None) -> tuple[dict, list[str], float]:
    """One lm-eval run: the task's metrics, each problem's generation, wall seconds."""
    from lm_eval import simple_evaluate

    started = time.perf_counter()
    out = simple_evaluate(model=lm, tasks=[config], limit=limit, gen_kwargs=gen_kwargs, log_samples=True)
    seconds = time.perf_counter() - started
    name = config["task"]
    samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
    metrics = {k: v for k, v in out["results"][name].items() if isinstance(v, (int, float)) and k != "samples"}
    return metrics, [s["resps"][0][0] for s in samples], seconds


def run(heads: str, limit: int | None, dtype: str, rounds: int = 1, problems: str | None = None,
        max_gen_toks: int | None = None, base_name: str | None = None, model=None) -> dict:
    """Plain and heads on the same model object through lm-eval's HFLM; ``model``: a ``(base,
    tokenizer)`` pair already loaded (tests), else the embedded base in ``dtype``."""
    from lm_eval.models.huggingface import HFLM

    config = task_config(TASK_FILE, problems, max_gen_toks)
    base, tokenizer = model if model is not None else load_base(base_name, dtype=dtype)
    lm = HFLM(pretrained=base, tokenizer=tokenizer, batch_size=1)
    fn = draftheads.custom_generate(heads)
    warm = tokenizer("Question: 1 + 1?\nAnswer:", return_tensors="pt").to(base.device)
    base.generate(**warm, max_new_tokens=4, do_sample=False)  # both paths warm (first calls allocate)
    base.generate(**warm, max_new_tokens=4, do_sample=False, custom_generate=fn)  # heads bound, step priced
    order = ["plain", "heads", "heads", "plain"] if rounds >= 2 else ["plain", "heads"]
    seconds = {"plain": 0.0, "heads": 0.0}
    results = {}
    for name in order:
        metrics, texts, spent = evaluate(lm, config, limit, {"custom_generate": fn} if name == "heads" else None)
        seconds[name] += spent
        if name in results and results[name][1] != texts:
            raise RuntimeError(f"{name}: a second run generated other text than the first (greedy should not)")
        results[name] = (metrics, texts)
    (plain, plain_texts), (fast, fast_texts) = results["plain"], results["heads"]
    same = [a == b for a, b in zip(plain_texts, fast_texts)]
    first_different = next((i for i, s in enumerate(same) if not s), None)
    return {
        "task": config["task"], "task_file": str(TASK_FILE.relative_to(REPO)) if TASK_FILE.is_relative_to(REPO)
        else str(TASK_FILE), "problems_file": config["dataset_kwargs"]["data_files"]["test"],
        "problems": len(plain_texts), "identical_generations": sum(same), "identical_score": plain == fast,
        "first_different": None if first_different is None else
        {"doc": first_different, "plain": plain_texts[first_different], "heads": fast_texts[first_different]},
        "plain": plain, "draftheads": fast,
        "plain_seconds": round(seconds["plain"], 2), "draftheads_seconds": round(seconds["heads"], 2),
        "time_ratio": round(seconds["plain"] / seconds["heads"], 3), "runs_per_side": order.count("plain"),
        "order": order, "heads": heads, "dtype": str(base.dtype).removeprefix("torch."),
        "max_gen_toks": config["generation_kwargs"]["max_gen_toks"], "generations": {"plain": plain_texts,
                                                                                   "draftheads": fast_texts},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", default=None, help="GSM8K JSON-lines file (question, answer); default: the "
                                                         "task's committed sample, draftheads/data/gsm8k_test_sample.jsonl")
    parser.add_argument("--heads", default=str(REPO / "checkpoints" / "smollm2-135m-hydra"))
    parser.add_argument("--base", default=None, help="base model (default: the embedded SmolLM2)")
    parser.add_argument("--limit", type=int, default=30, help="problems to run (the sample holds 50)")
    parser.add_argument("--max-gen-toks", type=int, default=None, help="default: the task's (256)")
    parser.add_argument("--dtype", default="float32", help="float32 (default: identical generations) or auto, bfloat16")
    parser.add_argument("--rounds", type=int, choices=(1, 2), default=2,
                        help="2 (default): plain, heads, heads, plain, each side summed; 1: plain then heads")
    parser.add_argument("--note", default=None, help="a remark stored in the JSON (e.g. 'machine under load')")
    parser.add_argument("--out", default="results/lm_eval")
    args = parser.parse_args(argv)
    report = run(args.heads, args.limit, args.dtype, args.rounds, args.problems, args.max_gen_toks, args.base)
    report["heads"] = str(Path(report["heads"]).resolve().relative_to(REPO)) \
        if Path(report["heads"]).resolve().is_relative_to(REPO) else report["heads"]
    report["problems_file"] = str(Path(report["problems_file"]).relative_to(REPO)) \
        if Path(report["problems_file"]).is_relative_to(REPO) else report["problems_file"]
    report["environment"] = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                             "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
                             "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                             "lm_eval": __import__("lm_eval").__version__ if hasattr(__import__("lm_eval"), "__version__")
                             else "?", "note": args.note}
    report["command"] = shlex.join(["python", "scripts/lm_eval_gsm8k.py", *(sys.argv[1:] if argv is None else argv)])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    summary = {k: v for k, v in report.items() if k not in ("generations", "first_different")}
    print(json.dumps(summary, indent=1, default=str))
    return 0 if report["identical_generations"] == report["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
