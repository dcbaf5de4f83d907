"""HF greedy generate on the A/B's prompts (ab.py's), float32; prints one JSON line of timings."""
import json

import torch

from ab import timed_run
from draftheads import load_base

if __name__ == "__main__":
    torch.set_num_threads(2)
    base, tokenizer = load_base(None, dtype="float32")

    def generate(ids):
        out = base.generate(ids, max_new_tokens=128, do_sample=False)
        return out, {"steps": int(out.shape[1] - ids.shape[1])}

    print("RESULT", json.dumps({"load_s": 0, **timed_run(generate, tokenizer)}))
