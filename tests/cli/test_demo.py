"""``draftheads demo`` without a browser (draftheads/demo.py): the page's one event streams the
draftheads answer as coloured spans then plain generate's, ending with the same text, τ, tokens/s
and the identity line; options and a missing Gradio are one error line before the model loads.
The page itself in a real browser: test_demo_browser.py."""
from __future__ import annotations

import re
import socket
import sys

import pytest
import torch

from draftheads.cli import main
from draftheads.decoding import DraftHeadsModel
from draftheads.demo import SpanStreamer, answer, answer_html
from helpers import save_tiny_base, saved_tree_heads


@pytest.fixture()
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    base = save_tiny_base(tmp_path / "base")
    saved_tree_heads(tmp_path / "heads", base)
    return tmp_path


def test_the_event_streams_coloured_drafts_then_plain_generate(tiny):
    model = DraftHeadsModel.from_pretrained(tiny / "heads", base_name_or_path=str(tiny / "base"), dtype="float64",
                                            sources="heads,context", tree=3)  # pinned: drafts are accepted
    updates = list(answer(model, "w5 w6 w7 w8 w5 w6", 30))
    fast_html, fast_line, plain_html, plain_line, verdict = updates[-1]
    assert verdict.startswith("speedup ") and verdict.endswith("identical to plain generate (float64)")
    assert fast_line.startswith("draftheads: 30 tokens · ") and " τ " in fast_line and not fast_line.endswith("…")
    assert plain_line.startswith("plain generate: 30 tokens · ") and "tokens/s" in plain_line
    assert 'class="dh-draft"' in fast_html and 'class="dh-base"' in fast_html and "dh-draft" not in plain_html
    assert shown(fast_html) == shown(plain_html) != ""
    assert f"τ {model.last_stats.tau:.2f}" in fast_line
    assert updates[0][2] == answer_html([]) and updates[0][3] == ""  # draftheads streams first, plain after


def shown(html: str) -> str:
    """The text a page shows for an answer's HTML."""
    return re.sub(r"<[^>]+>", "", html)


def test_an_empty_prompt_is_one_line_on_the_page(tiny):
    model = DraftHeadsModel.from_pretrained(tiny / "heads", base_name_or_path=str(tiny / "base"), dtype="float64")
    [update] = list(answer(model, "   ", 8))
    assert update[-1].startswith("error: the prompt is empty")


@pytest.mark.parametrize("prompt,shown", [(5, "int 5"), (["hi"], "list ['hi']"), ({"text": "hi"}, "dict {'text': 'hi'}")])
def test_a_prompt_that_is_not_text_is_one_line_on_the_page(tiny, prompt, shown):
    """A caller of the page's event (or a multimodal box) may send a non-str: one line, no traceback."""
    model = DraftHeadsModel.from_pretrained(tiny / "heads", base_name_or_path=str(tiny / "base"), dtype="float64")
    [update] = list(answer(model, prompt, 8))
    assert update == ("", "", "", "", f"error: the prompt must be text (a str), got {shown}; type it into the "
                                      "Prompt box.")


def test_spans_merge_and_escape():
    class Words:
        def decode(self, tokens, skip_special_tokens=True):
            return "".join(["<a>", " b", " c", " d"][t] for t in tokens)

    streamer = SpanStreamer(Words())
    streamer.put_step(torch.tensor([0]), 0)  # the prefill's token: no step
    streamer.put_step(torch.tensor([1, 2, 3]), 2)
    spans, tokens, steps, _ = streamer.snapshot()
    assert spans == [("<a>", "base"), (" b c", "draft"), (" d", "base")] and (tokens, steps) == (4, 1)
    assert "&lt;a&gt;" in answer_html(spans)


def test_options_and_a_missing_gradio_are_one_line_before_the_model_loads(tiny, monkeypatch, capsys):
    args = ["demo", "--base", str(tiny / "base"), "--heads", str(tiny / "heads")]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        loads = []
        monkeypatch.setattr(DraftHeadsModel, "from_pretrained", lambda *a, **k: loads.append(a))
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--port", str(port)])
        assert exit_.value.code == 2 and loads == []
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: cannot serve on 127.0.0.1:{port}") and "--port" in err and "\n" not in err
    with pytest.raises(SystemExit):
        main([*args, "--port", "70000"])
    assert capsys.readouterr().err.strip() == "error: --port must be 1-65535, got 70000."
    with pytest.raises(SystemExit):
        main([*args, "--sources", "bogus"])
    assert capsys.readouterr().err.startswith("error: draftheads demo: argument --sources")
    monkeypatch.setitem(sys.modules, "gradio", None)  # as if not installed
    with pytest.raises(SystemExit):
        main(args)
    assert capsys.readouterr().err.strip() == ("error: draftheads demo needs Gradio: pip install 'draftheads[demo]' "
                                               "(or pip install gradio).")
    assert loads == []
