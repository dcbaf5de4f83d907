"""draftheads through transformers' ``custom_generate`` seam (draftheads/custom_generate.py):
the callable form on a plain transformers model equals the model's own generate (float64,
greedy; bs 1 and a left-padded batch; dict outputs), the decoder is built once per model, the
generation config transformers prepared is honoured, and what the decoder cannot do is refused."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from draftheads import custom_generate
from draftheads.custom_generate import _DECODERS, write_custom_generate
from draftheads.core.errors import InputError
from draftheads.heads import CheckpointError
from helpers import Collect, left_pad, saved_tree_heads, tiny_llama


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    model = tiny_llama(0)
    return model, saved_tree_heads(tmp_path / "heads", model)


def test_the_callable_equals_the_models_own_greedy_generate(setup):
    model, heads = setup
    fn = custom_generate(heads, sources="heads,context", tree=3)
    ids = torch.tensor([[5, 17, 33, 8, 9, 5, 17, 33]])
    mask = torch.ones_like(ids)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, custom_generate=fn)
    assert ours.tolist() == reference.tolist()
    assert model.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=fn).tolist() == reference.tolist()
    assert len(_DECODERS[model]) == 1  # bound once, reused


def test_a_padded_batch_and_dict_outputs(setup):
    model, heads = setup
    fn = custom_generate(heads)
    ids, mask = left_pad([[3, 5, 9, 13, 21], [7, 8]])
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True)
    reference = model.generate(ids, **kwargs)
    ours = model.generate(ids, custom_generate=fn, **kwargs)
    assert type(ours) is type(reference)
    assert ours.sequences.tolist() == reference.sequences.tolist()
    assert len(ours.scores) == len(reference.scores)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(reference.scores))


def test_the_prepared_generation_config_is_honoured(setup):
    """Sampling with top_k=1 is the argmax: the callable saw do_sample and top_k from the call."""
    model, heads = setup
    fn = custom_generate(heads)
    ids = torch.tensor([[11, 12, 13, 14]])
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False)
    sampled = model.generate(ids, max_new_tokens=12, do_sample=True, top_k=1, custom_generate=fn)
    assert sampled.tolist() == greedy.tolist()
    short = model.generate(ids, max_new_tokens=3, do_sample=False, custom_generate=fn)
    assert short.shape[1] == ids.shape[1] + 3


def test_the_callers_own_stopping_criteria_apply(setup):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AfterToken(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    model, heads = setup
    ids = torch.tensor([[11, 12, 13, 14]])
    full = model.generate(ids, max_new_tokens=20, do_sample=False)
    stop = int(full[0, ids.shape[1] + 5])
    criteria = StoppingCriteriaList([AfterToken(stop)])
    reference = model.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=criteria)
    ours = model.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=criteria,
                          custom_generate=custom_generate(heads))
    assert ours.tolist() == reference.tolist() and ours.shape[1] < full.shape[1]


def test_bad_use_is_refused_with_one_clear_line(setup, tmp_path):
    model, heads = setup
    with pytest.raises(InputError, match="expected a head checkpoint folder"):
        custom_generate(42)
    with pytest.raises(ValueError, match="sources="):
        custom_generate(heads, sources="bogus")
    ids = torch.tensor([[5, 6, 7]])
    other = tiny_llama(1)
    with pytest.raises(CheckpointError, match="another base"):
        other.generate(ids, max_new_tokens=4, custom_generate=custom_generate(heads))
    with pytest.raises((InputError, ValueError), match="num_beams"):
        model.generate(ids, max_new_tokens=4, num_beams=2, custom_generate=custom_generate(heads))


@pytest.mark.slow
def test_a_text_generation_pipeline_with_the_shipped_heads(smollm2):
    """transformers' pipeline on SmolLM2 (float32) with the shipped heads: the same text as the
    pipeline without them (float32: identical, or a first divergence at a near-tie)."""
    from transformers import pipeline

    from draftheads.decoding.guarantee import first_divergence
    from helpers import REPO

    base, tokenizer = smollm2
    pipe = pipeline("text-generation", model=base, tokenizer=tokenizer)
    messages = [{"role": "user", "content": "Name three primary colours."}]
    plain = pipe(messages, max_new_tokens=32, do_sample=False, return_tensors=True)
    fast = pipe(messages, max_new_tokens=32, do_sample=False, return_tensors=True,
                custom_generate=custom_generate(REPO / "checkpoints" / "smollm2-135m-hydra"))
    ours, reference = fast[0]["generated_token_ids"], plain[0]["generated_token_ids"]
    if ours != reference:
        prompt = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        diff = first_divergence(base, torch.tensor([reference]), torch.tensor([ours]), prompt)
        assert diff is not None and diff["within_band"], diff


def test_the_folder_form_in_a_checkpoint(setup):
    """``custom_generate/generate.py`` written into the checkpoint: plain transformers code with
    ``custom_generate=<folder>, trust_remote_code=True`` decodes with the heads (same tokens,
    streaming included); the folder says where the heads are."""
    model, heads = setup
    folder = write_custom_generate(heads)
    assert (folder / "requirements.txt").read_text().startswith("draftheads")
    assert repr(str(heads.resolve())) in (folder / "generate.py").read_text()

    ids = torch.tensor([[5, 17, 33, 8, 9, 5, 17, 33]])
    theirs, ours = Collect(), Collect()
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                               streamer=theirs)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                         custom_generate=str(heads), trust_remote_code=True, streamer=ours)
    assert out.tolist() == reference.tolist() and ours.tokens == theirs.tokens
    with pytest.raises(InputError, match="assistant_model=<LlamaForCausalLM> is not supported"):
        model.generate(ids, max_new_tokens=4, custom_generate=str(heads), trust_remote_code=True,
                       assistant_model=tiny_llama(0))


def test_export_to_custom_generate_writes_a_folder_transformers_runs(setup, tmp_path):
    """``draftheads export --to custom-generate``: a copy of the checkpoint with the folder; plain
    transformers code runs it; the source is never overwritten."""
    from draftheads.cli import main as cli_main

    model, heads = setup
    out = tmp_path / "exported"
    assert cli_main(["export", "--to", "custom-generate", str(heads), str(out)]) == 0
    assert (out / "custom_generate" / "generate.py").is_file() and (out / "config.json").is_file()
    assert not (heads / "custom_generate").exists()
    ids = torch.tensor([[9, 8, 7, 6, 9, 8, 7]])
    reference = model.generate(ids, max_new_tokens=12, do_sample=False)
    ours = model.generate(ids, max_new_tokens=12, do_sample=False, custom_generate=str(out), trust_remote_code=True)
    assert ours.tolist() == reference.tolist()
    with pytest.raises(SystemExit):
        cli_main(["export", "--to", "custom-generate", str(heads), str(heads)])  # onto its own source


def test_bad_input_to_either_form_is_one_clear_line_before_any_work(setup, tmp_path):
    """Heads for another base, beams, another draft model or transformers' prompt lookup with the
    heads, a model moved after its heads were bound, a checkpoint folder without
    custom_generate/: each one line naming the fix, raised before a token is decoded."""
    model, heads = setup
    ids = torch.tensor([[5, 6, 7, 8]])
    fn = custom_generate(heads)
    # a checkpoint folder without custom_generate/: transformers' own one line, before anything runs
    with pytest.raises(OSError, match="does not contain a `custom_generate` subdirectory"):
        model.generate(ids, max_new_tokens=4, custom_generate=str(heads), trust_remote_code=True)
    folder = write_custom_generate(heads)
    assert folder.name == "custom_generate"
    other = tiny_llama(1)
    for form in (custom_generate(heads), str(heads)):  # the callable and the folder form alike
        extra = {"trust_remote_code": True} if isinstance(form, str) else {}
        with pytest.raises(CheckpointError, match="another base"):
            other.generate(ids, max_new_tokens=4, custom_generate=form, **extra)
        with pytest.raises((InputError, ValueError), match="num_beams"):
            model.generate(ids, max_new_tokens=4, num_beams=2, custom_generate=form, **extra)
        with pytest.raises(InputError, match="assistant_model"):
            model.generate(ids, max_new_tokens=4, assistant_model=tiny_llama(0), custom_generate=form, **extra)
    with pytest.raises(InputError, match="prompt_lookup_num_tokens cannot be combined"):
        model.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=3, custom_generate=fn)
    reference = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert model.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=fn).tolist() == reference.tolist()
    # the model cast after its heads were bound (a device move is refused by the same check)
    model.float()
    with pytest.raises(InputError, match=r"the model is on cpu \(float32\) but its heads were bound on cpu "
                                         r"\(float64\).*unbind\(model\)"):
        model.generate(ids.clone(), max_new_tokens=8, do_sample=False, custom_generate=fn)
    custom_generate.unbind(model)  # draftheads.custom_generate.unbind, as the error says
    model.double()
    assert model.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=fn).tolist() == reference.tolist()


def test_the_heads_on_another_device_than_the_model_are_refused(setup):
    """The heads bound, then (as a model moved to another device would leave them) elsewhere: one
    line before any work (no GPU needed: the heads are put on the meta device)."""
    from draftheads.custom_generate import _DECODERS

    model, heads = setup
    fn = custom_generate(heads)
    ids = torch.tensor([[5, 6, 7, 8]])
    model.generate(ids, max_new_tokens=2, custom_generate=fn)
    [decoder] = _DECODERS[model].values()
    decoder.heads.to("meta")
    with pytest.raises(InputError, match=r"the model is on cpu \(float64\) but its heads were bound on meta"):
        model.generate(ids, max_new_tokens=4, custom_generate=fn)


def test_the_callable_streams(setup):
    """transformers hands a callable no streamer; draftheads reads it from the generate call, so
    ``streamer=`` streams the same tokens as the model's own generate."""
    model, heads = setup

    ids = torch.tensor([[5, 17, 33, 8, 9, 5, 17, 33]])
    theirs, ours = Collect(), Collect()
    reference = model.generate(ids, max_new_tokens=20, do_sample=False, streamer=theirs)
    out = model.generate(ids, max_new_tokens=20, do_sample=False, streamer=ours, custom_generate=custom_generate(heads))
    assert out.tolist() == reference.tolist() and ours.tokens == theirs.tokens


