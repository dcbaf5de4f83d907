"""draftheads through transformers' own seam: ``model.generate(..., custom_generate=fn)``.

Code that holds a plain transformers model — a ``pipeline("text-generation")``, an evaluation
harness, a serving script — decodes with the heads without being rewritten:

    fn = draftheads.custom_generate("checkpoints/smollm2-135m-hydra")
    out = model.generate(**inputs, max_new_tokens=128, custom_generate=fn)

transformers prepares the inputs and the generation config (its defaults, the model's
``generation_config``, the call's keyword arguments), then calls ``fn`` in place of its own
decoding loop; ``fn`` decodes with the heads on *that* model object (:meth:`DraftHeadsModel.run`;
the heads are loaded, checked against its fingerprint and bound once, then cached on the model)
with the logits processors and stopping criteria transformers prepared — the caller's own
included — and returns what transformers returns. Under each dtype's guarantee the output
equals the model's own ``generate``; what the decoder does not implement is refused by name
before any work (:mod:`draftheads.decoding.generation_options`); the heads stay bound where the model was
at its first call (a model moved or cast since is refused, :func:`unbind` forgets them).
transformers 5.24 hands a callable only the arguments it adds to ``_sample``'s, so the
``streamer``, an ``assistant_model`` and the like are read from transformers' ``generate`` call
itself (:func:`generate_call_arguments`): the first streams, the others are refused.
"""
from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Callable, Sequence

import torch

from .decoding import DraftHeadsModel
from .decoding.base.attention import release_packed_sdpa
from .decoding.base.packing import release_packing
from .decoding.config import DecodingConfig, decoding_config, split_options
from .core.errors import InputError
from .decoding.generation_options import refuse_options
from .decoding.request import prepared_call
from .decoding.base.binding import release_linears

#: the model keyword arguments transformers prepares for any decoding loop (the decoder makes its
#: own cache and positions); anything else (``assistant_model``, ...) is refused by name
_PREPARED = {"attention_mask", "position_ids", "use_cache", "cache", "past_key_values", "logits_to_keep",
             "token_type_ids"}

#: model → {the callable's arguments: its decoder}; entries go with the model
_DECODERS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, DraftHeadsModel]]" = weakref.WeakKeyDictionary()


def custom_generate(heads: str | Path, sources: str | Sequence[str] | None = None, tree=None,
                    lookup_store: str | Path | None = None, decoding: DecodingConfig | None = None,
                    **kwargs) -> Callable:
    """The function to pass as ``model.generate(..., custom_generate=fn)`` (see the module
    docstring). ``heads``: a head checkpoint folder or Hub id, made for that model (its
    fingerprint is checked on first use); ``sources`` (None: ``decoding``'s, by default "auto"; the
    old name ``drafts=`` still works, with a FutureWarning),
    ``tree``, ``lookup_store``, ``decoding`` and ``kwargs`` (the other
    :class:`~draftheads.decoding.config.DecodingConfig` fields, and the Hub's arguments) as in
    :meth:`DraftHeadsModel.from_pretrained`. Arguments are checked now."""
    check_heads_argument(heads)
    options, hub_kwargs = split_options(kwargs)
    given = {"sources": sources, "tree": tree, "lookup_store": lookup_store}
    options.update({name: value for name, value in given.items() if value is not None})
    config = decoding_config(decoding, **options)
    key = (str(heads), config, tuple(sorted(hub_kwargs.items())))

    def generate(model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
                 generation_config=None, synced_gpus: bool = False, streamer=None, **model_kwargs):
        dropped = generate_call_arguments()
        refuse_assistance(dropped.get("assistant_model"), generation_config)
        arguments = {"synced_gpus": synced_gpus, **{k: v for k, v in dropped.items() if k != "streamer"}}
        refuse_options(generation_config, arguments)  # by name, before the heads load
        refuse_model_kwargs(model_kwargs)
        if streamer is None and dropped.get("streamer") is not None:
            streamer = PromptAlreadyStreamed(dropped["streamer"])
        decoder = decoder_for(model, key, lambda: DraftHeadsModel.from_pretrained(
            heads, base=model, tokenizer=None, decoding=config, **hub_kwargs))
        check_placement(model, decoder)
        attention_mask = model_kwargs.get("attention_mask")
        if attention_mask is None:  # transformers drops an all-ones mask before calling us
            attention_mask = torch.ones_like(input_ids)
        own = own_loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                       dropped.get("streamer", streamer), model_kwargs)  # the prompt already streamed, as _sample expects
        call = prepared_call(model, input_ids, attention_mask, generation_config, logits_processor, stopping_criteria,
                             arguments, own)
        return decoder.run(call, streamer=streamer)

    generate.__doc__ = f"draftheads' tree decoding with the heads at {heads} (pass as custom_generate=)."
    return generate


