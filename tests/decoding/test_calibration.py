"""``tree="adaptive"`` works on first use (an empty cache: the heads are bound before the
calibration drafts with them), and the calibration cache is never trusted — a file that is
unreadable or implausible is reported once, naming it, and measured again; a cache that cannot
be written (file-valued or read-only ``DRAFTHEADS_CACHE``) keeps the result in memory with
a warning."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

import draftheads.decoding.calibration as calibration
from helpers import TINY_GRID, tiny_llama
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.decoding.calibration import CalibrationConfig, calibrate, calibration_key, calibration_path
from draftheads.decoding.policy import AdaptivePolicy
from draftheads.heads import HeadConfig, MedusaHeads

MODEL = tiny_llama(0, max_pos=64)


def tiny_heads(model=MODEL) -> MedusaHeads:
    """Unbound heads with stored trees and expected τ (what the adaptive policy needs)."""
    config = HeadConfig(num_heads=2, hidden_size=32, vocab_size=96, trees={"1": [[0]], "3": [[0], [1], [0, 0]]},
                        expected_tau={"1": 1.4, "3": 1.7}, base_fingerprint=fingerprint(model).to_dict())
    torch.manual_seed(0)
    return MedusaHeads(config).to(torch.float64)


@pytest.fixture(autouse=True)
def fresh_memory():
    """Each test starts with no calibration kept in memory by an earlier one."""
    calibration._IN_MEMORY.clear()
    yield
    calibration._IN_MEMORY.clear()


@pytest.fixture
def measured(monkeypatch):
    """Counts real calibrations (run_calibration calls)."""
    calls = []
    real = calibration.run_calibration

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration, "run_calibration", counting)
    return calls


def test_adaptive_on_an_empty_cache_calibrates_once_then_reuses_it(tmp_path, monkeypatch, measured):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "empty-cache"))
    tiny_heads().save_pretrained(tmp_path / "heads", dtype=None)
    model = DraftHeadsModel.from_pretrained(tmp_path / "heads", base=MODEL, tree="adaptive", calibration=TINY_GRID)
    assert isinstance(model.policy, AdaptivePolicy) and measured == [1]
    assert list((tmp_path / "empty-cache" / "calibration").glob("*.json"))
    ids = torch.tensor([[5, 6, 7, 8]])
    assert model.generate(ids, max_new_tokens=10).tolist() == MODEL.generate(ids, max_new_tokens=10,
                                                                             do_sample=False).tolist()
    again = DraftHeadsModel.from_pretrained(tmp_path / "heads", base=MODEL, tree="adaptive", calibration=TINY_GRID)
    assert isinstance(again.policy, AdaptivePolicy) and measured == [1]  # the cache served the second load


def damaged(good: dict) -> dict[str, str | bytes]:
    rows = good["rows"]
    return {
        "truncated": json.dumps(good)[:40],
        "empty": "",
        "binary": b"\x00\xff\xfe\x89PNG\x1a\n" * 8,
        "list": "[]",
        "no rows": json.dumps({**good, "rows": []}),
        "string": json.dumps("calibration"),
        "rows not a list": json.dumps({**good, "rows": "fast"}),
        "key-less row": json.dumps({**good, "rows": [{"bs": 1, "q": 1}] + rows}),
        "string size": json.dumps({**good, "rows": [{**rows[0], "bs": "one"}] + rows[1:]}),
        "nan time": json.dumps({**good, "rows": [{**rows[0], "ms": float("nan")}] + rows[1:]}),
        "negative time": json.dumps({**good, "rows": [{**rows[0], "ms": -3.0}] + rows[1:]}),
        "infinite draft time": json.dumps({**good, "draft_rows": [{"bs": 1, "budget": 1, "ms": float("inf")}]}),
        "meta not an object": json.dumps({**good, "meta": [1]}),
        "null context": json.dumps({**good, "rows": [{**rows[0], "ctx": None}] + rows[1:]}),
        "infinite context": json.dumps({**good, "rows": [{**rows[0], "ctx": float("inf")}] + rows[1:]}),
        "string context": json.dumps({**good, "rows": [{**rows[0], "ctx": "8"}] + rows[1:]}),
        "huge query count": json.dumps({**good, "rows": [{**rows[0], "q": 10 ** 400}] + rows[1:]}),
        "huge integer time": json.dumps({**good, "rows": [{**rows[0], "ms": 10 ** 400}] + rows[1:]}),
        "bool batch size": json.dumps({**good, "rows": [{**rows[0], "bs": True}] + rows[1:]}),
        "huge draft budget": json.dumps({**good, "draft_rows": [{"bs": 1, "budget": 10 ** 30, "ms": 1.0}]}),
        "overhead without context": json.dumps({**good, "overhead_rows": [{"bs": 1, "q": 1, "ms": 1.0}]}),
        "null meta context for rows without one": json.dumps(
            {**good, "meta": {**good["meta"], "ctx": None}, "rows": [{k: v for k, v in r.items() if k != "ctx"}
                                                                     for r in rows]}),
    }


CASES = list(damaged({"rows": [{"bs": 1, "q": 1, "ctx": 8, "ms": 1.0}], "meta": {}}))


@pytest.mark.parametrize("case", CASES)
def test_an_unusable_cache_file_is_reported_by_name_and_measured_again(tmp_path, monkeypatch, measured, case):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    heads = tiny_heads().bind(MODEL.lm_head.weight, MODEL.get_input_embeddings().weight)
    calibrate(MODEL, heads, TINY_GRID)
    path = calibration_path(calibration_key(MODEL, heads), TINY_GRID)
    content = damaged(json.loads(path.read_text()))[case]
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.warns(UserWarning, match=rf"ignoring the cached calibration {path}.*measuring it again") as seen:
        cost = calibrate(MODEL, heads, TINY_GRID)
    assert len([w for w in seen if "ignoring the cached calibration" in str(w.message)]) == 1  # once
    assert measured == [1, 1]  # measured again
    assert cost.step_ms(1, 2, 8, 1) > 0
    assert json.loads(path.read_text())["meta"]["key"] == calibration_key(MODEL, heads)  # the file is replaced
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the repaired cache is read silently, without measuring
        calibrate(MODEL, heads, TINY_GRID)
    assert measured == [1, 1]


def read_only(tmp_path, monkeypatch):
    """A cache whose files cannot be created (as a read-only folder refuses them; the tests may
    run as root, whom chmod does not stop, so the refusal is made directly)."""
    import draftheads.core.atomic as atomic

    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(atomic.tempfile, "mkstemp", refuse)
    return tmp_path / "read-only"


def file_valued(tmp_path, monkeypatch):
    target = tmp_path / "a-file"
    target.write_text("not a folder")
    return target


@pytest.mark.parametrize("cache", [read_only, file_valued])
def test_an_unwritable_cache_warns_and_keeps_the_calibration_in_memory(tmp_path, monkeypatch, measured, cache):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(cache(tmp_path, monkeypatch)))
    tiny_heads().save_pretrained(tmp_path / "heads", dtype=None)
    with pytest.warns(UserWarning, match=r"calibration could not be cached: cannot write to .*DRAFTHEADS_CACHE"):
        model = DraftHeadsModel.from_pretrained(tmp_path / "heads", base=MODEL, tree="adaptive",
                                                calibration=TINY_GRID)
    assert isinstance(model.policy, AdaptivePolicy) and measured == [1]
    ids = torch.tensor([[9, 10, 11]])
    assert model.generate(ids, max_new_tokens=8).tolist() == MODEL.generate(ids, max_new_tokens=8,
                                                                            do_sample=False).tolist()
    DraftHeadsModel.from_pretrained(tmp_path / "heads", base=MODEL, tree="adaptive", calibration=TINY_GRID)
    assert measured == [1]  # kept in memory: not measured again in this process


def test_cli_generate_adaptive_on_a_fresh_machine(tmp_path, monkeypatch, capsys, measured):
    """``draftheads generate --tree adaptive`` with an empty cache calibrates once and answers;
    a second run reuses the cache; a corrupted cache file is measured again with a warning
    naming it (a tiny grid stands in for the default one)."""
    import draftheads.decoding.policy as policy
    from draftheads.cli import main
    from helpers import save_tiny_base

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(policy, "CalibrationConfig", lambda: TINY_GRID)
    base = save_tiny_base(tmp_path / "base")
    tiny_heads(base).save_pretrained(tmp_path / "heads", dtype=None)
    argv = ["generate", "--base", str(tmp_path / "base"), "--heads", str(tmp_path / "heads"), "--tree", "adaptive",
            "--prompt", "w5 w6 w7", "--max-new-tokens", "6", "--dtype", "float64", "--no-baseline"]
    assert main(argv) == 0 and measured == [1]
    assert "tok/s" in capsys.readouterr().err
    assert main(argv) == 0 and measured == [1]
    [cached] = (tmp_path / "cache" / "calibration").glob("*.json")
    cached.write_text('{"rows": [')
    with pytest.warns(UserWarning, match=rf"ignoring the cached calibration {cached}"):
        assert main(argv) == 0
    assert measured == [1, 1]


@pytest.mark.slow
def test_smollm2_adaptive_with_a_file_valued_cache(tmp_path, monkeypatch, measured):
    """The embedded base and its shipped heads with ``DRAFTHEADS_CACHE`` pointing at a file: the
    GGUF conversion and the calibration both warn and stay in this process, and the answer is
    the base's own."""
    import os

    from helpers import REPO

    if os.environ.get("DRAFTHEADS_SKIP_SMOLLM2"):
        pytest.skip("DRAFTHEADS_SKIP_SMOLLM2 is set")
    (tmp_path / "cache").write_text("a file")
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    grid = CalibrationConfig(batch_sizes=(1,), nodes=(1, 2), contexts=(32,), max_tokens=8, reps=1)
    with pytest.warns(UserWarning) as seen:
        model = DraftHeadsModel.from_pretrained(REPO / "checkpoints" / "smollm2-135m-hydra", dtype="float32",
                                                tree="adaptive", calibration=grid)
    messages = " ".join(str(w.message) for w in seen)
    assert "converted base could not be cached: cannot write to" in messages
    assert "calibration could not be cached: cannot write to" in messages
    assert isinstance(model.policy, AdaptivePolicy) and measured == [1]
    ids = model.tokenizer("The sky is", return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_new_tokens=12).tolist() == model.base.generate(
        ids, max_new_tokens=12, do_sample=False).tolist()


