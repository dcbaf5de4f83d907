"""``draftheads demo``: a local Gradio page beside the model. A prompt box; the answer streams
with the tokens of accepted drafts in one colour and the base's own token of each step (the
bonus) in another, live tokens/s and τ under it; then plain transformers ``generate`` answers
the same prompt beside it (run after, not at the same time, so the two do not share the cores),
and a last line gives the speedup and whether the answers are the same under the dtype's
guarantee.

It uses the decoder's streaming hook (:class:`draftheads.streamer.DraftColourStreamer`'s
``put_step(tokens, drafted)``, which :meth:`DraftHeadsModel.generate` calls once per step) and
transformers' own streamer protocol (``put``/``end``) for the plain side; nothing is copied from
the decoder. Needs the ``demo`` extra (``pip install 'draftheads[demo]'``: Gradio).
"""
from __future__ import annotations

import html
import os
import queue
import socket
import sys
import threading
import time

import torch

from .core.errors import DraftheadsError
from .core.errors import InputError

#: colours of the answer's spans: accepted drafts, the base's own token of each step
DRAFT_COLOUR, BASE_COLOUR = "#bbf7d0", "#e5e7eb"
CSS = f"""
.dh-answer {{ white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 14px; line-height: 1.6;
             min-height: 8em; padding: 8px; border: 1px solid #d1d5db; border-radius: 6px; }}
.dh-draft {{ background: {DRAFT_COLOUR}; }}
.dh-base {{ background: {BASE_COLOUR}; }}
"""


