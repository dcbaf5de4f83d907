"""Drafting, in one place: who fills each step's token trees.

* the :class:`Drafter` protocol and its drafters (:class:`HeadsDrafter`, :class:`MergedDrafter`);
* the lookup sources (context, model store, bigram statistics), each a :class:`LookupSource`,
  :class:`LookupSources` holding them for a batch, and :class:`LookupDrafter` drafting with them alone;
* the candidate trie (:class:`Candidates`, every row's at once :class:`CandidateBatch`), its
  operations (:mod:`.tries`), and the hit-rate calibration
  (:class:`HitRate`) that puts every source's scores on the scale of P(accepted);
* one step's padded trees (:class:`Drafts`), what the verifier and the acceptance rules read.

Nothing here imports the loop's acceptance, cache or output at run time.
"""
from .candidates import CandidateBatch, Candidates, Source
from .tries import count_rows, count_trie, merge, merge_rows, select, select_rows
from .context_source import ContextConfig, ContextSource, NgramIndex, SuffixAutomaton
from .hitrate import HitRate, HitRateConfig, default_q
from .drafts import Drafts, children_table
from .choice import (DRAFT_SOURCES, STORE_NAME, auto_drafts, build_drafter, check_review, check_store_argument,
                     open_store, parse_drafts)
from .heads_drafter import HeadsDrafter, heads_batch
from .lookup import LOOKUP_SOURCES, LookupConfig, LookupSources
from .merged import LookupDrafter, MergedDrafter
from .interface import Drafter, DraftState, LookupSource, plain_drafts
from .review import review
from .width import WidthChooser
from .stats import BigramTable, StatsConfig, StatsSource
from .store import (ModelStore, StoreConfig, StoreError, StoreHeader, StoreSource, TokenizerIdentity, build_arrays,
                    save_store, tokenizer_identity)

__all__ = ["DRAFT_SOURCES", "LOOKUP_SOURCES", "STORE_NAME", "auto_drafts", "BigramTable", "build_arrays",
           "build_drafter", "CandidateBatch", "Candidates", "check_review", "check_store_argument", "children_table",
           "ContextConfig", "ContextSource", "count_rows", "count_trie", "default_q", "Drafter", "Drafts", "DraftState",
           "heads_batch", "HeadsDrafter", "HitRate", "HitRateConfig", "LookupConfig", "LookupDrafter", "LookupSource",
           "LookupSources", "merge", "merge_rows", "MergedDrafter", "ModelStore", "NgramIndex", "open_store", "parse_drafts",
           "plain_drafts", "review", "save_store", "select", "select_rows", "Source", "StatsConfig", "StatsSource", "StoreConfig",
           "StoreError", "StoreHeader", "StoreSource", "SuffixAutomaton", "tokenizer_identity", "TokenizerIdentity",
           "WidthChooser"]
