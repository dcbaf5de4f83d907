"""The base's fingerprint: what a head checkpoint records of the base it was trained on, and
what ``from_pretrained`` checks before binding heads to a base (heads read its hidden states and
share its LM head, so they are valid only for a base with the same LM head)."""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


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
    them by ≳0.1; heads.checkpoint.io compares them with a tolerance (SKETCH_TOLERANCE)."""
    weight = lm_head_weight(model).detach().to("cpu", torch.float64)
    mean_square = float(weight.square().mean())
    blocks = torch.tensor_split(weight, groups, dim=0)
    means = [float(b.mean()) / mean_square ** 0.5 for b in blocks]
    squares = [float(b.square().mean()) / mean_square for b in blocks]
    return [round(v, 8) for v in means + squares]
