"""Per-step drafting cost and offline hit rate of the lookup sources on real SmolLM2 tokens.

    taskset -c 1 python scripts/bench_sources.py \\
        --store /tmp/store_holdout.safetensors --holdout-last 300 --out results/drafting_sources/lookup_sources/bench.json

Cost: long streams of the base's own answers (``response_ids`` of consecutive records
concatenated to ``--context`` tokens) are fed one token per step — the worst case, one accepted
token per step — and each source's ``extend`` + ``propose`` is timed (no model is loaded).
Both context structures (n-gram index, suffix automaton) are timed on the same streams.

Hit rate: the held-out records (the last ``--holdout-last`` of the data, which the store must
not contain) are replayed under a greedy verifier: at each step a source proposes up to
``--budget`` nodes, the longest trie path equal to the true continuation is accepted plus the
bonus token, and the source is extended with those tokens. Reported per data source: how
often the best first token equals the true next token, and the mean accepted draft length.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from draftheads.decoding.drafters import (BigramTable, Candidates, ContextConfig, ContextSource, HitRate, LookupConfig,
                                          LookupSources, ModelStore, NgramIndex, StatsConfig, StatsSource,
                                          StoreConfig, StoreSource, SuffixAutomaton, default_q, lookup_names,
                                          source_id, spec_of, tokenizer_identity)
from draftheads.training.features import read_jsonl

EOS = 2  # SmolLM2's <|im_end|>
AUTOMATON = ContextConfig(eos_token_id=EOS, structure="automaton")
LOOKUP = LookupConfig((ContextConfig(eos_token_id=EOS), StoreConfig(eos_token_id=EOS), StatsConfig(eos_token_id=EOS)))


def streams(records: list[dict], length: int, count: int) -> list[list[int]]:
    """``count`` token streams of ``length + steps`` tokens from consecutive answers."""
    out, cur = [], []
    for r in records:
        cur += r["response_ids"]
        if len(cur) >= length:
            out.append(cur)
            cur = []
            if len(out) == count:
                break
    return out


def time_per_step(make, stream: list[int], start: int, steps: int, budget: int) -> list[float]:
    """µs of one extend(1 token) + propose(budget) per step, after seeding with stream[:start]."""
    source = make(stream[:start])
    out = []
    for i in range(start, start + steps):
        t0 = time.perf_counter()
        source.extend(stream[i:i + 1])
        source.propose(budget)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


class MatchOnly:
    """Times a bare structure's append + longest match (no trie built)."""

    def __init__(self, structure):
        self.s = structure

    def extend(self, tokens):
        self.s.extend(tokens)

    def propose(self, budget):
        return self.s.match()


SPEC_BENCH_CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag")


def spec_bench_answers(path: str, per_category: int, max_new_tokens: int) -> dict[str, list[dict]]:
    """The base's greedy answers to the first ``per_category`` prompts of each Spec-Bench
    category (the model is loaded only here, never for timing; answers cached)."""
    from draftheads.decoding.base.loading import dtype_name, load_base
    from draftheads.head_scoring import answers_cache_path, base_answers
    from draftheads.prompts import read_prompts

    prompts = [p for p in read_prompts(f"{path}@{per_category}") if p["category"] in SPEC_BENCH_CATEGORIES]
    base, tokenizer = load_base()
    cache = answers_cache_path(path, f"specbench{per_category}", max_new_tokens, dtype_name(base.dtype))
    groups: dict[str, list[dict]] = {}
    for r in base_answers(base, tokenizer, prompts, max_new_tokens, cache):
        groups.setdefault(r["category"], []).append(r)
    return groups


class RowView:
    """One row of a :class:`LookupSources` with a single source's extend/propose calls."""

    def __init__(self, drafter: LookupSources, prompt):
        self.lookup = drafter
        drafter.start(0, prompt)

    def extend(self, tokens):
        self.lookup.extend(0, tokens)

    def propose(self, budget):
        return self.lookup.propose(0, budget)


