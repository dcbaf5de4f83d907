"""What a training recipe holds: one dataclass per YAML section (``heads:``, ``data:``, ``loss:``,
``train:``, ``run:``, ``adversarial:``) and the allowed choices; :mod:`.recipe` reads a file into
them and :mod:`.recipe_checks` validates the values."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.errors import DraftheadsError
from .data.records import HUB_DEFAULTS


class RecipeError(DraftheadsError, ValueError):
    """A recipe that cannot be used: unknown key, wrong type, bad value, wrong resume dir."""


@dataclass
class HeadsSection:
    family: str = "medusa"  # any registered family: medusa, hydra, ...
    num_heads: int = 4
    num_layers: int = 1
    draft_vocab_size: int = 8192  # 0 = full vocabulary
    extra: dict[str, Any] = field(default_factory=dict)  # the family's options (typed: HeadConfig.options)
    # a checkpoint folder (or Hub id) whose weights start the run, e.g. the shipped heads or an imported Medusa:
    # same family and shape, made for this base; its draft vocabulary is kept. A resume of this run wins.
    # A checkpoint that reads the final state only may start heads that read layers too (their fusion starts
    # as the identity on the final state: the same drafts at step 0)
    init_from: str | None = None
    # base layers the heads read beside its final state (heads/fusion.py: transformers' output_hidden_states
    # numbering, i = after i decoder layers, each < the base's num_hidden_layers), e.g. [8, 22]; default: the
    # layers a quarter and three quarters up the base (heads.fusion.default_feature_layers; SmolLM2's 30 layers: [8, 22]);
    # [] (omitted): the final state only, as every recipe before them. The training data must hold their
    # states: the feature cache captures them, a job folder needs distill_job --from-tokens ... --layers
    feature_layers: list[int] | str = field(default_factory=list)


@dataclass
class DataSection:
    # selfdistill (prompt + response_ids) | conversations (messages) | tokens (input_ids) | job (the output
    # folder of python -m draftheads.training.data.distill_job: token ids + the base's states, no feature pass)
    kind: str = "selfdistill"
    # a local file, datasets dir or self-distillation output dir, or a Hub dataset id, or a list of them
    # (concatenated in order); no default: a clone carries no training set (training/data/records.py:load_records)
    path: str | list[str] = ""
    name: str | None = None  # Hub datasets: the configuration (load_dataset's name), e.g. main for openai/gsm8k
    split: str = "train"  # Hub datasets: the split to read
    columns: dict[str, str] = field(default_factory=dict)  # {column in the data: column read}, e.g. {question: prompt}
    features_dir: str | None = "data_cache/features-smollm2"  # fp16 hidden-state cache; null = base forward each step
    eval_examples: int = 256  # held-out examples, taken from the end of the (last) data
    # the dev table every epoch is also scored on (and the best epoch chosen by): a JSONL of the base's own
    # answers to prompts outside the training sources, {prompt, response_ids, group} (training/evaluation.py)
    eval_path: str | None = None
    limit: int = 0  # use only the first N examples (0 = all)
    max_length: int = 1024  # tokens per example (prompt + answer)
    sources: list[str] = field(default_factory=list)  # keep records whose 'source' starts with one of these
    source_caps: dict[str, int] = field(default_factory=dict)  # at most N records per 'source' prefix
    # true: every position trains, the prompt's too (data.kind job only), labelled with the base's own predictions
    # there (the job's predicted.npy: distill_job --from-tokens ... --predicted); false: the answers' positions only
    prompt_positions: bool = False


@dataclass
class LossSection:
    labels: str = "teacher"  # teacher: the base's own argmax (= text when self-distilled) | text
    ce_weight: float = 1.0  # cross-entropy on the labels
    kl_weight: float = 0.0  # KL to the base's next-token distribution (Hydra++ teacher distillation)
    temperature: float = 1.0
    # K > 0: the KL term over the teacher's top-K draft-vocabulary tokens only (its probabilities renormalized
    # over them, the heads' over the whole draft vocabulary: HASS's top-K distillation); 0: the full KL
    kl_topk: int = 0
    head_decay: float = 0.8  # head k weighted decay^k (1.0 = plain sum)
    noise_alpha: float = 0.0  # NEFTune-style uniform noise on the input hidden states


@dataclass
class TrainSection:
    epochs: float = 3.0
    max_steps: int = 0  # > 0: stop after this many optimizer steps (overrides epochs)
    batch_size: int = 512  # per process and micro-step: positions (features) or sequences (on the fly)
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.0  # cosine decays to lr · min_lr_ratio
    max_grad_norm: float = 0.0  # 0 = no clipping
    seed: int = 0
    chunk_length: int = 256  # contextual families (Hydra++): positions per sequence chunk (0: whole sequences); batch_size counts chunks
    mixed_precision: str = "bf16"  # no | bf16 | fp16 (accelerate); bf16 autocast makes CPU LM-head matmuls 2x faster
    dtype: str = "float32"  # parameter dtype of the heads (float64 for exactness tests)


@dataclass
class RunSection:
    output_dir: str = "runs/medusa-smollm2"  # checkpoints/, log.jsonl, wandb/
    final_dir: str | None = None  # save_pretrained target; default <output_dir>/final
    # auto (latest checkpoint in output_dir) | a checkpoint directory | never (starts over and DELETES
    # <output_dir>/checkpoints; refused if that folder holds anything but draftheads' step-* dirs).
    # Resuming loads data only (safetensors, JSON, weights_only torch files): see training/run_state.py
    resume: str = "auto"
    checkpoint_every: int = 200  # optimizer steps between accelerate save_state checkpoints
    keep_checkpoints: int = 2
    eval_every: int = 200
    eval_positions: int = 20000  # cap on held-out positions per evaluation (data.eval_path is scored whole)
    eval_each_epoch: bool = True  # also evaluate at the end of every epoch (curves.json/png, best-epoch choice)
    keep_best: bool = True  # the final heads are the best epoch's (τ at 8 nodes, dev table if set); false: the last
    # the table the stored trees are fitted on: held_out (the training data's split) or dev (data.eval_path:
    # the base's answers to the prompts decoding is measured on, whose acceptance is lower)
    trees_from: str = "held_out"
    log_every: int = 10
    wandb: bool = True  # offline unless WANDB_API_KEY is set; skipped if wandb is not installed
    wandb_project: str = "draftheads"
    tree_budgets: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64])
    default_budget: int = 4
    save_dtype: str = "bfloat16"  # dtype of the final head weights (float32/float64 keep precision)


@dataclass
class AdversarialSection:
    """KOALA's adversarial learning (arXiv 2408.08146) on top of any head family: a small
    discriminator (training/adversarial.py) tells the base's next-token distribution from the
    heads' and the heads also learn to fool it. ``enabled`` builds and trains the discriminator;
    ``weight`` = λ is how much the heads see of it (0 = they never do: the run trains exactly
    like the plain supervised one)."""

    enabled: bool = False
    weight: float = 0.1  # λ: generator loss = supervised + λ · (−log D(fake))
    schedule: str = "constant"  # constant | linear (λ ramps 0 → weight over ramp_steps after warmup)
    warmup_steps: int = 0  # optimizer steps with supervised loss only (the discriminator already trains)
    ramp_steps: int = 0  # linear schedule: steps from 0 to the full weight
    disc_lr: float = 1e-4  # the discriminator's own Adam (betas 0.5, 0.999)
    disc_hidden: int = 256  # MLP width
    disc_steps: int = 1  # discriminator updates per micro-batch (on the same batch)
    label_smoothing: float = 0.0  # one-sided: REAL targets are 1 − s
    grad_penalty: float = 0.0  # γ of the R1 penalty γ/2·‖∇D(real)‖² (0 = off)


@dataclass
class Recipe:
    name: str = "medusa-smollm2"
    base: str = "embedded"  # embedded SmolLM2, a local model dir, a Hub id in the local cache, or a .gguf
    base_dtype: str = "bfloat16"  # dtype of the frozen base for feature extraction / on-the-fly forwards
    heads: HeadsSection = field(default_factory=HeadsSection)
    data: DataSection = field(default_factory=DataSection)
    loss: LossSection = field(default_factory=LossSection)
    train: TrainSection = field(default_factory=TrainSection)
    run: RunSection = field(default_factory=RunSection)
    adversarial: AdversarialSection = field(default_factory=AdversarialSection)

    def to_dict(self) -> dict:
        return asdict(self)

    def identity(self) -> dict:
        """What must match to resume a run: everything that shapes the optimization (model,
        data, loss, schedule). ``run.*`` (logging, checkpoint cadence, paths) may change."""
        data = self.to_dict()
        data.pop("run")
        for key, default in HUB_DEFAULTS.items():
            if data["data"][key] == default:  # unused Hub options: runs from before they existed still resume
                data["data"].pop(key)
        if not self.adversarial.enabled:
            data.pop("adversarial")  # off = as before the section existed: older runs still resume
        if data["heads"]["feature_layers"] == []:
            data["heads"].pop("feature_layers")  # the final state only = as before the key existed
        if not data["data"]["prompt_positions"]:
            data["data"].pop("prompt_positions")  # the answers only = as before the key existed
        if not data["loss"]["kl_topk"]:
            data["loss"].pop("kl_topk")  # the full KL = as before the key existed
        return data

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]


CHOICES = {"data.kind": ("selfdistill", "conversations", "tokens", "job"), "loss.labels": ("teacher", "text"),
           "train.mixed_precision": ("no", "bf16", "fp16"), "train.dtype": ("float32", "float64", "bfloat16"),
           "run.save_dtype": ("float32", "float64", "bfloat16", "float16"), "run.trees_from": ("held_out", "dev"),
           "base_dtype": ("float32", "float64", "bfloat16", "float16"),
           "adversarial.schedule": ("constant", "linear")}
