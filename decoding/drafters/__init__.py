"""Drafting, in one place: who fills each step's token trees.

* the :class:`Drafter` protocol and its drafters (:class:`HeadsDrafter`, :class:`MergedDrafter`);
* the lookup sources (context, model store, bigram statistics), each a :class:`LookupSource`,
  and :class:`LookupDrafter` holding them for a batch;
* the candidate trie (:class:`Candidates`), its merge, and the hit-rate calibration
  (:class:`HitRate`) that puts every source's scores on the scale of P(accepted);
* one step's padded trees (:class:`Drafts`), what the verifier and the acceptance rules read.

Nothing here imports the loop's acceptance, cache or output at run time.
"""
from .candidates import Candidates, Source, TrieBuilder, count_trie, merge, select
from .context_source import ContextConfig, ContextSource, NgramIndex, SuffixAutomaton
from .hitrate import HitRate, HitRateConfig, default_q
from .drafts import Drafts, children_table
from .lookup import LOOKUP_SOURCES, LookupConfig, LookupDrafter
from .merged import (DRAFT_SOURCES, LINEAR_COST, STORE_NAME, Drafter, DraftState, HeadsDrafter, MergedDrafter,
                     StepCost, TableCost, WidthChooser, build_drafter, cap_depth, check_review, head_trie,
                     parse_drafts, plain_drafts, review)
from .stats import BigramTable, StatsConfig, StatsSource
from .store import (ModelStore, StoreConfig, StoreError, StoreHeader, StoreSource, TokenizerIdentity, build_arrays,
                    save_store, tokenizer_identity)

__all__ = ["DRAFT_SOURCES", "LINEAR_COST", "LOOKUP_SOURCES", "STORE_NAME", "Drafter", "DraftState", "Drafts",
           "HeadsDrafter", "MergedDrafter", "StepCost", "TableCost", "WidthChooser", "build_drafter", "cap_depth",
           "check_review", "children_table", "head_trie", "parse_drafts", "plain_drafts", "review", "BigramTable", "Candidates", "ContextConfig", "ContextSource", "HitRate", "HitRateConfig", "LookupConfig", "LookupDrafter", "ModelStore",
           "NgramIndex", "Source", "StatsConfig", "StatsSource", "StoreConfig", "StoreError", "StoreHeader",
           "StoreSource", "SuffixAutomaton", "TokenizerIdentity", "TrieBuilder", "build_arrays", "count_trie",
           "default_q", "merge", "save_store", "select", "tokenizer_identity"]
