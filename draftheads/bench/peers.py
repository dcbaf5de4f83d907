"""The CPU engines a user would run instead of draftheads, as columns of the bs-1 bench
(``draftheads bench --peers llama.cpp``): each decodes the bench's own token ids greedily, timed
like transformers' ``generate`` (prefill included), its tokens compared with transformers' greedy
ones. A peer that is not installed is one line saying how to install it, never a failure.

- ``llama.cpp`` (``llama-cpp-python``, ``pip install -e ".[peers]"``): the GGUF the base was
  loaded from (the embedded SmolLM2 file, or the ``.gguf`` given as ``--base``) with its tensors
  in the bench's dtype — the very weights draftheads decodes (:mod:`.peer_gguf`) — plain greedy
  decoding on the torch thread count. Besides the whole call, the time to its first token is
  kept: the rest over the other tokens is llama.cpp's decoding time a token, apart from prefill.
- ``openvino`` (OpenVINO GenAI in a venv of its own that draftheads makes on first use,
  :mod:`.peer_openvino`): two columns, ``openvino`` (plain greedy) and ``openvino-lookup`` (its
  prompt lookup), the base folder exported once with float32 weights and compiled in the bench's
  dtype, on the torch thread count.

A peer's loader gives one run (the column takes the peer's name) or several by column name.
"""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Callable

import torch

from ..core.errors import InputError
from ..decoding.base.loading import converted_from
from .peer_gguf import typed_gguf
from .peer_openvino import PeerUnavailable, install_hint, openvino_runs

#: peer name → (module it needs in this venv, None: none; how to install it)
PEERS = {"llama.cpp": ("llama_cpp", 'pip install -e ".[peers]"  (llama-cpp-python)'),
         "openvino": (None, "OpenVINO GenAI in its own venv")}
#: a peer's run: prompt ids (1, L) and new tokens at most → (prompt + new tokens (1, L + n), seconds,
#: seconds to the first new token)
PeerRun = Callable[[torch.Tensor, int], tuple[torch.Tensor, float, float]]


def parse_peers(value: str) -> tuple[str, ...]:
    """``--peers``: a comma-separated list of :data:`PEERS`; an unknown name is one line listing them."""
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise InputError(f"unknown peer(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PEERS)}.")
    return names


def load_peers(names: tuple[str, ...], base, eos: list[int], log=print) -> dict[str, PeerRun]:
    """The installed peers among ``names`` by column, ready to run on ``base``; each missing one
    (its module not found, or :class:`~.peer_openvino.PeerUnavailable`: its venv cannot be made)
    logged as one line naming how to install it."""
    runs = {}
    for name in names:
        module, install = PEERS[name]
        if module is not None and importlib.util.find_spec(module) is None:
            log(f"peer {name}: not installed; to compare with it: {install}")
            continue
        try:
            loaded = LOADERS[name](base, eos)
        except PeerUnavailable as err:
            log(f"peer {name}: not installed: {err}; to compare with it: {install_hint()}")
            continue
        runs.update(loaded if isinstance(loaded, dict) else {name: loaded})
    return runs


def source_gguf(base) -> Path:
    """The GGUF file ``base`` was converted from (the embedded SmolLM2 one, or the ``.gguf`` given
    as ``--base``), as its conversion recorded it (:func:`~draftheads.decoding.base.loading.converted_from`)."""
    folder = getattr(base, "name_or_path", "") or ""
    gguf = converted_from(folder) if folder else None
    if gguf is None:
        raise InputError(f"--peers llama.cpp: the base ({folder or 'in memory'}) was not loaded from a GGUF file; "
                         "pass --base a .gguf (or leave --base out for the embedded SmolLM2).")
    if not gguf.is_file():
        raise InputError(f"--peers llama.cpp: the base's GGUF {gguf} is gone; reinstall its package or pass --base "
                         "the .gguf again.")
    return gguf


def llama_cpp_run(base, eos: list[int]) -> PeerRun:
    """llama.cpp's plain greedy decoding of the base's GGUF in the base's dtype, on torch's thread count."""
    from llama_cpp import Llama

    import llama_cpp

    threads = torch.get_num_threads()
    gguf = typed_gguf(source_gguf(base), base.dtype)
    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    stops = set(eos)

    def run(ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, float, float]:
        new: list[int] = []
        start = time.perf_counter()
        first = 0.0
        for token in llm.generate(ids[0].tolist(), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                  reset=True):
            if not new:
                first = time.perf_counter() - start
            new.append(int(token))
            if token in stops or len(new) >= max_new_tokens:
                break
        seconds = time.perf_counter() - start
        return torch.cat([ids, torch.tensor([new], dtype=ids.dtype)], dim=1), seconds, first
    run.build = {"version": llama_cpp.__version__, "gguf": gguf.name, "threads": threads,
                 "library": os.environ.get("LLAMA_CPP_LIB_PATH", "the package's own"),
                 "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    return run


def peer_builds(runs: dict[str, PeerRun]) -> dict[str, dict]:
    """What each loaded peer is (version, file, library, the CPU features it was built for), for the bench's meta."""
    return {name: getattr(run, "build", {}) for name, run in runs.items()}


LOADERS = {"llama.cpp": llama_cpp_run, "openvino": openvino_runs}
