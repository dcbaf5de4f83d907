"""The ``draftheads`` command. Each subcommand lives in its own module, which registers it
(``add_command``) and runs it:

- ``generate`` (:mod:`.generate_command`): stream an answer, report tokens/s, τ and the speedup;
- ``bench`` (:mod:`.bench_command`): plain HF greedy generate vs draftheads on a prompt file, JSON +
  PNG; with ``--batch-sizes``: batched HF generate vs every fixed tree vs the adaptive policy;
- ``train``, ``selfdistill`` (:mod:`.train_commands`): train heads from a recipe; let the base answer prompts;
- ``store build`` (:mod:`.store_command`): the lookup store from the base's own answers;
- ``export``, ``import-medusa``, ``card``, ``push`` (:mod:`.checkpoint_commands`): checkpoints that travel;
- ``env``, ``figures`` (:mod:`.report_commands`): what a bug report needs; the README's figures from results;
- ``demo`` (:mod:`draftheads.demo`): a local Gradio page.

:mod:`.parsing` holds the parser class and the options the subcommands share. Nothing imports the CLI
but its entry point and the tests: what the demo's page and the scripts share with it (``--heads``,
``--tree``, ``--sources``) is :mod:`draftheads.arguments`."""
from __future__ import annotations

import argparse

from ..arguments import renamed_sources_option
from ..core.errors import DraftheadsError
from . import (bench_command, checkpoint_commands, generate_command, report_commands, store_command,
               train_commands)
from .parsing import Parser, common_parser, fail


def build_parser() -> argparse.ArgumentParser:
    from ..demo import add_command as add_demo  # gradio itself is imported only when the demo runs

    parser = Parser(prog="draftheads", description="Faster generation from a Hugging Face causal LM: draft heads and "
                    "lookups propose, the base verifies, the output stays the base's own.",
                    epilog="every subcommand ends a bad argument with one `error:` line naming the fix")
    sub = parser.add_subparsers(dest="command", required=True)
    common = common_parser()
    generate_command.add_command(sub, common)
    bench_command.add_command(sub, common)
    train_commands.add_commands(sub)
    store_command.add_command(sub)
    report_commands.add_commands(sub)
    checkpoint_commands.add_commands(sub)
    add_demo(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Every subcommand runs under one catch: a :class:`DraftheadsError` (whatever its kind:
    checkpoint, store, recipe, data, prompt, input...) or an OS error on a path the user gave
    ends the command with one ``error:`` line on stderr and exit status 2, never a traceback."""
    args = parse_args(argv)
    if getattr(args, "max_new_tokens", 1) is None:
        args.max_new_tokens = 32 if getattr(args, "batch_sizes", None) else 128
    try:
        return args.func(args)
    except DraftheadsError as err:
        fail(str(err))
    except OSError as err:
        if err.filename is None:  # not about a path: a bug or the machine, keep the traceback
            raise
        fail(f"{err.filename}: {err.strerror or err}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, old option names (``--drafts``) read as the new ones (with a FutureWarning);
    a subcommand that ``passes_on`` gets the arguments it does not declare as ``args.options``."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passes_on", False):  # selfdistill: its own parser reads the rest
        args.options = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return renamed_sources_option(args)
    except DraftheadsError as err:
        fail(str(err))
