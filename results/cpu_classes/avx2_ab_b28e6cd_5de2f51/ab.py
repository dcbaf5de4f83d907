"""One version's draftheads on N dev prompts, fp32; prints JSON of timings (run per version, interleaved)."""
import json, sys, time, torch
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]  # the repository root (prompts read from there)
from draftheads import DraftHeadsModel
heads, tree, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(2)
t0 = time.perf_counter()
m = DraftHeadsModel.from_pretrained(heads, dtype="float32", tree=None if tree == "default" else int(tree))
load = time.perf_counter() - t0
prompts = []
for f in ["mt_bench.jsonl", "spec_bench_dev.jsonl"]:
    rows = [json.loads(l) for l in open(ROOT / "draftheads" / "data" / f)]
    seen = set()
    for r in rows:
        c = r.get("category")
        if c in seen: continue
        seen.add(c); prompts.append(r["turns"][0])
prompts = prompts[:n]
out = {"load_s": load, "per": []}
tree_nodes = None
for p in prompts:
    ids = m.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
    t = time.perf_counter(); o = m.generate(ids, max_new_tokens=128); dt = time.perf_counter() - t
    s = m.last_stats.to_dict()
    out["per"].append({"s": dt, "new": int(o.shape[1] - ids.shape[1]), "stats": {k: v for k, v in s.items() if isinstance(v, (int, float, str))}})
tot = sum(x["s"] for x in out["per"]); new = sum(x["new"] for x in out["per"])
out["total_s"] = tot; out["new"] = new; out["tok_s"] = new / tot
print("RESULT", json.dumps(out))
