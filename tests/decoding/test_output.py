"""decoding/output.py: where each row stops (EOS, its limit, a stopping criterion), what a step
emits from the accepted path, streaming, and the assembled sequences."""
from __future__ import annotations

import torch

from draftheads.decoding.output import Emitter, StopReplay, generated_counts
from draftheads.decoding.sequences import Sequences

EOS = 2


def emitter(limits=(5, 5), **kwargs) -> tuple[Emitter, Sequences]:
    seqs = Sequences(torch.tensor([[0, 7], [8, 9]]), torch.tensor([[0, 1], [1, 1]]))
    return Emitter(seqs, list(limits), [EOS], **kwargs), seqs


def test_a_step_emits_the_accepted_path_then_the_bonus_and_stops_at_eos():
    out, seqs = emitter()
    out.emit_first(torch.tensor([10, 11]), None)
    tokens = torch.tensor([[10, 20, 21, 22], [11, 30, EOS, 31]])  # slot 0 is the root
    path = torch.tensor([[0, 1, 2], [0, 1, 2]])
    out.emit_step(torch.tensor([0, 1]), tokens, path, torch.tensor([2, 2]), torch.tensor([40, 41]), None)
    assert seqs.generated == [[10, 20, 21, 40], [11, 30, EOS]]  # row 1 stops at its EOS, the rest is dropped
    assert out.running(torch.tensor([0, 1])).tolist() == [True, False]
    assert out.rooms(torch.tensor([0, 1])) == [1, 0]


def test_a_row_stops_at_its_limit_and_on_a_stopping_criterion_called_as_transformers_calls_it():
    calls = []

    def stop_on_13(ids, scores):
        calls.append(ids.tolist())
        return ids[:, -1] == 13

    seqs = Sequences(torch.tensor([[0, 7], [8, 9]]), torch.tensor([[0, 1], [1, 1]]))
    out = Emitter(seqs, [2, 9], [EOS], StopReplay([stop_on_13], seqs.input_ids, pad=0, pads_finished=True,
                                                  pass_scores=False))
    out.emit(0, [12, 13, 14])
    assert calls == []  # step 1 is called once every row has its first token
    out.emit(1, [12, 13, 14])
    assert seqs.generated == [[12, 13], [12, 13]]  # row 0 at its limit, row 1 cut where the criterion stopped it
    # the whole batch once per step: padded prompts and every row's tokens so far
    assert calls == [[[0, 7, 12], [8, 9, 12]], [[0, 7, 12, 13], [8, 9, 12, 13]]]
    assert not out.running(torch.tensor([0, 1])).any()


def test_streaming_tells_which_tokens_were_drafts_and_ends_with_the_output():
    class Recorder:
        def __init__(self):
            self.events = []

        def put(self, value):
            self.events.append(("put", value.tolist()))

        def put_step(self, value, drafted):
            self.events.append(("step", value.tolist(), drafted))

        def end(self):
            self.events.append(("end",))

    streamer = Recorder()
    seqs = Sequences(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long))
    out = Emitter(seqs, [4], [EOS], streamer=streamer)
    out.emit(0, [7, 8, 9], drafted=2)
    assert out.finish(pad=0).tolist() == [[5, 6, 7, 8, 9]]
    assert streamer.events == [("put", [[5, 6]]), ("step", [7, 8, 9], 2), ("end",)]


def test_generated_counts_run_to_the_first_eos():
    sequences = torch.tensor([[1, 1, 5, EOS, 0], [1, 1, 5, 6, 7]])
    assert generated_counts(sequences, 2, {EOS}) == [2, 3]
