"""The one interface every draft-head family implements.

A head family is a plain ``nn.Module`` that turns the base model's last hidden state into
draft logits through the base's *frozen, shared* LM head. The LM head (and the input
embedding table, for families that read draft tokens) is handed in with :meth:`bind`; it is
never a parameter of the heads, never trained and never saved.

This module is the ground floor of the package: it imports nothing from ``decoding`` or
``training``. Trees reach the heads as plain tensors (:class:`TreeSpec`). The checkpoint
format (``save_pretrained`` / ``from_pretrained``) lives in :mod:`.checkpoint`.
"""
from __future__ import annotations

import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from torch import nn

from .checkpoint.hub import upload_checkpoint
from .checkpoint.io import load_heads, save_heads
from ..core.errors import CheckpointError
from .head_config import HeadConfig
from ..core.content import FingerprintMemo, fingerprint_of
from ..core.kept import keeping
from .family_options import FamilyOptions
from .fusion import FeatureFusion, feature_width


class FastReadout(Protocol):
    """A faster draft readout a decoder hands the heads (:meth:`DraftHeads.use_readout`): its
    ``product`` is None where it has none (then the plain product). Heads import nothing from
    ``decoding``, so they take the decoder's packed copy of their draft rows as this interface."""

    def product(self, states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None: ...
    def clear(self) -> None: ...
    def drop_stale(self, weight: torch.Tensor, memo: FingerprintMemo | None = None) -> bool: ...


#: heads → their fast draft readout, kept beside them: in their ``__dict__``, the decoder's
#: opaque packed tensors would make ``deepcopy``, ``pickle`` and ``torch.save`` of them fail
_READOUTS: "weakref.WeakKeyDictionary[nn.Module, FastReadout]" = weakref.WeakKeyDictionary()


@dataclass
class TreeSpec:
    """A token-tree shape as plain tensors (slot 0 is the root = the token the base just
    produced). ``rank[n]`` is the top-k rank the node takes among its parent's candidates;
    ``depth[n]`` is the draft depth (1 = next-next token, drafted by head 0)."""

    parent: torch.Tensor  # (N,) long, -1 for the root
    depth: torch.Tensor  # (N,) long
    rank: torch.Tensor  # (N,) long, 0 for the root

    @property
    def num_nodes(self) -> int:
        return int(self.parent.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())


@dataclass
class SharedBase:
    """The frozen base tensors a head reads. Not an ``nn.Module`` on purpose: holding it
    does not register the LM head as a parameter of the heads."""

    lm_head_weight: torch.Tensor  # (V, d)
    embed_weight: torch.Tensor | None = None  # (V, d)


class DraftHeads(nn.Module):
    """Base class of every family. Subclasses set ``family`` and implement
    :meth:`forward` (training: hidden → per-head draft logits) and :meth:`propose`
    (decoding: fill a token tree)."""

    family: ClassVar[str] = ""
    #: how reports and model cards name the family ("Hydra++"); empty = ``family`` itself
    display_name: ClassVar[str] = ""
    #: True when depth d needs the tokens drafted at depths < d (Hydra-style families).
    sequential: ClassVar[bool] = False
    #: True when the heads read their own summary of the generated context (Hydra++'s prefix
    #: layer): the decoder then passes each step's verified hidden states through
    #: ``contextualize(hidden, positions, mask, cache)`` with a cache it keeps like the base's.
    contextual: ClassVar[bool] = False
    #: True when a contextual family's layer pairs each position's state with the token after it
    #: (EAGLE-3): the decoder passes ``contextualize(..., tokens=)`` each slot's next token, known
    #: once a step's tokens are accepted
    reads_next_tokens: ClassVar[bool] = False
    #: True when :meth:`propose` attends over the family's own context (EAGLE-3): the decoder passes
    #: ``propose(..., context=)`` what :class:`draftheads.decoding.head_state.HeadState` keeps
    drafts_in_context: ClassVar[bool] = False
    #: True when the family can give each head its own vocabulary projection (``owns_lm_head``)
    supports_owned_lm_head: ClassVar[bool] = False
    #: the dataclass of the family's options (``config.options``; a recipe's ``heads.extra`` keys):
    #: a recipe key that is not one of its fields is a typo that would train with the default, so
    #: it is refused
    options_class: ClassVar[type[FamilyOptions]] = FamilyOptions

    def __init__(self, config: HeadConfig):
        super().__init__()
        if config.owns_lm_head and not self.supports_owned_lm_head:
            raise CheckpointError(f"The {self.family!r} family reads out through the base's shared LM head only; "
                                  "owns_lm_head=True is supported by the 'medusa' family.")
        self.config = config
        #: the learned fusion of the base layers the heads read (:mod:`.fusion`); None: the final state only
        self.fusion = FeatureFusion(config.hidden_size, len(config.feature_layers)) if config.feature_layers else None
        self.register_buffer("vocab_ids", torch.arange(config.draft_vocab_size or config.vocab_size), persistent=True)
        self._shared: SharedBase | None = None
        self._draft_weights: dict[torch.dtype, torch.Tensor] = {}  # draft rows per dtype (see draft_weight)
        self._draft_source: torch.Tensor | None = None  # the LM head's fingerprint when they were made
        #: dtype of the draft readout (None = the states' dtype). Drafts are only proposals —
        #: the base verifies them in its own dtype — so a decoder may read out in bfloat16,
        #: which halves the LM-head rows read per call (set by ``DraftHeadsModel``, never in training).
        self.draft_dtype: torch.dtype | None = None
        self._draft_inverse: torch.Tensor | None = None  # base id → draft index (see draft_index)
        #: the local folder :meth:`from_pretrained` read the heads from (None: built or imported in
        #: memory); files shipped beside the weights (a lookup store) are found there
        self.checkpoint_dir: Path | None = None

    # -- the frozen base parts -------------------------------------------------------------
    def bind(self, lm_head_weight: torch.Tensor, embed_weight: torch.Tensor | None = None) -> "DraftHeads":
        if lm_head_weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise CheckpointError(
                f"These heads expect an LM head of shape ({self.config.vocab_size}, {self.config.hidden_size}) "
                f"but the base has {tuple(lm_head_weight.shape)}: the checkpoint was made for another base model.")
        with keeping():
            self._shared = SharedBase(lm_head_weight.detach(), None if embed_weight is None else embed_weight.detach())
        self._draft_weights = {}
        if self in _READOUTS:  # its copy was made from the rows of the LM head bound before
            _READOUTS[self].clear()
        return self

    @property
    def shared(self) -> SharedBase:
        if self._shared is None:
            raise RuntimeError("Heads are not bound to a base model: call heads.bind(base.lm_head.weight, ...) first.")
        return self._shared

    def draft_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows of the frozen LM head for the draft vocabulary in ``dtype`` (default: the LM
        head's), gathered and cast once per dtype and cached (a copy per call would cost more
        than the matmul); for the full vocabulary in the LM head's dtype it is the LM head itself."""
        weight = self.shared.lm_head_weight
        dtype = dtype or weight.dtype
        if not self.config.draft_vocab_size and dtype == weight.dtype:
            return weight
        cached = self._draft_weights.get(dtype)
        if cached is None or cached.device != weight.device:
            with keeping():  # training multiplies by it later (core/kept.py)
                if not self._draft_weights:
                    self._draft_source = fingerprint_of(weight)
                rows = weight.index_select(0, self.vocab_ids.to(weight.device)) if self.config.draft_vocab_size else weight
                cached = self._draft_weights[dtype] = rows.to(dtype)
        return cached

    def readout(self, states: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary through the shared LM head (in ``draft_dtype``
        when one is set; through a packed copy of the rows when the decoder asked for it)."""
        dtype = self.draft_dtype or states.dtype
        weight = self.draft_weight(dtype)
        fast = _READOUTS.get(self)
        if fast is not None and not torch.is_grad_enabled():
            logits = fast.product(states, weight)
            if logits is not None:
                return logits
        return states.to(dtype) @ weight.t()

    def use_readout(self, fast: FastReadout) -> None:
        """Decoding only: read drafts out through ``fast`` (the decoder's packed copy of the draft
        rows, :func:`draftheads.decoding.base.packing.use_packed_heads`) where it has a product.
        Drafts only propose, so their rounding never changes an output. Kept beside the heads
        (nothing in them changes); a readout already set stays."""
        if self not in _READOUTS:
            _READOUTS[self] = fast

    def drop_stale_copies(self, memo: FingerprintMemo | None = None) -> None:
        """Before a decoding call: the draft rows gathered or cast from the shared LM head
        (:meth:`draft_weight`) and the fast readout's copy are made again where the weight they came
        from changed since — through ``.data`` too, which changes neither a tensor's storage nor
        its version."""
        if self._shared is None:
            return
        readout = _READOUTS.get(self)
        if self._draft_weights and not torch.equal(fingerprint_of(self._shared.lm_head_weight, memo),
                                                   self._draft_source):
            self._draft_weights = {}
            if readout is not None:
                readout.clear()
        elif readout is not None:
            readout.drop_stale(self.draft_weight(self.draft_dtype), memo)

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Input embeddings of base token ids from the frozen, shared table (never a copy), for
        families that read tokens: Hydra its drafted path, Amphista the root."""
        table = self.shared.embed_weight
        if table is None:
            raise RuntimeError(f"{type(self).__name__} read the base's input embeddings: bind them with "
                               "heads.bind(lm_head_weight, embed_weight).")
        return nn.functional.embedding(tokens.clamp(min=0), table).to(dtype)

    def to_vocab(self, draft_index: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary indices back to base token ids."""
        return self.vocab_ids[draft_index] if self.config.draft_vocab_size else draft_index

    @property
    def family_options(self) -> FamilyOptions:
        """``config.options``, refused when they are another family's (heads of one family built
        from a config of another: build them with ``build_heads(config)``)."""
        options = self.config.options
        if not isinstance(options, self.options_class):
            raise CheckpointError(f"{type(self).__name__} reads {self.options_class.__name__}, but the config holds "
                                  f"{type(options).__name__} (family {self.config.family!r}): set "
                                  f"HeadConfig(family={self.family!r}) or build the heads with build_heads(config).")
        return options

    @property
    def context_from_prompt(self) -> bool:
        """True when a ``contextual`` family's layer reads the whole prompt too (Hydra++ with
        ``prefix_context="sequence"``): the decoder's prefill then hands it every prompt state
        (:class:`draftheads.decoding.head_state.HeadState`); else its context starts at the
        last prompt token."""
        return False

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The base layers the heads read beside its final state (:mod:`.fusion`); () for the final state only."""
        return tuple(self.config.feature_layers)

    def read(self, features: torch.Tensor) -> torch.Tensor:
        """The heads' input → the state they draft from, (..., d): features (..., d · (1 + n)) — the
        base's final state then each of :attr:`feature_layers`' — through the learned fusion; a state of
        the base's width is read as it is (the final state, for heads that read only it; the fused
        state, for the family methods a decoder hands it to). Any other width is refused by name."""
        width = features.shape[-1]
        if width == self.config.hidden_size:
            return features
        if self.fusion is None or width != feature_width(self.config.hidden_size, self.config.feature_layers):
            raise ValueError(f"{type(self).__name__} read the base's final state"
                             + (f" and its layers {list(self.feature_layers)}" if self.feature_layers else "")
                             + f": (..., {feature_width(self.config.hidden_size, self.config.feature_layers)}) "
                             f"features, got width {width}; capture the layers the checkpoint's config.json names.")
        return self.fusion(features)

    @property
    def max_rank(self) -> int:
        """Largest top-k a node can ask for (exclusive)."""
        return self.config.draft_vocab_size or self.config.vocab_size

    # -- family API ----------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, **kwargs) -> torch.Tensor:  # pragma: no cover - abstract
        """hidden (..., d) → draft logits (..., K, V_draft); head k predicts token t+k+2. A family
        reads ``hidden`` through :meth:`read` first (features of several layers are fused there)."""
        raise NotImplementedError

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, tree: TreeSpec,
                with_probs: bool = False):  # pragma: no cover
        """hidden (B, d) of the last position in the cache, roots (B,) the token the base just
        produced; returns tree tokens (B, N) with column 0 = roots. ``with_probs``: also each
        node's draft probability given its parent (B, N) float32 (1 at the root), which a
        merged tree ranks head drafts by (:mod:`draftheads.decoding.drafters.merged`)."""
        raise NotImplementedError

    def path_logits(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """hidden (P, d) as ``propose`` reads it, tokens (P, K) = the root then the path's first
        K−1 drafts → draft logits (P, K, V_draft): head k's distribution of the path's (k+1)-th
        draft given what precedes it (families that do not read the path ignore it)."""
        return self(hidden, tokens=tokens)

    @torch.no_grad()
    def path_probs(self, hidden: torch.Tensor, tokens: torch.Tensor, context: object | None = None) -> torch.Tensor:
        """hidden (P, d), tokens (P, L+1) = a root then L ≤ K drafted tokens → (P, L) float32:
        the heads' probability of each draft given the root and the drafts before it (0 for a
        token outside the draft vocabulary). Someone else's drafts, reviewed by the heads: the
        vertical cascade (:class:`draftheads.decoding.drafters.merged.MergedDrafter`) reads it.
        ``context``: what heads that draft in their own context attend over, one row per path."""
        paths, length = tokens.shape[0], tokens.shape[1] - 1
        if not 0 <= length <= self.num_heads:
            raise ValueError(f"path_probs reviews at most {self.num_heads} drafts per path (the heads' depth), "
                             f"got {length}.")
        padded = torch.zeros(paths, self.num_heads, dtype=torch.long, device=tokens.device)
        padded[:, : min(length + 1, self.num_heads)] = tokens[:, : self.num_heads]
        extra = {"context": context} if self.drafts_in_context else {}
        logits = self.path_logits(hidden, padded, **extra)[:, :length].float()  # (P, L, V_draft)
        index = self.draft_index(tokens[:, 1:])
        chosen = logits.gather(-1, index.clamp(min=0)[..., None]).squeeze(-1)
        probs = (chosen - logits.logsumexp(-1)).exp()
        return torch.where(index >= 0, probs, torch.zeros_like(probs))

    def draft_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Base token ids → their index in the draft vocabulary, −1 where the heads cannot draft
        them (the inverse of :meth:`to_vocab`, built once)."""
        if not self.config.draft_vocab_size:
            return tokens
        inverse = self._draft_inverse
        if inverse is None or inverse.device != tokens.device:
            with keeping():
                inverse = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=tokens.device)
                inverse[self.vocab_ids.to(tokens.device)] = torch.arange(self.vocab_ids.numel(), device=tokens.device)
            self._draft_inverse = inverse
        return inverse[tokens]

    def top_candidates(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits (..., V_draft) → the k best base token ids (..., k), best first, and their
        softmax probabilities (..., k) float32 (one logsumexp, no full softmax)."""
        values, index = logits.topk(k, dim=-1)
        probs = (values.float() - logits.float().logsumexp(-1, keepdim=True)).exp()
        return self.to_vocab(index), probs

    def check_tree(self, tree: TreeSpec) -> None:
        """Refuse a tree the heads cannot fill, naming the offending depth or rank."""
        if tree.num_nodes > 1 and tree.max_depth > self.num_heads:
            raise ValueError(f"The tree is {tree.max_depth} deep but the checkpoint has only {self.num_heads} heads: "
                             f"use a tree of depth ≤ {self.num_heads}.")
        if int(tree.rank.max()) >= self.max_rank:
            raise ValueError(f"The tree asks for top-{int(tree.rank.max()) + 1} candidates but the heads "
                             f"draft from {self.max_rank} tokens.")

    # -- checkpoints -------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path, dtype: torch.dtype | None = torch.bfloat16,
                        card: str | None = None, files: dict[str, str] | None = None) -> Path:
        """Write the checkpoint folder :meth:`from_pretrained` reads: ``config.json`` +
        ``model.safetensors`` (float tensors in ``dtype``), the card ``README.md`` (``card``;
        default: a short one from the config) and any further text ``files`` ({name: content}),
        atomically (:func:`.checkpoint.io.save_heads`). Returns ``directory``."""
        return save_heads(self, directory, dtype, card, files)

    @classmethod
    def from_pretrained(cls, directory: str | Path, expected_fingerprint: dict | None = None,
                        dtype: torch.dtype = torch.float32, base_name: str | None = None,
                        **hub_kwargs) -> "DraftHeads":
        """The heads :meth:`save_pretrained` wrote to a local folder or a Hub id, of whatever family
        it records (called on a family class: that family only), in ``dtype``, in eval mode, with
        :attr:`checkpoint_dir` set. ``expected_fingerprint``: refuse heads made for another base
        (``base_name`` names it); ``hub_kwargs``: see :func:`.checkpoint.io.load_heads`."""
        heads = load_heads(directory, expected_fingerprint, dtype, base_name, **hub_kwargs)
        if not isinstance(heads, cls):
            raise CheckpointError(f"{heads.checkpoint_dir} holds {heads.family!r} heads, not {cls.family!r}: load it "
                                  "with DraftHeads.from_pretrained (any family).")
        return heads

    def push_to_hub(self, repo_id: str, dtype: torch.dtype | None = torch.bfloat16, card: str | None = None,
                    files: dict[str, str] | None = None, **hub_kwargs) -> str:
        """Upload exactly the folder :meth:`save_pretrained` writes to the Hub repo ``repo_id``
        (created if missing); ``hub_kwargs`` go to :func:`.checkpoint.hub.upload_checkpoint`. Returns the commit URL."""
        with tempfile.TemporaryDirectory(prefix="draftheads-push-") as tmp:
            folder = self.save_pretrained(Path(tmp) / "checkpoint", dtype=dtype, card=card, files=files)
            return upload_checkpoint(folder, repo_id, **hub_kwargs)


def cartesian_tokens(candidates: torch.Tensor, roots: torch.Tensor, tree: TreeSpec) -> torch.Tensor:
    """Medusa's Cartesian tree filling for families that draft every depth in one call:
    candidates (B, K, k) base token ids per head, best first → tree tokens (B, N); a node's
    token depends only on its depth and rank, column 0 holds the roots."""
    depth = (tree.depth.clamp(min=1) - 1).to(candidates.device)
    tokens = candidates[:, depth, tree.rank.to(candidates.device)]
    tokens[:, 0] = roots
    return tokens


def cartesian_probs(probs: torch.Tensor, tree: TreeSpec) -> torch.Tensor:
    """The same filling for the candidates' probabilities (B, K, k) → (B, N), 1 at the root."""
    filled = probs[:, (tree.depth.clamp(min=1) - 1).to(probs.device), tree.rank.to(probs.device)]
    filled[:, 0] = 1.0
    return filled
