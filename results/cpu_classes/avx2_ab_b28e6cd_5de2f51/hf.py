import json, sys, time, torch
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]  # the repository root (prompts read from there)
from draftheads import load_base
n = int(sys.argv[1]); torch.set_num_threads(2)
base, tok = load_base(None, dtype="float32")
prompts = []
for f in ["mt_bench.jsonl", "spec_bench_dev.jsonl"]:
    seen = set()
    for r in (json.loads(l) for l in open(ROOT / "draftheads" / "data" / f)):
        if r.get("category") in seen: continue
        seen.add(r.get("category")); prompts.append(r["turns"][0])
out = {"load_s": 0, "per": []}
for p in prompts[:n]:
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    t = time.perf_counter(); o = base.generate(ids, max_new_tokens=128, do_sample=False); dt = time.perf_counter() - t
    out["per"].append({"s": dt, "new": int(o.shape[1] - ids.shape[1]), "stats": {"steps": int(o.shape[1] - ids.shape[1]), "drafting_ms_per_step": 0, "mean_tree_nodes": 1, "prefill_seconds": 0}})
tot = sum(x["s"] for x in out["per"]); new = sum(x["new"] for x in out["per"])
out.update(total_s=tot, new=new, tok_s=new / tot); print("RESULT", json.dumps(out))
