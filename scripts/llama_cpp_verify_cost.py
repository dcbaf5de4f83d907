"""What a verification step would cost on llama.cpp: the lever issue 65 names (the base's tree
verified by llama.cpp's batch API instead of torch).

llama.cpp decodes a batch of n tokens in one ``llama_decode``; a draft tree of n nodes is the same
products and the same attention work as a chain of n tokens (only the mask differs: per-token
sequence ids), so the chain's time is the tree's. Measured here, on the base's GGUF re-typed to the
dtype (as ``draftheads bench --peers llama.cpp`` decodes it), after a prompt of ``--context``
tokens: ms of one ``llama_decode`` of n tokens with logits for all n (what verification reads),
n = 1 (llama.cpp's plain decoding step) and the tree sizes the default verifies. Beside it, torch's:
draftheads' verification forward (the calibration's timed forward: verify + LM head + argmax) over the
same n rows at the same context. Each system runs alone in its own process (their thread pools spin
and slow each other in one), the systems alternating ``--rounds`` times, the node counts interleaved
within each; medians. Results: JSON + PNG.

    python scripts/llama_cpp_verify_cost.py --dtype bfloat16 --out results/profile/llama_cpp_verify
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def llama_decoder(gguf: Path, threads: int, context: int):
    """A function n → ms of one llama_decode of n tokens (logits for each) after ``context`` tokens."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512,
                logits_all=True, verbose=False)
    prompt = [(17 * i + 3) % 1000 + 100 for i in range(context)]
    llm.reset()
    llm.eval(prompt)

    def once(n: int) -> float:
        llm._ctx.kv_cache_seq_rm(-1, context, -1)  # back to the prompt: every step sees the same cache
        llm._batch.set_batch(batch=prompt[:n], n_past=context, logits_all=True)
        start = time.perf_counter()
        llm._ctx.decode(llm._batch)
        return (time.perf_counter() - start) * 1000

    return once


def measure(system: str, dtype: str, nodes: list[int], context: int, reps: int) -> dict:
    """{n: [ms, ...]} of one system, alone in this process (llama.cpp's and torch's thread pools
    spin after a call: interleaved in one process each slows the other several-fold)."""
    from draftheads.bench.peer_gguf import typed_gguf
    from draftheads.bench.peers import source_gguf
    from draftheads.decoding import DraftHeadsModel
    from draftheads.decoding.calibration import forward_timer

    # the shipped heads' base, prepared as decoding prepares it (packed products, the direct forward)
    model = DraftHeadsModel.from_pretrained(REPO / "checkpoints" / "smollm2-135m-hydra", dtype=dtype)
    model.generate(model.tokenizer("Hello", return_tensors="pt")["input_ids"], max_new_tokens=4)  # prepared
    if system == "llama.cpp":
        gguf = typed_gguf(source_gguf(model.base), model.base.dtype)
        once = llama_decoder(gguf, torch.get_num_threads(), context)
    else:
        timer = forward_timer(model.base)  # the calibration's timed forward: verify + LM head + argmax, tree mask
        once = lambda n: timer((context, 1, n), False)  # noqa: E731
    for n in nodes:  # warm
        once(n)
    times: dict[int, list[float]] = {n: [] for n in nodes}
    for _ in range(reps):  # the node counts interleaved: the machine's drift falls on each alike
        for n in nodes:
            times[n].append(once(n))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--nodes", default="1,2,3,5,7,9,12,17")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2, help="each system measured this many times, alternating")
    parser.add_argument("--system", choices=["llama.cpp", "draftheads"], help=argparse.SUPPRESS)  # one child's part
    parser.add_argument("--out", type=Path, default=REPO / "results" / "profile" / "llama_cpp_verify")
    args = parser.parse_args(argv)
    nodes = [int(n) for n in args.nodes.split(",")]
    if args.system:
        times = measure(args.system, args.dtype, nodes, args.context, args.reps)
        print("RESULT " + json.dumps(times))
        return 0
    times: dict[str, dict[int, list[float]]] = {"llama.cpp": {n: [] for n in nodes}, "draftheads": {n: [] for n in nodes}}
    for _ in range(args.rounds):  # each system in its own process, alternating
        for system in times:
            run = subprocess.run([sys.executable, __file__, "--system", system, "--dtype", args.dtype, "--nodes", args.nodes,
                                  "--context", str(args.context), "--reps", str(args.reps)],
                                 capture_output=True, text=True, check=True)
            line = next(l for l in run.stdout.splitlines() if l.startswith("RESULT "))
            for n, ms in json.loads(line[len("RESULT "):]).items():
                times[system][int(n)] += ms
    medians = {who: {n: round(statistics.median(v), 3) for n, v in per.items()} for who, per in times.items()}
    result = {"command": "python scripts/llama_cpp_verify_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype, "threads": torch.get_num_threads(),
              "context": args.context, "reps": args.reps * args.rounds, "ms_median": medians,
              "over_one_token": {who: {n: round(per[n] / per[nodes[0]], 3) for n in nodes} for who, per in medians.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.dtype}.json").write_text(json.dumps(result, indent=1) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for who, per in medians.items():
        ax.plot(list(per), list(per.values()), marker="o", label=who)
    ax.set_xlabel("tokens verified in one forward (tree nodes)")
    ax.set_ylabel("ms, median")
    ax.set_title(f"One verification forward, {args.dtype}, {result['threads']} threads, context {args.context}",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / f"{args.dtype}.png")
    print(json.dumps(medians, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
