"""One version's draftheads on the A/B's prompts, float32; prints one JSON line of timings.
Run once per version and repeat, interleaved (run.sh); hf.py times HF generate on the same prompts."""
import json
import sys
import time

import torch

from draftheads import DraftHeadsModel
from draftheads.prompts import chat_input, read_prompts


def ab_prompts() -> list[str]:
    """The prompts the recorded run decoded: MT-Bench's first of each category (8), then the first
    five of them again (13 decodes in all; both versions and HF ran the same list)."""
    first = [r["prompt"] for r in read_prompts("mt-bench@1")]
    return first + first[:5]


def timed_run(generate, tokenizer) -> dict:
    """{per: [{s, new, stats}], total_s, new, tok_s} over :func:`ab_prompts`; ``generate(ids)`` →
    (output ids, a stats dict)."""
    per = []
    for prompt in ab_prompts():
        ids = chat_input(tokenizer, prompt)
        start = time.perf_counter()
        out, stats = generate(ids)
        per.append({"s": time.perf_counter() - start, "new": int(out.shape[1] - ids.shape[1]), "stats": stats})
    total, new = sum(x["s"] for x in per), sum(x["new"] for x in per)
    return {"per": per, "total_s": total, "new": new, "tok_s": new / total}


def main(heads: str, tree: str) -> None:
    torch.set_num_threads(2)
    start = time.perf_counter()
    model = DraftHeadsModel.from_pretrained(heads, dtype="float32", tree=None if tree == "default" else int(tree))
    load = time.perf_counter() - start

    def generate(ids):
        out = model.generate(ids, max_new_tokens=128)
        return out, {k: v for k, v in model.last_stats.to_dict().items() if isinstance(v, (int, float, str))}

    print("RESULT", json.dumps({"load_s": load, **timed_run(generate, model.tokenizer)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
