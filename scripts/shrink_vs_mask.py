#!/usr/bin/env python3
"""Shrink vs mask finished rows: 8 MT-Bench prompts, rows stop at their first '.' (EOS = [<|im_end|>, '.'])
so they finish at different steps; fixed 4-node tree; modes alternated, 2 rounds."""
import json, time, torch
from draftheads.decoding import DraftHeadsModel
from draftheads.prompts import chat_input, read_prompts
from draftheads.bench import left_pad
from draftheads.decoding.output import generated_counts
m = DraftHeadsModel.from_pretrained("checkpoints/smollm2-135m-medusa", tree=4)
tok = m.tokenizer
dot = tok.convert_tokens_to_ids(".")
prompts = read_prompts("mt-bench", 8)
ids, mask = left_pad([chat_input(tok, p["prompt"])[0].tolist() for p in prompts], 2)
eos = [2, dot]
res = {"shrink": [], "mask": []}
outs = {}
m.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, pad_token_id=2)
for rnd in range(2):
    for mode in ("shrink", "mask"):
        variant = m.with_decoding(finished_rows=mode)
        t = time.perf_counter()
        out = variant.generate(ids, attention_mask=mask, max_new_tokens=48, pad_token_id=2, eos_token_id=eos)
        dt = time.perf_counter() - t
        n = sum(generated_counts(out, ids.shape[1], set(eos)))
        res[mode].append({"seconds": round(dt, 3), "new_tokens": n, "tokens_per_second": round(n / dt, 3),
                          "steps": variant.last_stats.steps, "rows_per_step": variant.last_stats.batch_sizes})
        outs[mode] = out.tolist()
        print(mode, res[mode][-1]["tokens_per_second"], res[mode][-1]["steps"], flush=True)
ref = m.base.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=2, eos_token_id=eos)
res["identical_to_hf"] = {k: v == ref.tolist() for k, v in outs.items()}
res["finish_step_per_row"] = generated_counts(ref, ids.shape[1], set(eos))
json.dump(res, open("results/batch/adaptive_fp32/shrink_vs_mask.json", "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k not in ("shrink", "mask")}))
