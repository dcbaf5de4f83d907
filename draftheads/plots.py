"""The figures the benchmarks write: ``results.png`` (``draftheads bench``), ``throughput.png`` and
``latency_surface.png`` (``draftheads bench --batch-sizes``), ``sources.png`` (``draftheads bench
--sources`` / ``--parts``) and ``chart.png`` (``scripts/compare_heads.py``). Drawn off-screen by
:func:`.training.figures.figure`."""
from __future__ import annotations

from pathlib import Path

from .training.figures import figure


def plot(rows: list[dict], overall: dict, path: Path) -> None:
    with figure(path, 1, 2, figsize=(11, 4.2)) as (fig, (left, right)):
        xs = range(len(rows))
        left.plot(xs, [r["hf"]["tokens_per_second"] for r in rows], "o-", ms=3, label="HF generate (greedy)")
        left.plot(xs, [r["draftheads"]["tokens_per_second"] for r in rows], "o-", ms=3, label="draftheads")
        left.set_xlabel("prompt")
        left.set_ylabel("new tokens / s")
        left.set_title(f"throughput: {overall['hf_tokens_per_second']:.1f} → "
                       f"{overall['draftheads_tokens_per_second']:.1f} tok/s ({overall['speedup']:.2f}x)")
        left.legend()
        right.hist([r["draftheads"]["tau"] for r in rows], bins=20, color="tab:green")
        right.axvline(overall["tau"], color="k", ls="--", label=f"overall τ = {overall['tau']:.2f}")
        right.set_xlabel("τ (tokens per verification step)")
        right.set_ylabel("prompts")
        right.legend()


def plot_throughput(results: dict, path: Path, max_new_tokens: int, heads: str = "draft",
                    prompts: str = "MT-Bench") -> None:
    """Left: end-to-end tokens/s of the batch per strategy and batch size; right: the decode
    phase alone (after every row's first token), where drafting's gain shows undiluted by the
    prefill that every strategy and transformers pay alike."""
    sizes = [int(b) for b in results]
    names = list(next(iter(results.values()))["strategies"]) if results else []
    with figure(path, 1, 2, figsize=(13, 4.6)) as (fig, axes):
        for ax, key, label in zip(axes, ("tokens_per_second", "decode_tokens_per_second"),
                                  ("generated tokens / s (whole batch, end to end)", "decode-phase tokens / s (after prefill)")):
            for name in names:
                ys = [results[str(b)]["strategies"][name].get(key, 0.0) for b in sizes]
                style = {"hf": dict(color="k", lw=2.2), "adaptive": dict(color="tab:red", lw=2.2, marker="s"),
                         "adaptive:mask": dict(color="tab:red", lw=1, ls="--", marker="x")}.get(
                             name, dict(lw=2.2, marker="D") if name.startswith("adaptive+") else dict(lw=1, marker="o", ms=3))
                ax.plot(sizes, ys, label="HF generate (batched greedy)" if name == "hf" else name, **style)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(s) for s in sizes])
            ax.set_xlabel("batch size")
            ax.set_ylabel(label)
            ax.legend(fontsize=7, ncol=2)
            ax.grid(alpha=0.3)
        fig.suptitle(f"{heads} heads, {prompts}, {max_new_tokens} new tokens")


def plot_surface(cost, policy, path: Path) -> None:
    """Left: profiled step latency vs tree slots per batch size (forward + loop overhead);
    right: the policy's chosen budget per batch size at each calibrated context."""
    contexts = list(cost.forward.points)
    with figure(path, 1, len(contexts) + 1, figsize=(5 * (len(contexts) + 1), 4.2)) as (fig, axes):
        for ax, kv_len in zip(axes, contexts):
            for bs, points in cost.forward.points[kv_len].items():
                qs = [q for q, _ in points]
                ax.plot(qs, [ms for _, ms in points], "o-", ms=3, label=f"bs {bs}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("query tokens per row (tree slots)")
            ax.set_ylabel("forward ms (measured)")
            ax.set_title(f"context {kv_len}")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        ax = axes[-1]
        sizes = [1, 2, 4, 8, 16, 32, 64]
        for kv_len in contexts:
            ax.plot(sizes, [policy.rank(bs, kv_len)[0].budget for bs in sizes], "o-", label=f"context {kv_len}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("live batch size")
        ax.set_ylabel("chosen node budget (0 = plain)")
        ax.set_title(f"adaptive choice (τ scale {policy.scale:.2f})")
        ax.legend()
        ax.grid(alpha=0.3)


def plot_chart(results: dict, path: Path) -> None:
    """Grouped bars: speedup (top) and τ (bottom) per Spec-Bench category group, one bar per checkpoint."""
    entries = results["checkpoints"]
    groups = list(next(iter(entries.values()))["speed"]["groups"]) + ["overall"]
    width = 0.8 / max(1, len(entries))
    with figure(path, 2, 1, figsize=(max(9.0, 1.4 * len(groups) + 5), 7), sharex=True) as (fig, axes):
        for ax, key, label in zip(axes, ("speedup", "tau"), ("speedup vs HF generate", "τ (tokens / verify step)")):
            for i, (name, e) in enumerate(entries.items()):
                speed = e["speed"]
                values = [(speed["overall"] if g == "overall" else speed["groups"][g])[key] for g in groups]
                ax.bar([x + (i - (len(entries) - 1) / 2) * width for x in range(len(groups))], values, width,
                       label=f"{name} ({e['label']})")
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            ax.set_ylabel(label)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        axes[0].set_title(f"bs 1 greedy, {results['meta']['dtype']}, {results['meta']['max_new_tokens']} new tokens, "
                          f"{results['meta']['prompts']} prompts")
        axes[1].set_xticks(range(len(groups)), groups)


def plot_sources(results: dict, path: Path) -> None:
    """``sources.png`` (``draftheads bench --sources`` / ``--parts``): speedup over HF plain generate
    per category for every source configuration, with transformers' prompt lookup as the peer.
    ``results``: a bench's payload, old or new (:func:`~.bench.summary.with_sources`)."""
    import numpy as np

    from .bench.summary import SOURCES, with_sources

    results = with_sources(results)
    groups = [*results["by_category"], "overall"]
    summaries = [results["by_category"].get(g, results["overall"]) for g in groups]
    names = list(summaries[0].get(SOURCES, {}))
    series = {name: [s[SOURCES][name]["speedup"] for s in summaries] for name in names}
    if all("prompt_lookup" in s for s in summaries):
        series["HF prompt lookup"] = [s["prompt_lookup"]["speedup"] for s in summaries]
    width = 0.8 / max(1, len(series))
    with figure(path, figsize=(max(8.0, 1.3 * len(groups)), 4.6)) as (fig, ax):
        xs = np.arange(len(groups))
        for i, (name, ys) in enumerate(series.items()):
            ax.bar(xs + i * width, ys, width, label=name, color="k" if name == "HF prompt lookup" else None)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(xs + width * (len(series) - 1) / 2, groups, rotation=20)
        ax.set_ylabel("speedup over HF generate (same dtype)")
        ax.set_title(f"draft sources, {results['meta']['dtype'].removeprefix('torch.')}, bs 1")
        ax.legend(fontsize=7, ncol=2)
