"""Does draftheads decode on this device as the base does? A check for GPU users (and for us
where a GPU is lent): tiny random Llama bases built on ``--device`` (no download), random
Hydra heads, and for each dtype, drafting and batch shape, draftheads' greedy ``generate``
against transformers' own on the same prompts; sampling runs too (seeded, lossless).

    python scripts/device_check.py --device cuda --out results/device_check

float64 must be token-identical, float32 identical or parted at a near-tie; bfloat16 may part
where the base's top two logits lie within its rounding (docs/usage.md: the same output per dtype). The JSON
lists each case: prompts, identical rows, first divergences with their top-1/top-2 gaps in
ulps, τ and seconds. Exit status 1 when a float64 case differs or anything raises.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftheads.bench import batch_divergences
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.decoding.request import left_pad
from draftheads.heads import HeadConfig, build_heads

#: the drafting configurations checked: the heads alone, and the heads merged with context lookups
DRAFTS = ("heads", "heads,context")
TREE = [[0], [1], [0, 0], [0, 0, 0], [2]]
VOCAB, PAD, EOS = 96, 0, 2


def tiny_base(device: str, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer random Llama (grouped-query attention, tied embeddings) on ``device``."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.generation_config.pad_token_id = PAD
    return model


def random_heads(base, seed: int = 0):
    """Random Hydra heads bound to ``base``: their drafts are mostly wrong, the context's often right."""
    cfg = base.config
    heads = build_heads(HeadConfig(family="hydra", num_heads=3, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                   base_fingerprint=fingerprint(base).to_dict()))
    torch.manual_seed(seed)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    heads = heads.to(device=base.device, dtype=base.dtype)
    return heads.bind(base.lm_head.weight, base.get_input_embeddings().weight)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths, some repeating a pattern (so context lookups get accepted)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = 4 + 7 * i % 29
        body = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        out.append(body * 3 if i % 2 else body)
    return out


def hf_greedy(base, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    return base.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=PAD)


def same_width(reference: torch.Tensor, ours: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both batches padded after their answers to one width (a batch's rows end at EOS or the budget)."""
    width = max(reference.shape[1], ours.shape[1])
    return tuple(torch.nn.functional.pad(x, (0, width - x.shape[1]), value=PAD) for x in (reference, ours))


def check_case(model: DraftHeadsModel, batch: list[list[int]], new: int) -> dict:
    """One batch through HF greedy and draftheads greedy; each row's divergence, τ, seconds."""
    ids, mask = left_pad(batch, PAD)
    ids, mask = ids.to(model.base.device), mask.to(model.base.device)
    reference = hf_greedy(model.base, ids, mask, new)
    started = time.perf_counter()
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=PAD)
    seconds = time.perf_counter() - started
    divergences = batch_divergences(model.base, *same_width(reference, ours), mask)
    return {"batch": len(batch), "identical": len(batch) - len(divergences), "divergences": divergences,
            "tau": round(model.last_stats.tau, 3), "seconds": round(seconds, 3)}


def check_sampling(model: DraftHeadsModel, batch: list[list[int]], new: int) -> dict:
    """Sampling runs end to end on the device (its distribution is the suite's χ² tests' business)."""
    ids, mask = left_pad(batch, PAD)
    generator = torch.Generator(device=model.base.device).manual_seed(0)
    out = model.generate(ids.to(model.base.device), attention_mask=mask.to(model.base.device), max_new_tokens=new,
                         do_sample=True, temperature=0.8, generator=generator, pad_token_id=PAD)
    return {"batch": len(batch), "shape": list(out.shape), "tau": round(model.last_stats.tau, 3)}


def run(device: str, dtypes: list[str], new: int) -> dict:
    results: dict = {"device": device, "torch": torch.__version__, "cases": []}
    if device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name(torch.device(device))
    for name in dtypes:
        dtype = getattr(torch, name)
        base = tiny_base(device, dtype)
        model = DraftHeadsModel(base, random_heads(base), tree=tree_from_paths([tuple(p) for p in TREE]))
        for drafts in DRAFTS:
            model.use_sources(drafts)
            for shape, batch in (("bs1", None), ("bs4", prompts(4, seed=1)), ("bs8", prompts(8, seed=2))):
                case = {"dtype": name, "drafts": drafts, "shape": shape}
                try:
                    if batch is None:  # one prompt at a time
                        each = [check_case(model, [p], new) for p in prompts(6)]
                        case.update(batch=1, prompts=len(each), identical=sum(c["identical"] for c in each),
                                    divergences=[d for c in each for d in c["divergences"]],
                                    tau=round(sum(c["tau"] for c in each) / len(each), 3),
                                    seconds=round(sum(c["seconds"] for c in each), 3))
                    else:
                        case.update(prompts=len(batch), **check_case(model, batch, new))
                except Exception as error:  # noqa: BLE001 - a device check reports every failure
                    case["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
                    case["traceback"] = traceback.format_exc()
                results["cases"].append(case)
                print(json.dumps({k: v for k, v in case.items() if k != "traceback"}), flush=True)
        try:
            results["cases"].append({"dtype": name, "drafts": "heads,context", "sampling": check_sampling(
                model, prompts(4, seed=3), new)})
        except Exception as error:  # noqa: BLE001
            results["cases"].append({"dtype": name, "sampling": "failed", "error": repr(error),
                                     "traceback": traceback.format_exc()})
        print(json.dumps(results["cases"][-1])[:400], flush=True)
    return results


def failed(results: dict) -> list[dict]:
    """Cases that broke: anything that raised, and any float64 divergence (float64 is exact)."""
    return [c for c in results["cases"] if "error" in c or (c.get("dtype") == "float64" and c.get("divergences"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default="float64,float32,bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", default="results/device_check")
    args = parser.parse_args(argv)
    results = run(args.device, args.dtypes.split(","), args.max_new_tokens)
    bad = failed(results)
    results["failed"] = len(bad)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"{len(results['cases'])} cases on {results.get('gpu', args.device)}, {len(bad)} failed; {out / 'device_check.json'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
