"""The decoding options of a :class:`~.generate.DraftHeadsModel`, in one typed, checked object.

``DraftHeadsModel.from_pretrained(path, tree=4, sources="heads")`` builds a :class:`DecodingConfig`
from its keyword arguments; ``from_pretrained(path, decoding=DecodingConfig(tree=4))`` passes one
(keyword arguments given beside it win, as in transformers' ``generation_config``). The model
keeps it as ``model.decoding``. What is read when:

- ``tree``, ``calibration``, ``packed_attention``, ``packed_linears``, ``direct_body``: when the model is built;
- ``sources``, ``lookup_store``, ``review``, ``merged_offer_scale``, ``heads_offer_scale``,
  ``per_row_counts``: when the drafting is built (:func:`~.builder.build_decoding`);
- ``finished_rows``, ``delegate_plain``: at every ``generate`` call.

Another configuration over the same base and heads is ``model.with_decoding(config)``: a light
model sharing both, built whole by the same builder.

:meth:`DecodingConfig.to_dict` / :meth:`DecodingConfig.from_dict` are a symmetric pair (JSON-plain).
``drafts=`` is the old name of ``sources=``: :meth:`DecodingConfig.replace` (and so ``from_pretrained``)
still takes it, with a FutureWarning (:func:`renamed_sources`).
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from .calibration import CalibrationConfig
from .drafters import check_review, check_store_argument, parse_sources
from ..core.errors import InputError, InputTypeError
from .input_checks import check_count, parse_tree_option
from .tree import Tree, tree_from_paths

#: ``sources=`` value that lets the model choose its sources when the heads load
#: (:func:`~.drafters.auto_sources`: the heads and every lookup source there is data for)
AUTO = "auto"
#: what ``finished_rows`` may be: "shrink" drops a finished row from the batch (cache rows
#: included); "mask" keeps verifying its (ignored) tree, kept as the comparison point.
#: Shrinking is faster. evidence: results/batch/adaptive_fp32
FINISHED_ROWS = ("shrink", "mask")
#: In merged drafting (heads + lookups) the heads offer the stored tree for this many times the
#: heads-alone default budget: that default is priced as if every node were verified, while a
#: merged step verifies only the nodes the width chooser finds worth their cost, so a larger
#: offer costs only the heads' proposal and lets the chooser weigh the heads' second choices
#: against the lookups' (a scale of 4 lost on the heads' proposal time)
MERGED_OFFER_SCALE = 2
#: The heads alone may draw each step's tree from the stored tree of this many times the policy's
#: node budget: they fill it, and each row verifies the budget's best nodes by calibrated confidence
#: (their probabilities, scaled per depth by online hit rates) — a dynamic tree, as EAGLE-2 draws
#: one. 1 (the default): the policy's stored tree as it is, Medusa's and Hydra's static tree. On 2
#: CPU cores with the shipped SmolLM2 heads a scale of 4 raised τ 2.6-3.1 % but the larger offer's
#: drafting (+2.2-2.6 ms a step on a ~43 ms step) cost more than that saved: 0.95-0.985× the tokens/s
#: (scale 2: 0.96-0.97×). It pays where the heads' drafting is small beside the base's forward.
#: evidence: results/trees/dynamic_trees
HEADS_OFFER_SCALE = 1

#: ``tree=``: None (the checkpoint's default, priced on this machine by ``from_pretrained``),
#: "adaptive", a node budget, a :class:`~.tree.Tree` or a :class:`~.policy.TreePolicy`
TreeOption = Union[None, int, str, Tree, Any]


@dataclass(frozen=True)
class DecodingConfig:
    """How a :class:`~.generate.DraftHeadsModel` decodes (see the module docstring for when
    each field is read). Every field is checked on construction, and in :meth:`replace`."""

    #: which tree each step verifies: None (the stored tree this machine's quick calibration
    #: prices best), "adaptive" (per live batch, :class:`~.policy.AdaptivePolicy`), a node
    #: budget ≥ 0 (0: plain decoding), a Tree or any TreePolicy
    tree: TreeOption = None
    #: who fills the trees: "auto", or a comma-separated mix (str or tuple) of the sources
    #: (:func:`~.drafters.parse_sources`); kept as the checked tuple of names
    sources: str | tuple[str, ...] = AUTO
    #: the model store the "store"/"stats" sources read (None: the one beside the heads); a
    #: store named is opened and checked even when the sources do not use it
    lookup_store: str | Path | None = None
    #: the heads rescore lookup drafts before they take a slot (the vertical cascade)
    review: bool = False
    #: the grid ``tree="adaptive"`` measures on first use (None: :class:`~.calibration.CalibrationConfig`)
    calibration: CalibrationConfig | None = None
    #: grouped-query SDPA without copying the KV cache (decoding/attention.py)
    packed_attention: bool = True
    #: oneDNN-packed weights for the decoder's own forwards (heads/linear.py)
    packed_linears: bool = True
    #: tree steps of a Llama-form base run directly over its modules (decoding/base/direct.py)
    direct_body: bool = True
    #: what a row that finished while others decode does: one of :data:`FINISHED_ROWS`
    finished_rows: str = "shrink"
    #: when the policy says at the start that speculation does not pay for this batch (see
    #: ``AdaptivePolicy.prefers_plain``), run the base's own ``generate`` instead of the loop's
    #: plain steps (vLLM's ``speculative_disable_by_batch_size``). Off by default: a plain loop
    #: step costs what the base's does, and only the loop drops finished rows from the batch and
    #: goes back to trees once the live batch has shrunk to where they pay (the base's generate
    #: keeps computing finished rows)
    delegate_plain: bool = False
    #: see :data:`MERGED_OFFER_SCALE`
    merged_offer_scale: int = MERGED_OFFER_SCALE
    #: see :data:`HEADS_OFFER_SCALE`; a tree given as a Tree or a policy is verified as given
    heads_offer_scale: int = HEADS_OFFER_SCALE
    #: merged drafting: each row its own node count under one batch budget (vLLM's adaptive
    #: verification budget, for trees) instead of one width for every row
    per_row_counts: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the checked, normalized values replace the given ones
        set_(self, "tree", parse_tree_option(self.tree))
        auto = isinstance(self.sources, str) and self.sources.strip().lower() == AUTO
        set_(self, "sources", AUTO if auto else parse_sources(self.sources))
        if auto:  # auto's sources are known once the heads load; the type is checked now
            if not isinstance(self.review, bool):
                check_review(self.review, ())
        else:
            check_review(self.review, self.sources)
        check_store_argument(self.lookup_store)
        if self.calibration is not None and not isinstance(self.calibration, CalibrationConfig):
            raise InputTypeError(f"calibration={self.calibration!r}: pass a draftheads.decoding.calibration."
                                 "CalibrationConfig (the grid tree='adaptive' measures) or None (the default grid).")
        for name in ("packed_attention", "packed_linears", "direct_body", "delegate_plain", "per_row_counts"):
            if not isinstance(getattr(self, name), bool):
                raise InputTypeError(f"{name}={getattr(self, name)!r}: expected True or False.")
        if self.finished_rows not in FINISHED_ROWS:
            raise InputError(f"finished_rows={self.finished_rows!r}: expected 'shrink' (finished rows leave the "
                             "batch) or 'mask' (their trees are verified and ignored).")
        check_count("merged_offer_scale", self.merged_offer_scale, 1)
        check_count("heads_offer_scale", self.heads_offer_scale, 1)

    def replace(self, **changes) -> "DecodingConfig":
        """A copy with ``changes`` (checked like the constructor's arguments; ``drafts=``: see
        :func:`renamed_sources`)."""
        changes = renamed_sources(changes)
        unknown = sorted(set(changes) - set(field_names()))
        if unknown:
            raise InputTypeError(f"unknown decoding option(s) {', '.join(unknown)}; the options are "
                                 f"{', '.join(field_names())}.")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """JSON-plain fields; :meth:`from_dict` reads them back to an equal config. A tree given
        as a Tree is written as its rank paths; a policy object cannot be written."""
        out = {f: getattr(self, f) for f in field_names()}
        out["tree"] = _tree_to_json(self.tree)
        out["sources"] = self.sources if self.sources == AUTO else list(self.sources)
        out["lookup_store"] = None if self.lookup_store is None else str(self.lookup_store)
        if self.calibration is not None:
            out["calibration"] = {k: list(v) if isinstance(v, tuple) else v
                                  for k, v in dataclasses.asdict(self.calibration).items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "DecodingConfig":
        """The config :meth:`to_dict` wrote (missing fields take their defaults). Every field is
        checked here, the nested tree and calibration grid included: a bad one is one line naming it."""
        if not isinstance(data, dict):
            raise InputTypeError(f"a decoding config is a dict of options, got {type(data).__name__}.")
        fields = dict(data)
        if OLD_SOURCES in fields and "sources" not in fields:  # a config saved before sources= had its name
            fields["sources"] = fields.pop(OLD_SOURCES)
        unknown = sorted(set(fields) - set(field_names()))
        if unknown:
            raise InputError(f"unknown decoding option(s) {', '.join(unknown)} in the saved config; the options "
                             f"are {', '.join(field_names())}.")
        if isinstance(fields.get("tree"), dict):
            fields["tree"] = _tree_from_json(fields["tree"])
        if isinstance(fields.get("sources"), list):
            fields["sources"] = tuple(fields["sources"])
        if fields.get("calibration") is not None:
            fields["calibration"] = _calibration_from_json(fields["calibration"])
        return cls(**fields)


#: the old name of ``sources=``, still accepted (with a FutureWarning) where options are given
OLD_SOURCES = "drafts"


def renamed_sources(options: dict) -> dict:
    """``options`` with the old ``drafts=`` given as ``sources=``: a FutureWarning says so, and
    giving both is one error line (which would win is not for us to guess)."""
    if OLD_SOURCES not in options:
        return options
    options = dict(options)
    value = options.pop(OLD_SOURCES)
    if "sources" in options:
        raise InputError("sources= and drafts= both given: drafts= is the old name of sources=; pass sources= only.")
    warnings.warn("drafts= is now sources=; drafts= still works but will be removed: pass sources= instead.",
                  FutureWarning, stacklevel=user_frame())
    options["sources"] = value
    return options


def user_frame() -> int:
    """The ``stacklevel`` that names the first caller outside draftheads (a warning points at the user's line)."""
    package = __name__.split(".")[0]
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == package:
        frame, level = frame.f_back, level + 1
    return level


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(DecodingConfig))


