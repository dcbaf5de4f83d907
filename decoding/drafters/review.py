"""The vertical cascade: the heads review the lookups' drafts before they take verification slots."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ...heads import DraftHeads
from .candidates import Candidates
from .hitrate import HitRate, reviewed_bucket
from .interface import DraftState


def review(heads: DraftHeads, state: DraftState, tries: Sequence[Candidates], hitrate: HitRate) -> list[Candidates]:
    """The vertical cascade: the heads rescore each row's lookup trie before it takes slots.

    The heads read every root→node path once (one batched call over all rows' paths, cut at
    the heads' depth: a path to each node at depth K or to a shallower leaf covers its
    ancestors) and give each node within that depth the probability they would draft its
    token with; that probability's bin joins the node's hit-rate bucket
    (:func:`~.hitrate.reviewed_bucket`) and the trie is rescored. Deeper nodes keep
    their bucket (their path's product still carries the reviewed ancestors). Same nodes,
    same order: only the scores move."""
    depth_cap = heads.num_heads
    owners, chains, paths = [], [], []
    for b, trie in enumerate(tries):
        has_child = np.zeros(len(trie), dtype=bool)
        has_child[trie.parent[trie.parent >= 0]] = True
        for i in np.flatnonzero((trie.depth == depth_cap) | ((trie.depth < depth_cap) & ~has_child)):
            chain, node = [], int(i)
            while node >= 0:
                chain.append(node)
                node = int(trie.parent[node])
            owners.append(b)
            chains.append(chain[::-1])
            paths.append(trie.token[chain[::-1]].tolist())
    if not paths:
        return list(tries)
    tokens = torch.zeros(len(paths), 1 + max(map(len, paths)), dtype=torch.long, device=state.roots.device)
    for p, (b, path) in enumerate(zip(owners, paths)):
        tokens[p, 0] = state.roots[b]
        tokens[p, 1: 1 + len(path)] = torch.tensor(path)
    index = torch.tensor(owners, device=state.hidden.device)
    context = state.context.select(index) if heads.drafts_in_context and state.context is not None else None
    probs = heads.path_probs(state.hidden.index_select(0, index), tokens, context).cpu().numpy()  # (P, longest)
    reviewed = [np.full(len(trie), np.nan) for trie in tries]
    for p, (b, chain) in enumerate(zip(owners, chains)):
        reviewed[b][chain] = probs[p, : len(chain)]
    out = []
    for trie, prob in zip(tries, reviewed):
        seen = ~np.isnan(prob)
        bucket = trie.bucket.copy()
        bucket[seen] = reviewed_bucket(trie.bucket[seen], prob[seen])
        out.append(hitrate.rescore(Candidates(trie.parent, trie.token, trie.depth, trie.score, trie.source, bucket,
                                              trie.share)))
    return out