def own_loop(model, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config, streamer,
             model_kwargs: dict) -> Callable[[list], object]:
    """transformers' own decoding loop (``_sample``, what its ``generate`` runs without a
    ``custom_generate``) over exactly what it handed the callable, ``extra`` processors appended
    (they must change nothing): for a call the tree loop cannot decode as transformers would."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    def run(extra: list):
        return model._sample(input_ids, logits_processor=LogitsProcessorList([*(logits_processor or []), *extra]),
                             stopping_criteria=StoppingCriteriaList(stopping_criteria or []),
                             generation_config=generation_config, synced_gpus=False, streamer=streamer, **model_kwargs)

    return run


def check_heads_argument(heads) -> None:
    """``custom_generate(heads)``: a non-empty folder path or Hub id, refused at once otherwise."""
    if not isinstance(heads, (str, Path)):
        raise InputError(f"custom_generate(heads={heads!r}): expected a head checkpoint folder or Hub id.")
    if not str(heads).strip():
        raise InputError(f"custom_generate(heads={str(heads)!r}): heads is empty; pass a head checkpoint folder "
                         "(e.g. 'checkpoints/smollm2-135m-hydra') or a Hub id ('user/repo').")


def refuse_model_kwargs(model_kwargs: dict) -> None:
    """The model keyword arguments transformers hands the callable beyond those it prepares
    for any loop: refused by name."""
    unsupported = sorted(k for k, v in model_kwargs.items() if k not in _PREPARED and v is not None)
    if unsupported:
        raise InputError(f"custom_generate: {', '.join(unsupported)} not supported with draftheads' heads "
                         "(the heads are the draft model); drop it or call generate() without custom_generate.")


def generate_call_arguments() -> dict:
    """The arguments of the transformers ``generate`` call that is calling the callable, read
    from its frame: transformers (5.24) hands a callable only what ``_sample`` takes, so an
    ``assistant_model`` (which the heads cannot be combined with), classifier-free guidance's
    negative prompt or ``synced_gpus`` would be dropped silently and a ``streamer`` lost. Empty
    where the caller is not transformers' ``generate``."""
    frame = sys._getframe(2)  # 0: here, 1: the callable, 2: its caller
    if frame.f_code.co_name != "generate" or not frame.f_globals.get("__name__", "").startswith("transformers."):
        return {}
    names = ("assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask", "synced_gpus")
    return {name: frame.f_locals.get(name) for name in names if frame.f_locals.get(name) is not None}


class PromptAlreadyStreamed:
    """A streamer that transformers' ``generate`` already gave the prompt (it does so before
    calling the decoding loop): the decoder's own first ``put`` (the prompt again) is dropped,
    everything else (``put_step`` where the streamer has it) goes through."""

    def __init__(self, streamer):
        self.streamer = streamer
        self.prompt_dropped = False

    def put(self, value) -> None:
        if not self.prompt_dropped:
            self.prompt_dropped = True
            return
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()

    def __getattr__(self, name):
        return getattr(self.streamer, name)


def refuse_assistance(assistant_model, generation_config) -> None:
    """Another draft model or transformers' prompt lookup together with the heads: one line."""
    if assistant_model is not None:
        raise InputError("custom_generate: assistant_model cannot be combined with draftheads' heads (the heads are "
                         "the draft model); drop assistant_model, or call generate() without custom_generate.")
    if getattr(generation_config, "prompt_lookup_num_tokens", None):
        raise InputError("custom_generate: prompt_lookup_num_tokens cannot be combined with draftheads' heads "
                         "(draftheads drafts lookups itself: sources='auto' or 'heads,context'); drop it.")


def check_placement(model, decoder: DraftHeadsModel) -> None:
    """The heads bound on first use sit on the model's device in its dtype; a model moved or
    cast since then is refused before any work, naming the fix."""
    if decoder.heads is None:
        return
    param = next(model.parameters())
    head = next(decoder.heads.parameters(), None)
    if head is not None and (head.device != param.device or head.dtype != param.dtype):
        raise InputError(f"custom_generate: the model is on {param.device} ({str(param.dtype).removeprefix('torch.')}) "
                         f"but its heads were bound on {head.device} ({str(head.dtype).removeprefix('torch.')}) when it "
                         "was first used; move or cast it back, or bind the heads again where it is now with "
                         "draftheads.custom_generate.unbind(model).")


def unbind(model) -> None:
    """Release everything draftheads holds for ``model``: the decoders and heads every callable
    bound to it, the packed copies of its weights and their sibling products, and the note that
    the decoder's forwards attend through draftheads' packed SDPA.
    The next call binds again, on the model's device and in its dtype as they are then."""
    for decoder in _DECODERS.pop(model, {}).values():
        if decoder.heads is not None:
            release_linears(decoder.heads)
    release_packing(model)
    release_packed_sdpa(model)


