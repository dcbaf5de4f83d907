"""lm-evaluation-harness with the heads, as its users run it: GSM8K (zero-shot, greedy, local
JSON-lines problems — no Hub access) through lm-eval's own HF model class, once plain and once
with ``gen_kwargs={"custom_generate": draftheads.custom_generate(heads)}``. Reports both scores,
whether every generation is identical, and the wall-time ratio.

    python scripts/lm_eval_gsm8k.py --problems ../shared/data/gsm8k_test.jsonl --limit 30 \
        --out results/lm_eval_gsm8k
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import draftheads
from draftheads.decoding.base import load_base

TASK = """task: draftheads_gsm8k
dataset_path: json
dataset_kwargs:
  data_files:
    test: {problems}
output_type: generate_until
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
generation_kwargs:
  until: ["Question:", "</s>", "<|im_end|>"]
  do_sample: false
  max_gen_toks: {max_gen_toks}
filter_list:
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
"""


def evaluate(lm, task_dir: Path, limit: int, gen_kwargs: dict | None) -> tuple[dict, list[str], float]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    out = simple_evaluate(model=lm, tasks=["draftheads_gsm8k"], limit=limit, gen_kwargs=gen_kwargs,
                          task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    seconds = time.perf_counter() - started
    samples = [s["resps"][0][0] for s in out["samples"]["draftheads_gsm8k"]]
    return out["results"]["draftheads_gsm8k"], samples, seconds


def main(argv: list[str] | None = None) -> int:
    from lm_eval.models.huggingface import HFLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", required=True, help="GSM8K JSON-lines file (question, answer)")
    parser.add_argument("--heads", default=str(Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-hydra"))
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--max-gen-toks", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="results/lm_eval_gsm8k")
    args = parser.parse_args(argv)
    base, tokenizer = load_base(dtype=args.dtype)
    lm = HFLM(pretrained=base, tokenizer=tokenizer, batch_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "draftheads_gsm8k.yaml").write_text(
            TASK.format(problems=str(Path(args.problems).resolve()), max_gen_toks=args.max_gen_toks))
        fn = draftheads.custom_generate(args.heads)
        warm = tokenizer("Question: 1 + 1?\nAnswer:", return_tensors="pt")
        base.generate(**warm, max_new_tokens=4, do_sample=False)
        base.generate(**warm, max_new_tokens=4, do_sample=False, custom_generate=fn)  # heads bound, step priced
        plain, plain_texts, plain_s = evaluate(lm, Path(tmp), args.limit, None)
        fast, fast_texts, fast_s = evaluate(lm, Path(tmp), args.limit, {"custom_generate": fn})
    same = sum(a == b for a, b in zip(plain_texts, fast_texts))
    report = {"problems": len(plain_texts), "identical_generations": same, "plain": plain, "draftheads": fast,
              "plain_seconds": round(plain_s, 1), "draftheads_seconds": round(fast_s, 1),
              "speedup": round(plain_s / fast_s, 3), "dtype": args.dtype, "torch_threads": torch.get_num_threads(),
              "command": " ".join(sys.argv)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
