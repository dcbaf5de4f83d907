"""OpenVINO GenAI as a peer of the bs-1 bench (``draftheads bench --peers openvino``): two
columns, ``openvino`` (``LLMPipeline``'s plain greedy decoding) and ``openvino-lookup`` (its
prompt-lookup decoding), each fed the bench's own chat-formatted token ids.

Rules:

- OpenVINO lives in its own venv, ``<cache>/engines/openvino-venv`` (``optimum-intel`` pins
  transformers and torch versions of its own: in the project's venv it would replace them). It
  is made on first use with ``python -m venv`` and pip (:data:`REQUIREMENTS`, torch held at the
  version draftheads runs on, so pip takes that build rather than another one with CUDA
  libraries; torchvision, which optimum-intel lists but a text model's export does not use, is
  removed: its wheel may be built for another torch and breaks transformers' imports). A venv
  without its record of what was installed (an interrupted install, other pins) is made again.
  One that cannot be made (no registry, pip fails) raises :class:`PeerUnavailable`: one line
  saying how to install it, not a failure of the bench.
- The base folder draftheads loaded (the converted SmolLM2 folder for the embedded GGUF, or any
  local transformers folder) is exported once with ``optimum-cli export openvino --weight-format
  fp32`` into ``<cache>/engines/openvino/<folder name>-<hash>``: float32 holds the loaded values
  exactly; the bench's dtype is the CPU plugin's inference precision (:data:`PRECISIONS`), its
  KV cache in the same type and dynamic activation quantization off, so OpenVINO rounds the
  weights and activations to the bench's dtype on its own, as torch does. What the plugin
  compiled with is read back and kept in the peer's build.
- One runner process (:mod:`.openvino_runner`) serves all of a run's prompts, both modes warm;
  each call has :data:`CALL_TIMEOUT_S`, the setup steps :data:`SETUP_TIMEOUT_S`.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from ..core.errors import DraftheadsError, InputError, cannot_write, one_line
from ..decoding.base.loading import cache_root
from .runs import PROMPT_LOOKUP_TOKENS

#: what the venv installs (the versions this peer was checked with)
REQUIREMENTS = ("openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0")
#: the bench dtype → the CPU plugin's inference (and KV cache) precision
PRECISIONS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
#: prompt lookup as transformers' control runs it: 10 draft tokens, n-grams up to 2
LOOKUP = {"num_assistant_tokens": PROMPT_LOOKUP_TOKENS, "max_ngram_size": 2}
#: each column's name → the runner's mode
MODES = {"openvino": "greedy", "openvino-lookup": "lookup"}
SETUP_TIMEOUT_S, CALL_TIMEOUT_S = 3600, 900
RUNNER = Path(__file__).with_name("openvino_runner.py")
#: written last into a finished venv / exported model
VENV_RECORD, MODEL_RECORD = "draftheads-venv.json", "draftheads_openvino.json"
MODEL_FILES = ("openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml", "openvino_detokenizer.xml")


class PeerUnavailable(DraftheadsError):
    """A peer that cannot be had on this machine: the bench logs it as one line and goes on."""


def engines() -> Path:
    return cache_root() / "engines"


def install_hint() -> str:
    venv = engines() / "openvino-venv"
    return (f"draftheads makes {venv} on first use (needs PyPI); by hand: python -m venv {venv} && "
            f"{venv}/bin/pip install {' '.join(REQUIREMENTS)}")


def runner_env() -> dict[str, str]:
    """The environment of the venv's processes: this one's, without what points Python elsewhere."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _run_logged(command: list[str], log_file: Path, timeout: float = SETUP_TIMEOUT_S) -> int:
    """Run ``command`` with its output appended to ``log_file``; its exit status (124: timed out)."""
    with open(log_file, "a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        try:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=runner_env(),
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def _last_line(log_file: Path) -> str:
    lines = [line.strip() for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def venv_record() -> dict:
    return {"requirements": list(REQUIREMENTS), "torch": torch.__version__}


def engine_python(log=print) -> Path:
    """The OpenVINO venv's Python, the venv made first where it is absent or not finished."""
    venv = engines() / "openvino-venv"
    python = venv / "bin" / "python"
    try:
        if json.loads((venv / VENV_RECORD).read_text()) == venv_record() and python.is_file():
            return python
    except (OSError, ValueError):
        pass
    return make_venv(venv, log)


def make_venv(venv: Path, log=print) -> Path:
    """Make ``venv`` afresh with :data:`REQUIREMENTS`; :class:`PeerUnavailable` naming the log if it fails."""
    shutil.rmtree(venv, ignore_errors=True)
    log_file, constraints = venv.with_suffix(".log"), venv.parent / "openvino-venv-constraints.txt"
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        log_file.write_text("")
        constraints.write_text(f"torch=={torch.__version__}\n")
    except OSError as err:
        raise PeerUnavailable(f"its venv cannot be made in {venv.parent} ({err.strerror or err})") from None
    log(f"peer openvino: making its venv {venv} (pip install {' '.join(REQUIREMENTS)}; log: {log_file})")
    python = venv / "bin" / "python"
    steps = {"python -m venv": [sys.executable, "-m", "venv", str(venv)],
             "pip install": [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-c", str(constraints),
                             *REQUIREMENTS],
             "pip uninstall torchvision": [str(python), "-m", "pip", "uninstall", "-y", "torchvision"],
             "the import check": [str(python), "-c", "import openvino_genai, optimum.intel"]}
    for step, command in steps.items():
        if _run_logged(command, log_file) != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise PeerUnavailable(f"its venv could not be made ({step} failed: {_last_line(log_file)}; "
                                  f"log: {log_file})")
    (venv / VENV_RECORD).write_text(json.dumps(venv_record()))
    return python


def base_folder(base) -> Path:
    """The local folder the base was loaded from; anything else is one line naming what to pass."""
    folder = Path(getattr(base, "name_or_path", "") or "")
    if not str(folder) or not (folder / "config.json").is_file():
        raise InputError(f"--peers openvino: the base ({folder or 'in memory'}) is not a local model folder; pass "
                         "--base a .gguf or a local transformers folder (or leave --base out).")
    return folder


def model_key(folder: Path) -> str:
    """``folder``'s name and a hash of its path and its files' names, sizes and times."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    digest = hashlib.sha256(json.dumps([str(folder.resolve()), files]).encode()).hexdigest()
    return f"{folder.name}-{digest[:12]}"


def exported(python: Path, folder: Path, log=print) -> Path:
    """``folder`` as an OpenVINO model (fp32 weights), exported once into the cache."""
    target = engines() / "openvino" / model_key(folder)
    if (target / MODEL_RECORD).is_file() and all((target / name).is_file() for name in MODEL_FILES):
        return target
    tmp, log_file = target.with_name(target.name + ".tmp"), target.with_name(target.name + ".log")
    for stale in (target, tmp):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        log_file.write_text("")
    except OSError as err:
        raise cannot_write(target.parent, err) from None
    log(f"peer openvino: exporting {folder} to {target} (fp32 weights; log: {log_file})")
    command = [str(python.parent / "optimum-cli"), "export", "openvino", "--model", str(folder),
               "--task", "text-generation-with-past", "--weight-format", "fp32", str(tmp)]
    if _run_logged(command, log_file) != 0 or not all((tmp / name).is_file() for name in MODEL_FILES):
        shutil.rmtree(tmp, ignore_errors=True)
        raise DraftheadsError(f"--peers openvino: exporting {folder} failed ({_last_line(log_file)}); see {log_file}, "
                              "or run without --peers openvino.")
    (tmp / MODEL_RECORD).write_text(json.dumps({"source": str(folder), "weight_format": "fp32"}))
    os.replace(tmp, target)
    return target


class Runner:
    """The runner process (:mod:`.openvino_runner`): a JSON line out, a JSON line back, each
    answer awaited at most ``timeout`` seconds; stopped at exit."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=env if env is not None else runner_env())
        self.lines: queue.Queue = queue.Queue()
        self.errors: deque[str] = deque(maxlen=20)
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()
        atexit.register(self.close)

    def _pump(self) -> None:
        """The answers, then None at the end of the process's output."""
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _drain(self) -> None:
        """The last lines of the process's stderr (read always, so it never blocks on a full pipe)."""
        for line in self.process.stderr:
            self.errors.append(line)

    def call(self, request: dict, timeout: float = CALL_TIMEOUT_S) -> dict:
        """Send ``request``; its answer (the next line that is a JSON object: anything else the
        engine prints is kept with its stderr), or one line naming why there is none."""
        deadline = time.monotonic() + timeout
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except OSError:
            self._stopped()
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.process.kill()  # hung: not waited for
                self.process.wait()
                raise DraftheadsError(f"--peers openvino: the runner gave no answer in {timeout:.0f} s; "
                                      "run without --peers openvino or with fewer --max-new-tokens.") from None
            if line is None:
                self._stopped()
            try:
                reply = json.loads(line)
            except ValueError:
                reply = None
            if isinstance(reply, dict):
                break
            self.errors.append(line)
        if "error" in reply:
            raise DraftheadsError(f"--peers openvino: the runner failed ({reply['error']}); "
                                  "run without --peers openvino.")
        return reply

    def _stopped(self) -> None:
        """The runner has ended: one line with the last of its stderr (or its exit status)."""
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        tail = one_line("".join(list(self.errors)[-3:]))[-300:] or f"exit status {self.process.poll()}"
        raise DraftheadsError(f"--peers openvino: the runner stopped ({tail}); run without --peers openvino.")

    def close(self) -> None:
        """End the process: stdin closed, then killed if it does not exit within 10 s."""
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


#: a column's run, as :data:`.peers.PeerRun`
Run = Callable[[torch.Tensor, int], tuple[torch.Tensor, float, float]]


def mode_run(runner: Runner, mode: str) -> Run:
    """One column: ``mode``'s decoding of the ids, as (prompt + new ids, seconds, seconds to the first token)."""
    def run(ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, float, float]:
        reply = runner.call({"mode": mode, "ids": ids[0].tolist(), "max_new_tokens": int(max_new_tokens)})
        new = torch.tensor([reply["tokens"]], dtype=ids.dtype)
        return torch.cat([ids, new], dim=1), float(reply["seconds"]), float(reply["first_token_seconds"])
    return run


def openvino_runs(base, eos: list[int], log=print) -> dict[str, Run]:
    """OpenVINO's two columns on ``base`` in the base's dtype, on torch's thread count, one runner for both."""
    if base.dtype not in PRECISIONS:
        raise InputError(f"--peers openvino: no OpenVINO CPU precision for {base.dtype}; bench in float32, bfloat16 "
                         "or float16.")
    folder = base_folder(base)
    python = engine_python(log)
    model = exported(python, folder, log)
    threads = torch.get_num_threads()
    precision = PRECISIONS[base.dtype]
    properties = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": precision,
                  "KV_CACHE_PRECISION": precision, "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
    runner = Runner([str(python), str(RUNNER)])
    build = runner.call({"model": str(model), "properties": properties, "eos": [int(t) for t in eos],
                         "lookup": LOOKUP}, timeout=SETUP_TIMEOUT_S)["build"]
    runs = {}
    for name, mode in MODES.items():
        runs[name] = mode_run(runner, mode)
        runs[name].build = {**build, "mode": mode, "model": model.name, "weight_format": "fp32", "threads": threads,
                            "requested": properties, **({"lookup": LOOKUP} if mode == "lookup" else {})}
    return runs
