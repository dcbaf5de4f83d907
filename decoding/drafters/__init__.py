"""Drafting, in one place: who fills each step's token trees.

* the draft sources' registry (:mod:`.registry`: each source's name, configuration, prior hit
  rate, whether it is static and what it needs loaded; the built-in ones in :mod:`.sources`);
* the :class:`Drafter` protocol and its drafters (:class:`HeadsDrafter`, :class:`MergedDrafter`,
  whose heads' weighing is :class:`HeadsWorth`);
* the lookup sources (context, model store, bigram statistics), each a :class:`LookupSource`,
  :class:`LookupSources` holding them for a batch, and :class:`LookupDrafter` drafting with them alone;
* the candidate trie (:class:`Candidates`, every row's at once :class:`CandidateBatch`), its
  operations (:mod:`.tries`), and the hit-rate calibration
  (:class:`HitRate`) that puts every source's scores on the scale of P(accepted);
* one step's padded trees (:class:`StepTrees`), what the verifier and the acceptance rules read.

Nothing here imports the loop's acceptance, cache or output at run time.
"""
from .registry import (REGISTRY, SourceSpec, lookup_names, needing, register, source_id, source_names, spec_of,
                       unregister)
from .candidates import CandidateBatch, Candidates
from .tries import count_rows, count_trie, merge, merge_rows, select, select_rows
from .sources.context_source import CONTEXT, ContextConfig, ContextSource, NgramIndex, SuffixAutomaton
from .hitrate import HitRate, HitRateConfig, default_q
from ..step_trees import StepTrees, children_table
from .choice import (STORE_NAME, auto_sources, build_drafter, check_review, check_store_argument, open_store,
                     parse_sources)
from .sources.heads_source import HEADS
from .heads_drafter import HeadsDrafter, heads_batch
from .lookup import LookupConfig, LookupSources
from .merged import LookupDrafter, MergedDrafter
from .interface import Drafter, DraftState, LookupSource, plain_step
from .review import review
from .width import WidthChooser
from .worth import HeadsWorth
from .sources.stats_source import STATS, BigramTable, StatsConfig, StatsSource
from .store import (ModelStore, StoreConfig, StoreError, StoreHeader, TokenizerIdentity, build_arrays, save_store,
                    tokenizer_identity)
from .sources.store_source import STORE, StoreSource
from .sources import BUILT_IN  # importing it registers them

__all__ = ["auto_sources", "BigramTable", "BUILT_IN", "build_arrays", "build_drafter", "CandidateBatch", "Candidates",
           "check_review", "check_store_argument", "children_table", "CONTEXT", "ContextConfig", "ContextSource",
           "count_rows", "count_trie", "default_q", "Drafter", "StepTrees", "DraftState", "HEADS", "heads_batch",
           "HeadsDrafter", "HeadsWorth", "HitRate", "HitRateConfig", "lookup_names", "LookupConfig", "LookupDrafter",
           "LookupSource", "LookupSources", "merge", "merge_rows", "MergedDrafter", "ModelStore", "needing",
           "NgramIndex", "open_store", "parse_sources", "plain_step", "register", "REGISTRY", "review", "save_store",
           "select", "select_rows", "source_id", "source_names", "SourceSpec", "spec_of", "STATS", "StatsConfig",
           "StatsSource", "STORE", "STORE_NAME", "StoreConfig", "StoreError", "StoreHeader", "StoreSource",
           "SuffixAutomaton", "tokenizer_identity", "TokenizerIdentity", "unregister", "WidthChooser"]
