"""``draftheads env`` (what a bug report needs: versions, CPU capability, dtypes, packing, caches)
and ``draftheads figures`` (the README's figures, written or checked from the recorded results by
:mod:`draftheads.readme_figures`)."""
from __future__ import annotations

from pathlib import Path

from ..decoding.base.dtypes import DTYPE_CHOICES
from ..core.errors import InputError, one_line
from ..heads.head_config import read_json_object


def cmd_env(args) -> int:
    from ..environment import main as env_main

    if args.base is not None:
        check_env_base(args.base)
    return env_main(as_json=args.json, base=args.base, dtype=args.dtype)


def check_env_base(base: str) -> None:
    """``env --base``, before anything loads: a local model folder (a GGUF's converted one
    included) must be a base the decoder can verify a tree on — not a heads folder, not a model
    whose layers are not attention (Mamba, ...). Each is one line naming the folder and the fix."""
    from ..decoding.base.architecture import UnsupportedBaseError, attention_layout
    from ..decoding.base.loading import check_base_path, resolve_base

    check_base_path(base)
    folder = Path(resolve_base(base)[0]).expanduser()
    if not (folder / "config.json").is_file():
        return  # a Hub id: load_base names what is wrong with it
    config = read_json_object(folder / "config.json", "a model's config", "save the model again.")
    if "family" in config and "model_type" not in config:
        raise InputError(f"--base {base} is a draft heads folder (its config.json names head family "
                         f"{config['family']!r}), not a base model: pass the base the heads were trained on, or "
                         f"use --heads {base} with draftheads generate/bench.")
    from transformers import AutoConfig

    try:
        attention_layout(AutoConfig.from_pretrained(folder))
    except UnsupportedBaseError as err:
        raise InputError(f"--base {base}: {err}") from None
    except (OSError, ValueError) as err:  # not a transformers model folder at all
        raise InputError(f"--base {base} is not a model transformers can read ({one_line(err)}): pass a causal "
                         "LM's folder, a .gguf file or a Hub id.") from None


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
