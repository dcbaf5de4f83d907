"""The OpenVINO GenAI side of ``draftheads bench --peers openvino``: a script run by its own
venv's Python (:mod:`.peer_openvino` makes that venv), never imported by draftheads — it uses
the standard library, ``numpy`` and ``openvino_genai`` alone, imported inside functions.

Protocol: one JSON object a line on stdin, one JSON object a line answered on stdout.

- First line, the load: ``{"model": folder, "properties": {...}, "eos": [ids], "lookup":
  {"num_assistant_tokens": k, "max_ngram_size": n}}`` → ``{"build": {...}}``: two pipelines
  over the folder, plain greedy and prompt lookup (``LLMPipeline(..., prompt_lookup=True)``),
  each compiled with ``properties``; the build names the versions and the precisions the CPU
  plugin compiled the model with (read back from a compiled copy, not the request).
- Then each run: ``{"mode": "greedy" | "lookup", "ids": [prompt ids], "max_new_tokens": n}`` →
  ``{"tokens": [new ids], "seconds": s, "first_token_seconds": f}``: the ids go in as a tensor
  (no chat template, no tokenizer: the very ids the bench feeds the others), greedy, stopping
  after the first EOS, which is kept as transformers keeps it; ``seconds`` is the wall time of
  ``generate`` alone, ``first_token_seconds`` OpenVINO's own time to the first token.
- Any failure answers ``{"error": "one line"}``; end of stdin ends the process.
"""
from __future__ import annotations

import json
import sys
import time

#: the compiled model's properties the build reports
REPORTED = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS",
            "DYNAMIC_QUANTIZATION_GROUP_SIZE", "EXECUTION_MODE_HINT")


def load(request: dict) -> tuple[dict, dict]:
    """The two pipelines ({mode: (pipeline, config)}) and the build of a load request."""
    import openvino_genai as genai

    props = request["properties"]
    pipelines = {}
    for mode, extra in (("greedy", {}), ("lookup", {"prompt_lookup": True})):
        pipe = genai.LLMPipeline(request["model"], "CPU", **extra, **props)
        pipelines[mode] = (pipe, config(genai, request["eos"], request["lookup"] if mode == "lookup" else None))
    return pipelines, build(request["model"], props)


def config(genai, eos: list[int], lookup: dict | None):
    """Greedy decoding stopping at ``eos``; ``lookup``: prompt lookup's draft length and n-gram size."""
    cfg = genai.GenerationConfig()
    cfg.do_sample = False
    cfg.num_beams = 1
    cfg.repetition_penalty = 1.0
    cfg.min_new_tokens = 0
    cfg.ignore_eos = False
    cfg.set_eos_token_id(int(eos[0]))
    cfg.stop_token_ids = {int(t) for t in eos}
    if lookup:
        cfg.num_assistant_tokens = int(lookup["num_assistant_tokens"])
        cfg.max_ngram_size = int(lookup["max_ngram_size"])
    return cfg


def build(model: str, props: dict) -> dict:
    """Versions, the CPU's optimization capabilities, and what the plugin compiled the model with."""
    import openvino as ov
    import openvino_genai as genai

    core = ov.Core()
    compiled = core.compile_model(f"{model}/openvino_model.xml", "CPU", props)
    return {"openvino": ov.get_version(), "openvino_genai": genai.__version__,
            "capabilities": list(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")),
            "compiled": {key: _name(compiled.get_property(key)) for key in REPORTED}}


def _name(value) -> str:
    """A property as text: an element type by its name (``bf16``), anything else as ``str``."""
    return value.get_type_name() if hasattr(value, "get_type_name") else str(value)


def generate(pipelines: dict, request: dict) -> dict:
    """One run: the new tokens, the seconds of ``generate`` and OpenVINO's time to the first token."""
    import numpy as np
    import openvino as ov

    pipe, cfg = pipelines[request["mode"]]
    cfg.max_new_tokens = int(request["max_new_tokens"])
    ids = ov.Tensor(np.asarray([request["ids"]], dtype=np.int64))
    start = time.perf_counter()
    result = pipe.generate(ids, cfg)
    seconds = time.perf_counter() - start
    first = result.perf_metrics.get_ttft().mean / 1e3
    return {"tokens": [int(t) for t in result.tokens[0]], "seconds": seconds, "first_token_seconds": first}


def answer(reply: dict) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def one_line(err: BaseException) -> str:
    text = " ".join(part.strip() for part in str(err).splitlines() if part.strip())
    return f"{type(err).__name__}: {text[:500]}"


def main() -> int:
    """Serve the protocol until stdin ends; a failed load answers its error and exits 1."""
    pipelines = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if pipelines is None:
                pipelines, info = load(request)
                answer({"build": info})
            else:
                answer(generate(pipelines, request))
        except Exception as err:  # every failure is an answer, never a hang
            answer({"error": one_line(err)})
            if pipelines is None:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