class SpanStreamer:
    """Collects an answer as it streams, as ``(text, kind)`` spans: ``kind`` is ``"draft"`` (a
    token the base accepted from the draft tree), ``"base"`` (the base's own token of a step) or
    ``"plain"`` (plain ``generate``, which has only its own tokens). Thread-safe to read while
    the decoder writes: :meth:`snapshot` copies under a lock."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lock = threading.Lock()
        self.tokens: list[int] = []
        self.spans: list[tuple[str, str]] = []
        self.printed = ""
        self.steps = 0  # calls of put_step after the first (the prefill's token): verify steps
        self.prompt_seen = False
        self.started = time.perf_counter()
        self.finished: float | None = None

    # transformers' streamer protocol (plain generate): the first put is the prompt
    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self._add(torch.as_tensor(value).reshape(-1).tolist(), 0, "plain")

    # draftheads' hook: one step's tokens, the first ``drafted`` of them accepted drafts
    def put_step(self, tokens: torch.Tensor, drafted: int) -> None:
        first = not self.prompt_seen
        self.prompt_seen = True
        with self.lock:
            self.steps += 0 if first else 1
        self._add(torch.as_tensor(tokens).reshape(-1).tolist(), drafted, "base")

    def end(self) -> None:
        self.finished = time.perf_counter()

    def _add(self, tokens: list[int], drafted: int, own: str) -> None:
        for i, token in enumerate(tokens):
            kind = "draft" if i < drafted else own
            with self.lock:
                self.tokens.append(int(token))
                text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
                if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
                    continue
                new = text[len(self.printed):] if text.startswith(self.printed) else text
                self.printed = text
                if new:
                    if self.spans and self.spans[-1][1] == kind:
                        self.spans[-1] = (self.spans[-1][0] + new, kind)
                    else:
                        self.spans.append((new, kind))

    def snapshot(self) -> tuple[list[tuple[str, str]], int, int, float]:
        """(spans, tokens so far, verify steps so far, seconds since the start)."""
        with self.lock:
            end = self.finished or time.perf_counter()
            return list(self.spans), len(self.tokens), self.steps, end - self.started


def answer_html(spans: list[tuple[str, str]], elem_class: str = "dh-answer") -> str:
    body = "".join(f'<span class="dh-{kind}">{html.escape(text)}</span>' if kind != "plain" else html.escape(text)
                   for text, kind in spans)
    return f'<div class="{elem_class}">{body}</div>'


def speed_line(name: str, tokens: int, seconds: float, steps: int | None = None, tau: float | None = None,
               done: bool = False) -> str:
    """``name: N tokens · X tokens/s · τ Y`` (τ: tokens per verify step, the prefill's token aside)."""
    line = f"{name}: {tokens} tokens · {tokens / max(seconds, 1e-9):.1f} tokens/s"
    if steps is not None:
        if tau is None:
            tau = (tokens - 1) / steps if steps else 1.0
        line += f" · τ {tau:.2f}"
    return line + ("" if done else " …")


def stream(run, streamer: SpanStreamer, interval: float = 0.1):
    """Run ``run()`` in a thread (the decoder writes into ``streamer``); yield the streamer's
    snapshot every ``interval`` seconds while it runs, then once more. An error in ``run``
    is raised here."""
    failure: list[BaseException] = []

    def target():
        try:
            run()
        except BaseException as err:  # noqa: BLE001 - handed to the page as one line
            failure.append(err)
        finally:
            if streamer.finished is None:
                streamer.end()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(interval)
        yield streamer.snapshot()
    if failure:
        raise failure[0]
    yield streamer.snapshot()


def same_answer_line(model, plain: torch.Tensor, ours: torch.Tensor, prompt_len: int) -> str:
    """Whether the two answers are the same, under the dtype's guarantee (decoding/guarantee.py)."""
    from .decoding.guarantee import first_divergence

    name = str(model.base.dtype).removeprefix("torch.")
    diff = first_divergence(model.base, plain, ours, prompt_len)
    if diff is None:
        return f"identical to plain generate ({name})"
    where = f"first divergence at token {diff['position']} (top-1/top-2 logit gap {diff['top1_top2_gap']:.3g})"
    return f"{where}: {'within ' + name + ' rounding, as the guarantee allows' if diff['within_band'] else 'OUTSIDE ' + name + ' rounding — please report this'}"


def answer(model, prompt: str, max_new_tokens: int):
    """The page's one event: yields (draftheads answer, its speed line, plain answer, its speed
    line, verdict) as both stream."""
    from .prompts import chat_input

    if prompt is not None and not isinstance(prompt, str):  # the page sends text; a caller may not
        yield "", "", "", "", (f"error: the prompt must be text (a str), got {type(prompt).__name__} {prompt!r:.60}; "
                               "type it into the Prompt box.")
        return
    try:
        ids = chat_input(model.tokenizer, prompt or "")
    except DraftheadsError as err:
        yield "", "", "", "", f"error: {err}"
        return
    ids = ids.to(model.base.device)
    ours_box: list[torch.Tensor] = []
    fast = SpanStreamer(model.tokenizer)
    empty = answer_html([])
    try:
        for spans, tokens, steps, seconds in stream(
                lambda: ours_box.append(model.generate(ids, max_new_tokens=max_new_tokens, streamer=fast)), fast):
            yield answer_html(spans), speed_line("draftheads", tokens, seconds, steps), empty, "", ""
    except Exception as err:  # noqa: BLE001 - one line on the page
        yield empty, "", empty, "", f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return
    tau = model.last_stats.tau if model.last_stats is not None else None
    fast_line = speed_line("draftheads", tokens, seconds, steps, tau, done=True)
    fast_html, fast_rate = answer_html(spans), tokens / max(seconds, 1e-9)
    plain_box: list[torch.Tensor] = []
    slow = SpanStreamer(model.tokenizer)
    mask = torch.ones_like(ids)
    for plain_spans, plain_tokens, _, plain_seconds in stream(
            lambda: plain_box.append(model.base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                                         do_sample=False, streamer=slow)), slow):
        yield fast_html, fast_line, answer_html(plain_spans), speed_line("plain generate", plain_tokens, plain_seconds), ""
    plain_line = speed_line("plain generate", plain_tokens, plain_seconds, done=True)
    speedup = fast_rate / max(plain_tokens / max(plain_seconds, 1e-9), 1e-9)
    verdict = f"speedup {speedup:.2f}× · {same_answer_line(model, plain_box[0], ours_box[0], ids.shape[1])}"
    yield fast_html, fast_line, answer_html(plain_spans), plain_line, verdict


