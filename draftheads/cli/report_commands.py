"""``draftheads env`` (what a bug report needs: versions, CPU capability, dtypes, packing, caches)
and ``draftheads figures`` (the README's figures, written or checked from the recorded results by
:mod:`draftheads.readme_figures`)."""
from __future__ import annotations

from ..decoding.base.dtypes import DTYPE_CHOICES
from ..core.errors import InputError


def cmd_env(args) -> int:
    from ..environment import main as env_main

    return env_main(as_json=args.json, base=args.base, dtype=args.dtype)


def figures_argv(readme: str, results: str, check: bool) -> list[str]:
    """The ``figures`` options as :func:`draftheads.readme_figures.main` reads them."""
    return ["--readme", readme, "--results", results, *(["--check"] if check else [])]


def cmd_figures(args) -> int:
    try:
        from ..readme_figures import main as figures_main  # imported here: the CLI runs without it
    except ModuleNotFoundError as err:
        if err.name != "draftheads.readme_figures":
            raise
        raise InputError("draftheads figures needs draftheads.readme_figures, which this install lacks: "
                         "reinstall draftheads from a checkout that has it (pip install -e .).") from None
    return figures_main(figures_argv(args.readme, args.results, args.check))


def add_commands(sub) -> None:
    """Register ``env`` and ``figures`` on the ``draftheads`` parser."""
    env = sub.add_parser("env", help="what to paste into a bug report: versions, CPU capability, dtypes, packing, caches")
    env.add_argument("--json", action="store_true", help="print JSON")
    env.add_argument("--base", default=None, help="also load this base (dir / Hub id / .gguf / gemma3-270m) and report "
                     "what of its architecture the decoder honours and which fast paths it runs for it")
    env.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="with --base: the dtype to load it in")
    env.set_defaults(func=cmd_env)
    figures = sub.add_parser("figures", help="write the README's figures from the recorded results (--check: only "
                                             "compare, exit 1 if the README is out of date)")
    figures.add_argument("--readme", default="README.md", help="the README to write or check (default README.md)")
    figures.add_argument("--results", default="results", help="the results folder its figures come from (default results)")
    figures.add_argument("--check", action="store_true", help="only compare; exit 1 if the README is out of date")
    figures.set_defaults(func=cmd_figures)
