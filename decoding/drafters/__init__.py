"""Draft sources that propose per-row candidate tries, and their merge into one tree.

Pure: imports from ``heads/`` and numpy only, nothing from the decoding loop. Every per-row
source has the same two calls — ``extend(accepted_tokens)`` after a step and
``propose(budget) -> Candidates`` before the next — so the loop's ``Drafter`` protocol can
wrap any of them; :func:`merge` fuses their tries under one node budget and
:class:`HitRate` puts every source's scores on the scale of P(accepted).
"""
from .candidates import Candidates, Source, TrieBuilder, count_trie, merge, select
from .context import ContextConfig, ContextSource, NgramIndex, SuffixAutomaton
from .hitrate import HitRate, HitRateConfig, default_q
from .lookup import LOOKUP_SOURCES, LookupConfig, LookupDrafter
from .stats import BigramTable, StatsConfig, StatsSource
from .store import (ModelStore, StoreConfig, StoreError, StoreHeader, StoreSource, TokenizerIdentity, build_arrays,
                    save_store, tokenizer_identity)

__all__ = ["LOOKUP_SOURCES", "BigramTable", "Candidates", "ContextConfig", "ContextSource", "HitRate", "HitRateConfig", "LookupConfig", "LookupDrafter", "ModelStore",
           "NgramIndex", "Source", "StatsConfig", "StatsSource", "StoreConfig", "StoreError", "StoreHeader",
           "StoreSource", "SuffixAutomaton", "TokenizerIdentity", "TrieBuilder", "build_arrays", "count_trie",
           "default_q", "merge", "save_store", "select", "tokenizer_identity"]
