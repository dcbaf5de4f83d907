"""``drafts=`` / ``--drafts`` / ``use_drafts`` are the old names of ``sources=`` / ``--sources`` /
``use_sources``: each still works, warns once with a FutureWarning and gives what the new name
gives; the old and the new name together are one error line."""
from __future__ import annotations

import warnings

import pytest
import torch

from draftheads import custom_generate
from draftheads.cli import parse_args
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.config import DecodingConfig
from draftheads.core.errors import InputError
from draftheads.heads import HeadConfig, MedusaHeads
from draftheads.arguments import renamed_sources_option
from helpers import tiny_llama

MODEL = tiny_llama(0, max_pos=64)


def one_future_warning(call):
    """``call()``'s result and its one FutureWarning's message (any other count fails)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(future) == 1, [str(w.message) for w in future]
    return result, str(future[0].message)


def no_future_warning(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        return call()


def test_drafts_keyword_is_sources_with_a_warning():
    new = no_future_warning(lambda: DecodingConfig().replace(sources="heads,context"))
    old, message = one_future_warning(lambda: DecodingConfig().replace(drafts="heads,context"))
    assert old == new and new.sources == ("heads", "context")
    assert message.startswith("drafts= is now sources=;") and "\n" not in message
    with pytest.raises(InputError, match=r"^sources= and drafts= both given: .*pass sources= only\.$"):
        DecodingConfig().replace(sources="heads", drafts="heads")


def test_from_pretrained_and_the_constructor_take_drafts_as_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    new = no_future_warning(lambda: DraftHeadsModel.from_pretrained(None, base=MODEL, sources="context", tree=0))
    old, message = one_future_warning(lambda: DraftHeadsModel.from_pretrained(None, base=MODEL, drafts="context",
                                                                              tree=0))
    assert old.decoding == new.decoding and old.sources == new.sources == ("context",)
    assert message.startswith("drafts= is now sources=;")
    built, _ = one_future_warning(lambda: DraftHeadsModel(MODEL, None, drafts="context", tree=0))
    assert built.decoding == new.decoding
    with pytest.raises(InputError, match="sources= and drafts= both given"):
        DraftHeadsModel.from_pretrained(None, base=MODEL, sources="context", drafts="context", tree=0)


def test_use_drafts_is_use_sources_with_a_warning():
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96)).to(torch.float64)
    new, old = DraftHeadsModel(MODEL, heads, tree=2), DraftHeadsModel(MODEL, heads, tree=2)
    no_future_warning(lambda: new.use_sources("heads,context", review=True))
    _, message = one_future_warning(lambda: old.use_drafts("heads,context", review=True))
    assert message.startswith("use_drafts() is now use_sources();")
    assert old.decoding == new.decoding and old.sources == new.sources == ("heads", "context")
    assert type(old.drafter) is type(new.drafter) and old.drafter.review is new.drafter.review is True
    prompt = torch.tensor([[5, 9, 5, 9, 5, 9, 5]])
    assert torch.equal(old.generate(prompt, max_new_tokens=8), new.generate(prompt, max_new_tokens=8))


def test_custom_generate_takes_drafts_as_sources():
    _, message = one_future_warning(lambda: custom_generate("some/heads", drafts="heads", tree=3))
    assert message.startswith("drafts= is now sources=;")
    with pytest.raises(InputError, match="sources= and drafts= both given"):
        custom_generate("some/heads", sources="heads", drafts="heads")


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench", "--prompts", "mt-bench"],
                                     ["demo"]])
def test_the_drafts_option_is_sources_with_a_warning(command):
    new = no_future_warning(lambda: parse_args([*command, "--sources", "heads,context"]))
    old, message = one_future_warning(lambda: parse_args([*command, "--drafts", "heads,context"]))
    assert vars(old) == vars(new) and new.sources == ("heads", "context")
    assert message.startswith("--drafts is now --sources;")
    assert no_future_warning(lambda: parse_args(command)).sources is None


def test_the_old_and_new_option_together_are_one_error_line(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(["generate", "--prompt", "hi", "--sources", "heads", "--drafts", "heads"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2
    assert err == ["error: --sources and --drafts both given: --drafts is the old name of --sources; "
                   "pass --sources only."]
    args = parse_args(["generate", "--prompt", "hi", "--sources", "heads"])
    assert renamed_sources_option(args) is args and args.sources == ("heads",)


def test_a_config_saved_with_the_old_key_reads_back():
    saved = DecodingConfig(sources="heads,context").to_dict()
    assert "sources" in saved and "drafts" not in saved
    saved["drafts"] = saved.pop("sources")
    assert no_future_warning(lambda: DecodingConfig.from_dict(saved)) == DecodingConfig(sources="heads,context")