def test_vectorized_prices_equal_the_nested_interpolation():
    """LatencyTable.ms (array grids, only the bracketing points weighted) equals interpolating
    q, then bs, then kv_len with interp1 over every measured point, inside and past the grid; and
    CostModel.step_ms_many equals step_ms width by width."""
    from draftheads.decoding.cost import CostModel, LatencyTable, interp1

    rows = [{"bs": bs, "q": q, "ctx": kv_len, "ms": 5 + 0.3 * bs * q ** 1.2 + kv_len / 100 + (q % 3)}
            for kv_len in (64, 256, 1024) for bs in (1, 4, 16) for q in ((1, 2, 5, 9, 17) if bs < 16 else (1, 3))]
    table = LatencyTable.from_rows(rows)

    def nested(bs, q, kv_len):
        per_ctx = []
        for c, bss in table.points.items():
            per_bs = [interp1([p[0] for p in pts], [p[1] for p in pts], q) for pts in bss.values()]
            per_ctx.append(interp1(list(bss), per_bs, bs))
        return max(interp1(list(table.points), per_ctx, kv_len), 1e-6)

    for bs in (1, 2, 4, 9, 16, 40):
        for kv_len in (0, 64, 100, 1024, 4000):
            for q in (1, 3, 8, 17, 33):
                assert table.ms(bs, q, kv_len) == pytest.approx(nested(bs, q, kv_len), rel=1e-12)
    cost = CostModel(table, overhead=LatencyTable.from_rows([{"bs": b, "q": q, "ctx": 0, "ms": 0.1 * b + 0.01 * q}
                                                             for b in (1, 16) for q in (1, 5)]))
    widths = np.arange(1, 34)
    assert cost.step_ms_many(7, widths, 300).tolist() == pytest.approx([cost.step_ms(7, int(w), 300) for w in widths])


