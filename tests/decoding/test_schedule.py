"""The batch-size → draft-length schedule written for engines (vLLM's
``num_speculative_tokens_per_batch_size``), from a cost model and a chain's measured acceptance."""
import pytest

from draftheads.core.errors import InputError
from draftheads.decoding.cost import CostModel, LatencyTable
from draftheads.decoding.schedule import best_length, chain_taus, draft_length_schedule


def memory_then_compute(bs: int, q: int, ctx: int) -> float:
    """A step that streams the weights once (10 ms) until bs·q rows make it compute-bound."""
    return 10.0 + max(0.0, bs * q - 16) * 0.8


def cost_of(ms_of, batch_sizes=(1, 2, 4, 8, 16, 32, 64), qs=(1, 2, 3, 4, 5)) -> CostModel:
    return CostModel(LatencyTable.from_rows([{"bs": b, "q": q, "ctx": 256, "ms": ms_of(b, q, 256)}
                                             for b in batch_sizes for q in qs]))


def test_chain_taus_truncate_each_steps_acceptance():
    # steps that accepted 0, 1, 3 and 4 drafts of a 4-chain
    taus = chain_taus([0, 1, 3, 4], 4)
    assert taus == pytest.approx([1.0, 1 + 3 / 4, 1 + 5 / 4, 1 + 7 / 4, 1 + 8 / 4])
    assert taus == sorted(taus)  # a longer chain never expects fewer tokens


@pytest.mark.parametrize("accepted,k", [([], 4), ([1, 2], 0), ([5], 4), ([-1], 2)])
def test_chain_taus_refuse_what_no_chain_of_k_can_have_accepted(accepted, k):
    with pytest.raises(InputError, match="chain"):
        chain_taus(accepted, k)


def test_schedule_drafts_long_while_memory_bound_and_stops_when_compute_bound():
    taus = [1.0, 1.7, 2.1, 2.3, 2.4]
    cost = cost_of(memory_then_compute)
    schedule = draft_length_schedule(cost, taus, range(1, 65))
    assert schedule[0][0] == 1 and schedule[0][2] == 4  # bs 1: the step costs the same for any k
    assert schedule[-1][1] == 64 and schedule[-1][2] == 0  # bs 64: every extra slot costs its full share
    ks = [k for _, _, k in schedule]
    assert ks == sorted(ks, reverse=True)  # never longer as the batch grows, on this surface
    covered = [bs for lo, hi, _ in schedule for bs in range(lo, hi + 1)]
    assert covered == list(range(1, 65))  # every size once, ranges inclusive and joined
    for lo, hi, k in schedule:  # every size's k is the argmax of tokens/s
        for bs in (lo, hi):
            rates = [taus[j] / cost.step_ms(bs, j + 1, 256) for j in range(len(taus))]
            assert rates[k] == pytest.approx(max(rates))


def test_drafting_cost_counts_against_longer_chains():
    taus = [1.0, 1.5, 1.6]
    forward = LatencyTable.from_rows([{"bs": 1, "q": q, "ctx": 0, "ms": 10.0} for q in (1, 2, 3)])
    free = CostModel(forward)
    dear = CostModel(forward, draft=LatencyTable.from_rows([{"bs": 1, "q": q, "ctx": 0, "ms": 6.0 * q} for q in (1, 2)]))
    assert best_length(free, taus, 1, 256) == 2
    assert best_length(dear, taus, 1, 256) == 0  # 1.5 / 16 ms < 1 / 10 ms


def test_schedule_refuses_batch_sizes_below_one():
    with pytest.raises(InputError, match="batch sizes"):
        draft_length_schedule(cost_of(memory_then_compute), [1.0, 1.5], [0, 1])