def _tree_to_json(tree: TreeOption):
    if tree is None or isinstance(tree, (int, str)):
        return tree
    if isinstance(tree, Tree):
        return {"paths": [list(p) for p in tree.paths]}
    raise InputError(f"decoding.tree is a {type(tree).__name__} object, which a saved config cannot hold; save "
                     "tree='adaptive', a node budget or a Tree instead.")


def _tree_from_json(data: dict) -> Tree:
    """A saved tree: ``{"paths": [[0], [1], [0, 0]]}``, its rank paths (what :meth:`DecodingConfig.to_dict` writes)."""
    if set(data) != {"paths"} or not isinstance(data["paths"], list) or \
            any(not isinstance(p, list) for p in data["paths"]):
        raise InputError(f"tree={data!r} in the saved config: a saved tree is {{'paths': [[0], [1], [0, 0]]}} (a list "
                         "of rank paths, each a list of ranks); fix it or save tree= as a node budget.")
    try:
        return tree_from_paths([tuple(p) for p in data["paths"]])
    except ValueError as err:
        raise InputError(f"tree.paths in the saved config: {err} Fix the paths or save tree= as a node budget.") \
            from None


def _calibration_from_json(data: Any) -> CalibrationConfig:
    """A saved ``calibration``: an object of :class:`~.calibration.CalibrationConfig`'s fields
    (missing ones take their defaults; the grid checks its own values)."""
    names = [f.name for f in dataclasses.fields(CalibrationConfig)]
    if not isinstance(data, dict):
        raise InputTypeError(f"calibration={data!r} in the saved config: expected an object of calibration options "
                             f"({', '.join(names)}) or null (the default grid).")
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise InputError(f"unknown calibration option(s) {', '.join(map(str, unknown))} in the saved config; the "
                         f"options are {', '.join(names)}.")
    return CalibrationConfig(**data)


def decoding_config(decoding: DecodingConfig | None = None, **options) -> DecodingConfig:
    """``decoding`` (default: all defaults) with the keyword ``options`` applied over it: what
    ``from_pretrained`` and ``DraftHeadsModel(...)`` build from their arguments."""
    if decoding is None:
        return DecodingConfig().replace(**options) if options else DecodingConfig()
    if not isinstance(decoding, DecodingConfig):
        raise InputTypeError(f"decoding={decoding!r}: pass a draftheads.decoding.config.DecodingConfig or None, "
                             "or the options as keyword arguments.")
    return decoding.replace(**options) if options else decoding


def split_options(kwargs: dict) -> tuple[dict, dict]:
    """``from_pretrained``'s keyword arguments → (decoding options, the rest: Hub arguments)."""
    names = set(field_names()) | {OLD_SOURCES}
    return ({k: v for k, v in kwargs.items() if k in names}, {k: v for k, v in kwargs.items() if k not in names})
