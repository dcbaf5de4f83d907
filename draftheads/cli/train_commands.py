"""``draftheads train`` (train draft heads from a recipe) and ``draftheads selfdistill`` (let the
base answer training prompts: the data ``train`` and ``store build`` read). Both run the training
package's own entry points (:func:`draftheads.training.train.main`,
:func:`draftheads.training.data.self_distillation.main`); a bad argument still ends in one
``error:`` line."""
from __future__ import annotations

import argparse
import contextlib
import io
import re

from .parsing import fail

#: how the self-distillation parser names itself in its usage and errors (the module's path)
SELFDISTILL_PROG = re.compile(r"python -m draftheads\.training\.[\w.]*self_distillation")


def cmd_train(args) -> int:
    """Single process here; for several, use ``accelerate launch ... -m draftheads.training.train``."""
    from ..training.train import main as train_main

    return train_main([args.recipe, *args.overrides])


def parse_selfdistill(argv: list[str]) -> str | None:
    """Parse ``argv`` as ``selfdistill`` reads it, before any work: None when it runs; its help
    text for ``--help``; a bad argument ends the command in one ``error:`` line."""
    from ..training.data.self_distillation import parse_selfdistill_args

    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            parse_selfdistill_args(argv)
    except SystemExit as done:
        text = SELFDISTILL_PROG.sub("draftheads selfdistill", said.getvalue())
        if done.code in (0, None):
            return text
        problem = text.strip().splitlines()[-1].removeprefix("draftheads selfdistill: error: ")
        fail(f"draftheads selfdistill: {problem} (see `draftheads selfdistill --help`)")
    return None


def cmd_selfdistill(args) -> int:
    from ..training.data.self_distillation import main as selfdistill_main

    text = parse_selfdistill(args.options)
    if text is not None:
        print(text, end="")
        return 0
    return selfdistill_main(args.options)


def add_commands(sub) -> None:
    """Register ``train`` and ``selfdistill`` on the ``draftheads`` parser."""
    train = sub.add_parser("train", help="train draft heads from a recipe (same as python -m draftheads.training.train)")
    train.add_argument("recipe", help="recipes/<name>.yaml")
    train.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value recipe overrides, e.g. --train.lr 5e-4")
    train.set_defaults(func=cmd_train)
    distill = sub.add_parser("selfdistill", add_help=False,
                             help="let the base answer a prompt set (resumable; the data of `train` and `store build`; "
                                  "`draftheads selfdistill --help` lists its options)")
    distill.set_defaults(func=cmd_selfdistill, passes_on=True)  # its options: :func:`parse_selfdistill`