def build_app(model, max_new_tokens: int, title: str):
    """The Gradio Blocks app around ``model`` (a :class:`DraftHeadsModel`)."""
    import gradio as gr

    legend = (f'<span class="dh-draft">accepted drafts</span> · <span class="dh-base">the base\'s own token of '
              f'each step</span>')
    with gr.Blocks(title="draftheads demo", analytics_enabled=False) as app:
        gr.Markdown(f"## draftheads demo\n{title}")
        prompt = gr.Textbox(label="Prompt", lines=3, elem_id="prompt",
                            placeholder="Ask something, then press Generate (or Shift+Enter)")
        button = gr.Button("Generate", variant="primary", elem_id="generate")
        with gr.Row():
            with gr.Column():
                gr.Markdown(f"### draftheads\n{legend}")
                fast_html = gr.HTML(answer_html([]), elem_id="draftheads-answer")
                fast_speed = gr.Markdown(elem_id="draftheads-speed")
            with gr.Column():
                gr.Markdown("### plain `generate`\nthe base alone, same prompt, same dtype")
                plain_html = gr.HTML(answer_html([]), elem_id="plain-answer")
                plain_speed = gr.Markdown(elem_id="plain-speed")
        verdict = gr.Markdown(elem_id="verdict")

        def run(text):
            yield from answer(model, text, max_new_tokens)

        outputs = [fast_html, fast_speed, plain_html, plain_speed, verdict]
        button.click(run, [prompt], outputs, concurrency_limit=1)
        prompt.submit(run, [prompt], outputs, concurrency_limit=1)
    return app


def check_port(host: str, port: int) -> None:
    """One line before the model loads when the address cannot be served."""
    if not 0 < port < 65536:
        raise InputError(f"--port must be 1-65535, got {port}.")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise InputError(f"cannot serve on {host}:{port} ({err.strerror or err}): pick another --port "
                             "(or stop what is using it).") from None


def cmd_demo(args) -> int:
    """``draftheads demo``: check the options and that Gradio is installed, load the model, serve."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise InputError("draftheads demo needs Gradio: pip install 'draftheads[demo]' (or pip install gradio).") \
            from None
    check_port(args.host, args.port)
    from .bench import warm_up_paths
    from .decoding import DraftHeadsModel
    from .arguments import find_heads

    heads = find_heads(args.heads)
    model = DraftHeadsModel.from_pretrained(heads, base_name_or_path=args.base, dtype=args.dtype, tree=args.tree,
                                            sources=args.sources or "auto", review=args.review)
    warm_up_paths(model)  # before the page counts anything
    sources = " + ".join(model.sources) or "none (plain decoding)"
    title = (f"base `{args.base or 'SmolLM2-135M-Instruct (embedded)'}` · heads `{heads}` · "
             f"{str(model.base.dtype).removeprefix('torch.')} · drafting {sources} · "
             f"up to {args.max_new_tokens} new tokens, greedy")
    app = build_app(model, args.max_new_tokens, title)
    print(f"draftheads demo: http://{args.host}:{args.port} (Ctrl+C stops it)", file=sys.stderr, flush=True)
    app.queue().launch(server_name=args.host, server_port=args.port, share=False, inbrowser=False, quiet=True,
                       css=CSS, footer_links=[], show_error=True)
    return 0


def add_command(sub, common) -> None:
    """Register ``demo`` on the ``draftheads`` parser (``common``: --heads, --base, --dtype, ...)."""
    from .arguments import add_sources_option

    demo = sub.add_parser("demo", parents=[common], help="a local Gradio page: the answer streaming with accepted "
                                                         "drafts coloured, plain generate beside it, tokens/s and τ")
    add_sources_option(demo, help="who fills the trees, as for `draftheads generate` (default: the heads and every lookup "
                                   "source there is data for)")
    demo.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine only)")
    demo.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    demo.set_defaults(func=cmd_demo)
