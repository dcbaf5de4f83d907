"""The command line's own parsing: :class:`Parser`, whose usage errors end the command in one
``error:`` line as every other error does (:func:`fail`), the options ``generate``, ``bench`` and
``demo`` share (:func:`common_parser`), counts and lists of counts, and prompt files read with
``--limit`` checked."""
from __future__ import annotations

import argparse
import sys

from ..arguments import tree_argument
from ..core.errors import one_line
from ..decoding.base.dtypes import DTYPE_CHOICES
from ..decoding.input_checks import check_count
from ..prompts import read_prompts as read_prompt_files

#: the head checkpoint ``generate``, ``bench`` and ``demo`` load unless ``--heads`` says otherwise
DEFAULT_HEADS = "checkpoints/smollm2-135m-hydra"


def fail(message: str) -> None:
    """End the command: one ``error:`` line on stderr, exit status 2 (argparse's for usage errors)."""
    print(f"error: {one_line(message)}", file=sys.stderr)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors: a usage error is one ``error:`` line naming the
    option and where the usage is (``--help``), exit status 2, like every other error."""

    def error(self, message: str):
        fail(f"{self.prog}: {message} (see `{self.prog} --help`)")


def common_parser() -> Parser:
    """The options ``generate``, ``bench`` and ``demo`` share (``parents=[common_parser()]``)."""
    common = Parser(add_help=False)
    common.add_argument("--heads", default=DEFAULT_HEADS, help="head checkpoint directory, or 'none' for plain decoding")
    common.add_argument("--base", default=None, help="base model dir / Hub id / .gguf (default: embedded SmolLM2)")
    common.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="'auto' (default): the base's native dtype where this hardware computes it natively "
                             "(bfloat16 for SmolLM2 on CPUs with AVX512-BF16/AMX and on GPUs), else float32")
    common.add_argument("--tree", type=tree_argument, default=None,
                        help="'adaptive' (choose per live batch size from this machine's calibrated cost model; "
                             "first use calibrates for ~1-2 min, then cached) or a tree node budget "
                             "(default: the checkpoint's)")
    common.add_argument("--review", action="store_true",
                        help="vertical cascade: the heads rescore lookup drafts before they take verification "
                             "slots (with --sources mixing heads and lookups; the bench then also runs the reviewed mix)")
    common.add_argument("--max-new-tokens", type=count_argument(1), default=None,
                        help="default 128 (32 for the batched bench, which runs ~9 strategies x 6 batch sizes)")
    return common


def count_argument(minimum: int = 1):
    """argparse ``type=`` for an integer option ≥ ``minimum``."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer ≥ {minimum}, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be ≥ {minimum}, got {number}")
        return number
    return parse


def int_list(value: str, minimum: int = 0) -> list[int]:
    """argparse ``type=``: comma-separated integers, each ≥ ``minimum``."""
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not items or min(items) < minimum:
        raise argparse.ArgumentTypeError(f"expected integers ≥ {minimum}, got {value!r}")
    return items


def positive_list(value: str) -> list[int]:
    return int_list(value, 1)


def read_prompts(paths, limit: int | None) -> list[dict]:
    """:func:`draftheads.prompts.read_prompts` for the command line: ``--limit`` checked as the
    API checks it (a prompt-file problem names file and line; the CLI's ``main`` prints it)."""
    if limit is not None:
        check_count("--limit", limit)
    return read_prompt_files(paths, limit)
