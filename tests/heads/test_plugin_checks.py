"""The head families' plug-in surfaces are checked where they are given: ``register()`` refuses
what is not a family class (or takes another family's name), and a checkpoint's ``expected_tau``
that is not {node budget: number ≥ 1} is one line naming the file, not a ``float()`` traceback
when the adaptive policy first reads it."""
from __future__ import annotations

import json

import pytest
import torch

from draftheads.core.errors import DraftheadsError
from draftheads.heads import REGISTRY, CheckpointError, HeadConfig, MedusaHeads, read_config, register


class NoFamily(torch.nn.Module):
    family = 3


class OtherMedusa(MedusaHeads):
    family = "medusa"


class BadOptions(MedusaHeads):
    family = "bad-options"
    options_class = dict


@pytest.mark.parametrize("cls,error,line", [
    (3, TypeError, "register() takes a head family class (a subclass of draftheads.heads.DraftHeads), got int 3: "
     "decorate the class itself with @register."),
    (dict, TypeError, "register() takes a head family class (a subclass of draftheads.heads.DraftHeads), got type "
     "<class 'dict'>: decorate the class itself with @register."),
    (NoFamily, ValueError, "Head family class NoFamily has family=3: set family to its name in config.json, a "
     "lowercase word such as 'medusa'."),
    (BadOptions, ValueError, "Head family 'bad-options': options_class=<class 'dict'> is not a FamilyOptions "
     "subclass; declare the family's options as a frozen dataclass subclassing FamilyOptions."),
    (OtherMedusa, ValueError, "Head family 'medusa' is registered already (by MedusaHeads); give OtherMedusa another "
     "family name."),
])
def test_a_bad_family_registration_is_one_line_naming_it(cls, error, line):
    before = dict(REGISTRY)
    with pytest.raises(error) as raised:
        register(cls)
    assert str(raised.value) == line and isinstance(raised.value, DraftheadsError)
    assert REGISTRY == before  # the shipped families untouched
    assert register(MedusaHeads) is MedusaHeads  # registering a family again is a no-op


@pytest.mark.parametrize("expected_tau,shown", [
    ({"3": "high"}, "HeadConfig.expected_tau['3'] = 'high': each entry"),
    ({"3": "1.7"}, "HeadConfig.expected_tau['3'] = '1.7': each entry"),
    ({"3": 0.5}, "HeadConfig.expected_tau['3'] = 0.5: each entry"),
    ({"three": 1.7}, "HeadConfig.expected_tau['three'] = 1.7: each entry"),
    ("1.7", "HeadConfig.expected_tau must be an object {node budget: expected τ} such as {\"3\": 1.7}, got str '1.7'"),
])
def test_a_checkpoint_with_a_bad_expected_tau_is_one_line_naming_the_file(tmp_path, expected_tau, shown):
    config = HeadConfig(num_heads=2, hidden_size=32, vocab_size=96, trees={"3": [[0], [1], [0, 0]]}).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, "expected_tau": expected_tau}))
    with pytest.raises(CheckpointError) as raised:
        read_config(tmp_path)
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: {shown}") and "\n" not in message
    assert message.endswith("fix config.json or re-download the checkpoint.")
    with pytest.raises(CheckpointError, match="expected_tau"):  # the same check for a config built in Python
        HeadConfig(expected_tau=expected_tau)
