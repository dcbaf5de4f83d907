"""Heads that read several base layers (:mod:`draftheads.heads.fusion`): the decoder takes those
layers' states from the forwards it runs anyway — the prefill, packed or not, and every tree step —
hands the heads exactly what training captures at the same positions, decodes every family as
the base's own ``generate`` does, and refuses heads that name a layer the base does not have."""
from __future__ import annotations

import pytest
import torch

from helpers import left_pad, random_heads, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.base.forward import prefill
from draftheads.heads import CheckpointError

TREE = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]
PROMPTS = [[5, 9, 33, 4, 17, 60], [7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41, 42]]
LAYERS = (0, 1)  # the embeddings and the first layer's residual stream of the 2-layer tiny base


def own_states(model, row: list[int]) -> torch.Tensor:
    """(T, d · 3) one unpadded row's features as training captures them: final, layers 0 and 1."""
    out = model.get_decoder()(input_ids=torch.tensor([row]), output_hidden_states=True)
    return torch.cat([out.last_hidden_state, *(out.hidden_states[i] for i in LAYERS)], -1)[0]


@pytest.mark.parametrize("batch", [1, 3])
def test_the_prefill_gives_every_prompt_position_the_layers_training_captures(batch):
    """Padded batches run packed (only their real tokens): each row's features at its real positions
    are its own unpadded forward's, zeros at the padding."""
    model = tiny_llama(2)
    ids, mask = left_pad(PROMPTS[:batch])
    _, features = prefill(model, ids, mask, all_states=True, taps=LAYERS)
    assert features.shape == (batch, ids.shape[1], 3 * model.config.hidden_size)
    for row, prompt in enumerate(PROMPTS[:batch]):
        real = mask[row].bool()
        torch.testing.assert_close(features[row, real], own_states(model, prompt), rtol=0, atol=1e-10)
        assert not features[row, ~real].any()


@pytest.mark.parametrize("family, extra", [("medusa", {}), ("hydra", {}), ("amphista", {}), ("hydra++", {}),
                                           ("hydra++", {"prefix_context": "sequence"})],
                         ids=["medusa", "hydra", "amphista", "hydra++", "hydra++-sequence"])
def test_every_family_reading_several_layers_decodes_as_the_base(family, extra):
    """A padded batch, greedy, heads merged with the context lookup: the base's own tokens, with the
    heads' fusion random (every layer moves the drafts)."""
    model = tiny_llama(3)
    heads = random_heads(family, model, seed=4, extra=extra, feature_layers=LAYERS)
    ids, mask = left_pad(PROMPTS)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    decoder = DraftHeadsModel(model, heads, tree=tree_from_paths(TREE))
    decoder.use_sources("heads,context")
    assert decoder.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None).tolist() \
        == reference.tolist()


def test_heads_naming_a_layer_the_base_lacks_are_refused_by_name():
    model = tiny_llama(3)
    heads = random_heads("medusa", model, feature_layers=(1,))
    heads.config.feature_layers = [5]  # as a config.json made for a deeper base would say
    with pytest.raises(CheckpointError) as caught:
        DraftHeadsModel(model, heads, tree=tree_from_paths(TREE))
    message = str(caught.value)
    assert "\n" not in message and "[5]" in message and "2 layers" in message
