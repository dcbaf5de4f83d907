"""draftheads.plots: every benchmark figure is written as a PNG off-screen, and no figure stays
open afterwards (a long benchmark run draws several)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftheads import plots

PNG = b"\x89PNG\r\n\x1a\n"


def open_figures() -> list[int]:
    import matplotlib.pyplot as plt

    return plt.get_fignums()


def bench_rows():
    rows = [{"hf": {"tokens_per_second": 10.0 + i}, "draftheads": {"tokens_per_second": 20.0 + i, "tau": 1.2 + i / 10}}
            for i in range(6)]
    return rows, {"hf_tokens_per_second": 12.5, "draftheads_tokens_per_second": 22.5, "speedup": 1.8, "tau": 1.45}


def batch_results():
    names = ("hf", "0", "4", "adaptive", "adaptive:mask")
    return {str(bs): {"strategies": {n: {"tokens_per_second": bs * (10.0 + k)} for k, n in enumerate(names)}}
            for bs in (1, 2, 4)}


def cost_and_policy():
    forward = SimpleNamespace(points={128: {1: [(1, 50.0), (5, 70.0)], 4: [(1, 80.0), (5, 120.0)]},
                                      512: {1: [(1, 60.0), (5, 90.0)]}})
    policy = SimpleNamespace(scale=0.8, rank=lambda bs, kv_len: [SimpleNamespace(budget=4 if bs < 8 else 0)])
    return SimpleNamespace(forward=forward), policy


def compare_results():
    groups = ("mt_bench", "translation")
    return {"meta": {"dtype": "float32", "max_new_tokens": 16, "prompts": 4},
            "checkpoints": {name: {"label": label, "speed": {
                "overall": {"speedup": 1.1, "tau": 1.5},
                "groups": {g: {"speedup": 0.9 + k / 10, "tau": 1.3 + k / 10} for k, g in enumerate(groups)}}}
                for name, label in (("medusa", "Medusa"), ("hydra", "Hydra"))}}


def sources_results(key: str) -> dict:
    """A bs-1 bench's payload with its source configurations under ``key`` (``drafts``: a run
    written before the rename)."""
    def summary(k: float) -> dict:
        return {key: {"heads": {"speedup": 1.2 + k}, "default": {"speedup": 1.5 + k}}, "prompt_lookup": {"speedup": 1.1}}

    return {"meta": {"dtype": "torch.bfloat16"}, "by_category": {"qa": summary(0.0), "math": summary(0.1)},
            "overall": summary(0.05)}


@pytest.mark.parametrize("draw", [
    lambda path: plots.plot(*bench_rows(), path),
    lambda path: plots.plot_throughput(batch_results(), path, 32, heads="hydra"),
    lambda path: plots.plot_surface(*cost_and_policy(), path),
    lambda path: plots.plot_chart(compare_results(), path),
    lambda path: plots.plot_sources(sources_results("sources"), path),
], ids=["plot", "plot_throughput", "plot_surface", "plot_chart", "plot_sources"])
def test_each_figure_is_a_png_and_is_closed(draw, tmp_path):
    path = tmp_path / "figure.png"
    draw(path)
    assert path.read_bytes()[:8] == PNG
    assert open_figures() == []


def test_sources_png_draws_a_run_written_under_the_old_key_as_under_the_new(tmp_path):
    drawn = {}
    for key in ("sources", "drafts", "neither"):
        plots.plot_sources(sources_results(key), tmp_path / f"{key}.png")
        drawn[key] = (tmp_path / f"{key}.png").read_bytes()
    assert drawn["drafts"] == drawn["sources"] != drawn["neither"]  # "neither": prompt lookup's bars alone


def test_a_failing_figure_is_closed_and_not_written(tmp_path):
    path = tmp_path / "figure.png"
    with pytest.raises(KeyError):
        plots.plot_chart({"meta": {}, "checkpoints": {"x": {"speed": {"groups": {}}}}}, path)
    assert not path.exists()
    assert open_figures() == []


def test_the_benchmarks_draw_with_these_functions():
    from draftheads import bench

    assert (bench.plot, bench.plot_throughput, bench.plot_surface) == (
        plots.plot, plots.plot_throughput, plots.plot_surface)
