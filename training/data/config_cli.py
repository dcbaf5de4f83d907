"""One command-line reader for the data jobs' dataclass configs: a ``--flag`` per field (a list
field takes several values; int and float fields are typed; a false bool is a switch; any other is
a string), and one ``main`` that turns the jobs' own errors into one line and exit status 2."""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Callable, TypeVar

Config = TypeVar("Config")


def parse_config(cls: type[Config], argv: list[str] | None, prog: str, doc: str,
                 required: tuple[str, ...] = ()) -> Config:
    """``cls`` filled from ``argv``; ``doc``'s first paragraph is the help's description (a bool
    field that is false by default is a switch: ``--predicted``)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    defaults = cls()
    for f in fields(cls):
        flag, default = "--" + f.name.replace("_", "-"), getattr(defaults, f.name)
        if isinstance(default, list):
            parser.add_argument(flag, nargs="*", default=default)
        elif default is False:
            parser.add_argument(flag, action="store_true")
        else:
            kind = type(default) if isinstance(default, (int, float)) else str
            parser.add_argument(flag, type=kind, default=default, required=f.name in required)
    return cls(**vars(parser.parse_args(argv)))


def run_cli(job: Callable[[Config], int], config: Config, errors: tuple[type[Exception], ...]) -> int:
    """``job(config)``; one of ``errors`` is printed as ``error: …`` and exits 2."""
    try:
        return job(config)
    except errors as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