custom_generate.unbind = unbind  # draftheads.custom_generate is the function: draftheads.custom_generate.unbind(model)


def decoder_for(model, key: tuple, build: Callable[[], DraftHeadsModel]) -> DraftHeadsModel:
    """The decoder cached for ``model`` and these arguments, built on first use. It holds the
    model weakly, so the entry goes when the model does."""
    per_model = _DECODERS.setdefault(model, {})
    if key not in per_model:
        with torch.random.fork_rng(devices=[]):  # building (the heads' init) leaves the caller's seeded RNG as it was
            decoder = build()
        decoder.hold_base_weakly()
        per_model[key] = decoder
    return per_model[key]


# -- the folder form: custom_generate/generate.py inside a head checkpoint ----------------------------
#: transformers' layout for a Hub repo or folder that carries its own decoding loop
FOLDER, MODULE, REQUIREMENTS = "custom_generate", "generate.py", "requirements.txt"
#: the module written into the folder. The one thing in it that comes from the user, where the
#: heads are, goes in as ``HEADS = <repr>``: a Python string literal that reads back as exactly
#: that text whatever quotes or backslashes it holds (:func:`python_string`), never into the
#: docstring or any other literal
_TEMPLATE = '''"""draftheads' tree decoding with the heads at HEADS (below), as a transformers custom_generate:

    model.generate(**inputs, custom_generate=<this repo or folder>, trust_remote_code=True)

Written by draftheads {version}; the heads' base fingerprint is checked on first use."""
from draftheads.custom_generate import run_folder_generate

HEADS = {heads}


def generate(model, **kwargs):
    return run_folder_generate(model, HEADS, **kwargs)
'''


def check_source(source: str) -> None:
    """Where the written module finds the heads: a Hub repo id or a folder path, on one line.
    Control characters and line breaks name neither, so they are refused rather than written."""
    import unicodedata

    if not isinstance(source, str) or not source.strip():
        raise InputError(f"--source {source!r}: pass the Hub repo id the folder will be pushed to, or leave it out "
                         "(the exported folder's own path).")
    bad = next((c for c in source if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)
    if bad is not None:
        raise InputError(f"where the heads are ({source!r}) holds the control character {bad!r}: a repo id or a path "
                         "is one line of text; pass --source with the Hub repo id the folder will be pushed to, or "
                         "export into a folder whose path has no such character.")


def python_string(text: str) -> str:
    """``text`` as a Python string literal that evaluates to exactly ``text`` (``repr``: quotes,
    backslashes and non-printable characters escaped), checked by reading it back."""
    import ast

    literal = repr(str(text))
    if ast.literal_eval(literal) != text:
        raise InputError(f"{text!r} cannot be written as a Python string; pass a plain repo id or path.")
    return literal


def write_custom_generate(checkpoint: str | Path, source: str | None = None) -> Path:
    """Write ``custom_generate/generate.py`` and ``requirements.txt`` into a head checkpoint
    folder, so plain transformers code decodes with its heads. ``source``: where the function
    finds the heads — the Hub repo id the folder is pushed to, or (default) this folder's
    absolute path. transformers copies the module elsewhere before running it, so the source is
    written into it rather than found from its own location (as one escaped string literal)."""
    from .heads.head_config import DRAFTHEADS_VERSION

    source = source or str(Path(checkpoint).resolve())
    check_source(source)
    folder = Path(checkpoint) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    text = _TEMPLATE.format(heads=python_string(source), version=DRAFTHEADS_VERSION)
    (folder / MODULE).write_text(text, encoding="utf-8")
    (folder / REQUIREMENTS).write_text(f"draftheads>={DRAFTHEADS_VERSION}\n", encoding="utf-8")
    return folder


def run_folder_generate(model, heads: str, inputs: torch.Tensor | None = None, generation_config=None,
                        logits_processor=None, stopping_criteria=None, streamer=None, **kwargs):
    """What ``custom_generate/generate.py`` runs: transformers hands the folder form every
    argument of ``generate`` as given (nothing prepared), so they go to
    :meth:`DraftHeadsModel.generate` as they are, which honours them as transformers would or
    refuses them by name."""
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None:
        raise InputError("custom_generate: pass the prompt's input_ids.")
    decoder = decoder_for(model, ("folder", heads), lambda: DraftHeadsModel.from_pretrained(heads, base=model))
    check_placement(model, decoder)
    return decoder.generate(input_ids, generation_config=generation_config, streamer=streamer,
                            logits_processor=logits_processor, stopping_criteria=stopping_criteria, **kwargs)