def summary(samples: list[float]) -> dict:
    arr = np.asarray(samples)
    return {"median_us": round(float(np.median(arr)), 2), "mean_us": round(float(arr.mean()), 2),
            "p90_us": round(float(np.percentile(arr, 90)), 2), "steps": int(arr.size)}


def category(source: str) -> str:
    return source.split(":")[0] if source.startswith("t0:") else source.rsplit("-", 1)[0] if source.startswith("self-instruct") else source


def accepted_length(trie: Candidates, truth: list[int]) -> int:
    """Longest trie path equal to a prefix of ``truth`` (what a greedy verifier accepts)."""
    best, node_of = 0, {}
    for i in range(len(trie)):
        p, d = int(trie.parent[i]), int(trie.depth[i])
        if (p < 0 or node_of.get(p)) and d <= len(truth) and int(trie.token[i]) == truth[d - 1]:
            node_of[i] = True
            best = max(best, d)
    return best


def replay(make, prompt: list[int], answer: list[int], budget: int, hitrate: HitRate | None = None) -> dict:
    source = make(prompt)
    steps = first_hits = accepted = proposed_steps = 0
    i = 0
    while i < len(answer):
        trie = source.propose(budget)
        truth = answer[i:]
        a = accepted_length(trie, truth)
        if len(trie):
            proposed_steps += 1
            first_hits += int(trie.token[0]) == truth[0]  # node 0 = the best root child (selection order)
        if hitrate is not None:
            hitrate.observe(0, trie, truth[:a])
        steps += 1
        accepted += a
        source.extend(answer[i:i + a + 1])
        i += a + 1
    return {"steps": steps, "first_hits": first_hits, "accepted": accepted, "proposed_steps": proposed_steps,
            "tokens": len(answer)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parents[1]
    parser.add_argument("--data", required=True, help="JSONL with response_ids (the base's own answers: the data the store was built from, e.g. this machine's ../shared/data/selfdistill_smollm2.jsonl)")
    parser.add_argument("--store", required=True, help="built with --holdout-last equal to ours")
    parser.add_argument("--holdout-last", type=int, default=300)
    parser.add_argument("--per-category", type=int, default=40)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--spec-bench", default=None, help="spec-bench (or a Spec-Bench-style file): also replay the base's answers")
    parser.add_argument("--spec-bench-per-category", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(root / "results" / "drafting_sources" / "lookup_sources" / "bench.json"))
    args = parser.parse_args(argv)

    records = list(read_jsonl(args.data))
    kept, held = records[:-args.holdout_last], records[-args.holdout_last:]
    store = ModelStore.open(args.store)
    if store.header.records != len(kept):
        raise SystemExit(f"{args.store} holds {store.header.records} records, not the first {len(kept)}: "
                         f"rebuild it with --holdout-last {args.holdout_last} so the held-out answers stay unseen.")
    table = BigramTable.from_store(store)

    # ---- per-step cost on 2k-token contexts
    makers = {
        "context_ngram_index_match": lambda p: MatchOnly(NgramIndex(4, p)),
        "context_suffix_automaton_match": lambda p: MatchOnly(SuffixAutomaton(p)),
        "context_source_propose": lambda p: ContextSource(p, ContextConfig(eos_token_id=EOS)),
        "context_source_propose_automaton": lambda p: ContextSource(p, AUTOMATON),
        "store_source_propose": lambda p: StoreSource(store, p, LOOKUP.of("store")),
        "stats_source_propose": lambda p: StatsSource(table, p, LOOKUP.of("stats")),
        "merged_three_rescored": lambda p: RowView(LookupSources(store, LOOKUP), p),
    }
    cost = {}
    long_streams = streams(held + kept, args.context + args.steps, args.streams)
    for name, make in makers.items():
        samples = []
        for s in long_streams:
            samples += time_per_step(make, s, args.context, args.steps, args.budget)
        cost[name] = summary(samples)
        print(name, cost[name], flush=True)
    build = {}
    for name, cls in (("ngram_index", lambda p: NgramIndex(4, p)), ("suffix_automaton", SuffixAutomaton)):
        t0 = time.perf_counter()
        for s in long_streams:
            cls(s[:args.context])
        build[name] = round((time.perf_counter() - t0) / len(long_streams) * 1e3, 2)
    print("seed ms per 2k prompt", build, flush=True)

    # ---- offline hit rate on held-out answers
    from draftheads.decoding.base.loading import load_tokenizer
    from draftheads.training.features import chat_prompt_ids

    tokenizer = load_tokenizer(None)
    if (store.header.vocab_size, store.header.vocab_sha256) != tuple(vars(tokenizer_identity(tokenizer)).values()):
        raise SystemExit(f"{args.store} was built for another tokenizer.")
    by_cat: dict[str, list[dict]] = {}
    for r in held:
        by_cat.setdefault(category(r["source"]), []).append(r)
    shared_hitrate = HitRate()
    replayers = {
        "context": lambda p: ContextSource(p, ContextConfig(eos_token_id=EOS)),
        "context_automaton": lambda p: ContextSource(p, AUTOMATON),
        "store": lambda p: StoreSource(store, p, LOOKUP.of("store")),
        "stats": lambda p: StatsSource(table, p, LOOKUP.of("stats")),
        "merged": lambda p: RowView(LookupSources(store, LOOKUP, shared_hitrate), p),
    }

    def hit_rates(groups: dict[str, list[dict]]) -> dict:
        out = {}
        for cat, recs in sorted(groups.items()):
            recs = recs[:args.per_category]
            out[cat] = {"records": len(recs)}
            for name, make in replayers.items():
                tot = {"steps": 0, "first_hits": 0, "accepted": 0, "proposed_steps": 0, "tokens": 0}
                for r in recs:
                    res = replay(make, chat_prompt_ids(tokenizer, r["prompt"]), r["response_ids"], args.budget,
                                 shared_hitrate if name == "merged" else None)
                    tot = {k: tot[k] + res[k] for k in tot}
                out[cat][name] = {"first_token_hit": round(tot["first_hits"] / tot["steps"], 4),
                                  "proposed_rate": round(tot["proposed_steps"] / tot["steps"], 4),
                                  "mean_accepted": round(tot["accepted"] / tot["steps"], 4),
                                  "tau": round(tot["tokens"] / tot["steps"], 4), "steps": tot["steps"]}
            print(cat, json.dumps(out[cat]), flush=True)
        return out

    hit = hit_rates(by_cat)
    spec = {}
    if args.spec_bench:
        spec = hit_rates(spec_bench_answers(args.spec_bench, args.spec_bench_per_category, args.max_new_tokens))
    q = {f"{spec_of(s).name.upper()}:{b}": {"q": round(shared_hitrate.q(s, b), 3), "prior": round(default_q(s, b), 3),
                                            "share_observed": round(float(shared_hitrate.proposed[s, b]), 1)}
         for s in map(source_id, lookup_names()) for b in range(0, 9) if shared_hitrate.proposed[s, b] > 0}

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "meta": {"command": " ".join(sys.argv), "store": str(args.store), "store_header": vars(store.header),
                 "budget": args.budget, "context_tokens": args.context, "steps_per_stream": args.steps,
                 "streams": len(long_streams), "python": platform.python_version(), "cpu": platform.processor(),
                 "note": "per-step = extend(1 token) + propose(budget), µs, one core; hit rate: greedy replay of "
                         "held-out self-distilled answers per data source, and of the base's own greedy answers "
                         "(default dtype, cached under data_cache/) to the first prompts per Spec-Bench category"},
        "cost_per_step": cost, "seed_ms_per_2k_context": build, "hit_rate": hit, "hit_rate_spec_bench": spec,
        "learned_q_merged_replay": q}, indent=2))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
