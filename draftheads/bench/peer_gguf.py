"""The GGUF llama.cpp decodes in the bench: the base's own file with its tensors stored in the
bench's dtype, so the peer streams the weights draftheads streams.

Why: the embedded SmolLM2 file is Q4_1 (a quarter of bf16's bytes a token), and draftheads decodes
its weights dequantized; llama.cpp's plain decoding of that file is another function in another
precision. Re-typed here, each tensor holds exactly the values the base was loaded with: its
dequantized values (the ``gguf`` package's, which transformers' GGUF loading uses) rounded to
the dtype to nearest even, as torch rounds them. One-dimensional tensors (the norms) stay as the
file stores them (float32, as llama.cpp keeps them). The file is cached under the draftheads
cache, named by the source's content hash and the dtype, and read back before use: one that
does not parse or holds other tensor types is written again.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..core.atomic import atomic_file
from ..core.errors import InputError
from ..decoding.base.fingerprint import file_sha256
from ..decoding.base.loading import cache_root

#: the bench dtype → the GGUF tensor type and llama.cpp's file type (``LlamaFileType``) for it
GGUF_TYPES = {torch.float32: ("F32", 0), torch.float16: ("F16", 1), torch.bfloat16: ("BF16", 32)}


def typed_gguf(source: Path, dtype: torch.dtype, log=print) -> Path:
    """``source`` with every matrix (:func:`_matrix`) stored as ``dtype`` (cached)."""
    if dtype not in GGUF_TYPES:
        raise InputError(f"--peers llama.cpp: no GGUF tensor type for {dtype}; bench in float32, bfloat16 or float16.")
    kind = GGUF_TYPES[dtype][0]
    target = cache_root() / "peers" / f"{source.stem}-{file_sha256(source)[:16]}.{kind}.gguf"
    problem = _problem(target, kind) if target.is_file() else "absent"
    if problem is None:
        return target
    if problem != "absent":
        log(f"peer file {target} is unusable ({problem}); writing it again.")
    log(f"writing {source.name}'s tensors as {kind} for llama.cpp: {target}")
    with atomic_file(target) as tmp:
        write_typed(source, tmp, *GGUF_TYPES[dtype])
    problem = _problem(target, kind)
    if problem is not None:
        raise InputError(f"--peers llama.cpp: the {kind} copy of {source.name} does not read back ({problem}); "
                         f"delete {target} and run again.")
    return target


def write_typed(source: Path, out: Path, kind: str, file_type: int) -> None:
    """Copy ``source``'s metadata and tensors to ``out``: matrices as ``kind``, the file type
    ``file_type``."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = file_type
        kind_of_value = field.types[0]
        sub_type = field.types[-1] if kind_of_value == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind_of_value, sub_type=sub_type)
    target = gguf.GGMLQuantizationType[kind]
    for tensor in reader.tensors:
        if not _matrix(tensor):
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)  # (rows, cols)
        writer.add_tensor(tensor.name, gguf.quants.quantize(values, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _matrix(tensor) -> bool:
    """Whether a GGUF tensor is one the copy re-types: two or more dimensions above 1."""
    return sum(int(d) > 1 for d in tensor.shape) >= 2


def _problem(path: Path, kind: str) -> str | None:
    """Why ``path`` is not a readable GGUF whose 2+-dimensional tensors are all ``kind`` (None: it is)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        other = [t.name for t in reader.tensors if _matrix(t) and t.tensor_type.name != kind]
    except Exception as err:  # any parse failure: the file is written again
        return f"{type(err).__name__}: {err}"
    if not reader.tensors:
        return "no tensors"
    return f"{len(other)} tensors not {kind}, e.g. {other[0]}" if other else None