def test_push_writes_custom_generate_for_the_repo(setup, tmp_path, monkeypatch):
    """``draftheads push CKPT REPO`` uploads the checkpoint with ``custom_generate/`` pointing at
    the repo id (the Hub replaced by a recorder, as in heads/checkpoint/test_hub.py); the local folder is unchanged;
    the uploaded folder, laid out as the Hub cache would serve it, decodes with the heads."""
    import huggingface_hub
    from huggingface_hub import constants

    from draftheads.cli import main as cli_main

    calls = []

    class RecordingHfApi:
        def __init__(self, token=None, **_):
            pass

        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id))

        def upload_folder(self, folder_path, repo_id, **kwargs):
            files = {p.relative_to(folder_path).as_posix(): p.read_bytes()
                     for p in sorted(Path(folder_path).rglob("*")) if p.is_file()}
            calls.append(("upload_folder", repo_id, files))
            return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/c0ffee"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHfApi)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    model, heads = setup
    before = sorted(p.name for p in heads.iterdir())
    assert cli_main(["push", str(heads), "someone/tiny-heads"]) == 0
    (_, repo), (_, repo2, files) = calls
    assert repo == repo2 == "someone/tiny-heads"
    assert set(files) == {*before, "custom_generate/generate.py", "custom_generate/requirements.txt"}
    assert "HEADS = 'someone/tiny-heads'" in files["custom_generate/generate.py"].decode()
    assert sorted(p.name for p in heads.iterdir()) == before  # the local checkpoint is not touched
    # what the repo serves: the uploaded files; its generate.py finds the heads by the repo id
    served = tmp_path / "served"
    for name, data in files.items():
        (served / name).parent.mkdir(parents=True, exist_ok=True)
        (served / name).write_bytes(data)
    module = sys.modules["draftheads.custom_generate"]  # the package's name is the function

    resolved = []
    real = module.DraftHeadsModel.from_pretrained

    def from_hub(name, **kwargs):  # the Hub id resolves to the served copy
        resolved.append(name)
        return real(served if name == "someone/tiny-heads" else name, **kwargs)

    monkeypatch.setattr(module.DraftHeadsModel, "from_pretrained", from_hub)
    ids = torch.tensor([[9, 8, 7, 6, 9, 8, 7]])
    reference = model.generate(ids, max_new_tokens=12, do_sample=False)
    ours = model.generate(ids, max_new_tokens=12, do_sample=False, custom_generate=str(served), trust_remote_code=True)
    assert ours.tolist() == reference.tolist() and resolved == ["someone/tiny-heads"]
    with pytest.raises(SystemExit):  # a bad repo id: one line, nothing uploaded
        cli_main(["push", str(heads), "not a repo id"])
    assert len(calls) == 2


def test_the_folder_form_with_a_padded_batch_and_sampling(setup):
    """The folder form as the callable is tested: a left-padded batch with dict outputs gives the
    model's own tokens and scores; sampling with top_k=1 is the argmax."""
    model, heads = setup
    write_custom_generate(heads)
    ids, mask = left_pad([[3, 5, 9, 13, 21], [7, 8]])
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True)
    reference = model.generate(ids, **kwargs)
    ours = model.generate(ids, custom_generate=str(heads), trust_remote_code=True, **kwargs)
    assert type(ours) is type(reference) and ours.sequences.tolist() == reference.sequences.tolist()
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(reference.scores))
    one = torch.tensor([[11, 12, 13, 14]])
    greedy = model.generate(one, max_new_tokens=12, do_sample=False)
    sampled = model.generate(one, max_new_tokens=12, do_sample=True, top_k=1, custom_generate=str(heads),
                             trust_remote_code=True)
    assert sampled.tolist() == greedy.tolist()