def test_the_width_chooser_prices_nodes_by_the_context_they_attend_to():
    """The merged drafter's step table keeps every calibrated context: a node costs more at a
    long context than at a short one when the calibration says so, prices between two contexts
    are interpolated, each context's table never counts a larger tree as cheaper, and one
    context still gives a context-free table."""
    from draftheads.decoding.cost import CostModel, LatencyTable

    rows = [{"bs": 1, "q": q, "ctx": kv_len, "ms": 30 + q * (0.5 + kv_len / 1000) + (8 if (q, kv_len) == (5, 256) else 0)}
            for kv_len in (256, 1024) for q in (1, 3, 5, 9, 17)]
    cost = CostModel(LatencyTable.from_rows(rows), overhead=LatencyTable.from_rows(
        [{"bs": 1, "q": q, "ctx": 0, "ms": 1.0} for q in (1, 17)]))
    table = cost.per_token_table([256, 1024])
    per_node = {kv_len: table.step_ms(1, 17, kv_len) - table.step_ms(1, 1, kv_len) for kv_len in (256, 640, 1024)}
    assert per_node[256] == pytest.approx(16 * 0.756) and per_node[1024] == pytest.approx(16 * 1.524)
    assert per_node[640] == pytest.approx((per_node[256] + per_node[1024]) / 2)
    assert table.step_ms(1, 5, 256) == pytest.approx(table.step_ms(1, 9, 256))  # (5, 256) measured slow: lowered
    assert table.step_ms(2, 4, 1024) == pytest.approx(table.step_ms(1, 8, 1024))  # priced by query tokens
    single = cost.per_token_table([256])
    assert single.step_ms(1, 9, 5000) == pytest.approx(single.step_ms(1, 9, 256)) == pytest.approx(table.step_ms(1, 9, 256))


def test_interleaved_rounds_undo_a_busy_spell_that_repeating_each_point_keeps():
    # true costs rise with the point; a busy spell doubles every timing of calls 2-9 (of 4 points × 4 reps)
    points, true = [0, 1, 2, 3], [10.0, 11.0, 12.0, 13.0]
    calls = []

    def measure(point, warm):
        calls.append((point, warm))
        return true[point] * (2.0 if 2 <= len(calls) - 1 <= 9 else 1.0)

    rounds = []
    assert calibration.interleaved_best(points, measure, rounds=4, on_round=lambda done, of, s: rounds.append(
        (done, of, len(calls)))) == true  # each point has a round outside it
    assert [warm for _, warm in calls] == [True] * 4 + [False] * 12  # warmed up in the first round only
    assert rounds == [(1, 4, 4), (2, 4, 8), (3, 4, 12), (4, 4, 16)]  # progress as each round ends
    calls.clear()
    in_a_row = [min(measure(p, True) for _ in range(4)) for p in points]  # the old order: a point's reps back to back
    assert in_a_row[1] == 22.0 and in_a_row[1] > in_a_row[2]  # point 1 priced above point 2: the spell kept
