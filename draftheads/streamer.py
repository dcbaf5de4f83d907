"""A text streamer that shows which tokens came from accepted drafts (as EAGLE's demo does):
tokens the base accepted from the draft tree are coloured, the base's own token of each step
(the bonus) is plain. Plain text when the stream is not a terminal.

``DraftHeadsModel.generate`` calls ``put_step(tokens, drafted)`` on a streamer that has it
(``drafted``: how many of ``tokens`` were accepted drafts, always the first ones), and
transformers' ``put`` otherwise, so any transformers streamer still works.
"""
from __future__ import annotations

import sys
from typing import TextIO

import torch

DRAFT_COLOUR = "\033[32m"  # green: accepted drafts
RESET = "\033[0m"


class DraftColourStreamer:
    """Streams the answer (not the prompt) to ``stream``; accepted drafts in colour on a tty."""

    def __init__(self, tokenizer, stream: TextIO | None = None, colour: bool | None = None):
        self.tokenizer = tokenizer
        self.stream = stream if stream is not None else sys.stdout
        self.colour = self.stream.isatty() if colour is None else colour
        self.tokens: list[int] = []
        self.printed = ""  # decoded text already written
        self.drafted_tokens = 0
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        """transformers' protocol: the first call carries the prompt (skipped), later calls the
        base's own tokens."""
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.put_step(value, 0)

    def put_step(self, tokens: torch.Tensor, drafted: int) -> None:
        """``tokens`` (K,) emitted by one step, the first ``drafted`` of them accepted drafts."""
        self.prompt_seen = True
        for i, token in enumerate(torch.as_tensor(tokens).reshape(-1).tolist()):
            self.tokens.append(int(token))
            self.drafted_tokens += int(i < drafted)
            self._write(i < drafted)

    def _write(self, drafted: bool) -> None:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return
        new = text[len(self.printed):] if text.startswith(self.printed) else text
        self.printed = text
        if new:
            self.stream.write(f"{DRAFT_COLOUR}{new}{RESET}" if drafted and self.colour else new)
            self.stream.flush()

    def end(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
