"""decoding/step.py: one verification step — the drafter's trees verified in one forward, each
row's accepted path and bonus as the base's own greedy tokens, the cache advanced by exactly
those slots, the drafter told, every phase timed."""
from __future__ import annotations

import torch
from transformers import GenerationConfig

from draftheads.decoding.accept import Acceptor
from draftheads.decoding.base.forward import lm_logits, prefill
from draftheads.decoding.base.cache import KVState
from draftheads.decoding.drafters import DraftState, StepTrees
from draftheads.decoding.head_state import HeadState
from draftheads.decoding.sequences import Sequences
from draftheads.decoding.step import PHASES, PhaseTimer, decode_step
from draftheads.decoding.tree import chain_tree
from helpers import left_pad, tiny_llama


class ChainDrafter:
    """Proposes a fixed chain per row (a :class:`~draftheads.decoding.drafters.Drafter`)."""

    def __init__(self, chains: list[list[int]]):
        self.chains, self.observed = chains, []

    def start(self, prompts):
        pass

    def propose(self, state: DraftState, tree) -> StepTrees:
        tokens = torch.tensor([[int(r)] + self.chains[b] for b, r in enumerate(state.roots.tolist())])
        return StepTrees.uniform(chain_tree(tokens.shape[1] - 1), tokens)

    def observe(self, trees, result, rows):
        self.observed.append((result.accepted.tolist(), list(rows)))


def test_a_step_keeps_what_the_base_would_have_said_and_only_that():
    model = tiny_llama(3)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    ids, mask = left_pad(prompts)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    greedy = reference[:, ids.shape[1]:].tolist()  # each row's next 5 tokens
    cache, hidden = prefill(model, ids, mask)
    kv = KVState.after_prefill(cache, mask)
    sequences = Sequences(ids, mask)
    acceptor = Acceptor(GenerationConfig(do_sample=False), "greedy", model.config.vocab_size, sequences)
    roots = acceptor.first(lm_logits(model, hidden))
    assert roots.tolist() == [g[0] for g in greedy]
    # row 0 drafts its true next three tokens, row 1 a right one then a wrong one
    wrong = (greedy[1][2] + 1) % model.config.vocab_size or 3
    drafter = ChainDrafter([greedy[0][1:4], [greedy[1][1], wrong, greedy[1][3]]])
    timer = PhaseTimer()
    state = DraftState(roots, hidden, [0, 1], [8, 8], kv.length, sequences.generated)
    step = decode_step(model, drafter, acceptor, kv, HeadState(None, hidden), state, chain_tree(3), timer)
    result = step.acceptance
    assert result.accepted.tolist() == [3, 1]
    assert result.bonus.tolist() == [greedy[0][4], greedy[1][2]]
    assert kv.end.tolist() == [ids.shape[1] + 4, ids.shape[1] + 2]  # root + accepted slots, per row
    assert drafter.observed == [([3, 1], [0, 1])]
    assert timer.steps == 1 and set(timer.per_step()) == set(PHASES) | {"total"}
