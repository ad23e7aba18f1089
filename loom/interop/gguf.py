"""GGUF files (llama.cpp's format) into loom: :func:`gguf_architecture` reads the header's
``general.architecture`` without any dependency (so a wrong file is refused before anything is
loaded); :func:`read_gguf` dequantizes the weights through ``transformers``
(``from_pretrained(dir, gguf_file=name)``, needs the ``gguf`` and ``accelerate`` packages) and
writes the tokenizer inside the file as a ``tokenizer.json``.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

from loom.errors import ConfigError

# GGUF value types -> struct format of the scalar ones (8 string, 9 array handled apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}


def _read(fh: BinaryIO, fmt: str):
    size = struct.calcsize("<" + fmt)
    data = fh.read(size)
    if len(data) != size:
        raise EOFError
    return struct.unpack("<" + fmt, data)[0]


def _string(fh: BinaryIO) -> str:
    n = _read(fh, "Q")
    if n > 1 << 20:
        raise ValueError(f"string of {n} bytes")
    data = fh.read(n)
    if len(data) != n:
        raise EOFError
    return data.decode("utf-8", errors="replace")


def _value(fh: BinaryIO, kind: int):
    if kind in SCALARS:
        return _read(fh, SCALARS[kind])
    if kind == 8:
        return _string(fh)
    if kind == 9:
        inner, n = _read(fh, "I"), _read(fh, "Q")
        if inner in SCALARS:  # skip, never needed here
            fh.seek(n * struct.calcsize("<" + SCALARS[inner]), os.SEEK_CUR)
            return None
        for _ in range(n):
            _value(fh, inner)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")


def gguf_architecture(path: str) -> str:
    """``general.architecture`` of a GGUF file (``gemma3``, ``llama``, ...). Raises ConfigError
    naming ``--from-hf PATH`` for a file that is not GGUF or has no architecture key."""
    try:
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ConfigError(f"--from-hf {path}: not a GGUF file (no GGUF magic); give a "
                                  f"Gemma 3 .gguf file or a Hugging Face model directory")
            version = _read(fh, "I")
            if version < 2:
                raise ConfigError(f"--from-hf {path}: GGUF version {version} is too old (2+)")
            _read(fh, "Q")  # tensor count
            for _ in range(_read(fh, "Q")):
                key, kind = _string(fh), _read(fh, "I")
                value = _value(fh, kind)
                if key == "general.architecture":
                    return str(value)
    except ConfigError:
        raise
    except OSError as e:
        raise ConfigError(f"--from-hf {path}: {e.strerror or e}") from None
    except (EOFError, ValueError, struct.error):
        raise ConfigError(f"--from-hf {path}: truncated or malformed GGUF header") from None
    raise ConfigError(f"--from-hf {path}: GGUF header has no general.architecture")


def find_gguf(src: str) -> str | None:
    """The GGUF file ``src`` names: itself (``*.gguf`` or GGUF magic), or the single ``*.gguf``
    of a directory without ``config.json``; None for a Hugging Face directory."""
    if os.path.isfile(src):
        return src
    if os.path.isdir(src) and not os.path.exists(os.path.join(src, "config.json")):
        found = sorted(f for f in os.listdir(src) if f.endswith(".gguf"))
        if len(found) > 1:
            raise ConfigError(f"--from-hf {src}: several GGUF files ({', '.join(found)}); "
                              f"name one")
        if found:
            return os.path.join(src, found[0])
    return None


def read_gguf(path: str, tokenizer_out: str, mappings) -> tuple[dict, dict]:
    """``(config.json dict, state dict)`` of a GGUF file whose architecture one of ``mappings``
    (the families' :class:`~loom.models.family.HFConversion`, e.g. Gemma 3's) imports,
    dequantized to fp32 by ``transformers``; its tokenizer is written to ``tokenizer_out`` (a
    tokenizer.json path). Raises ConfigError for another architecture, or naming the packages
    that are missing."""
    arch = gguf_architecture(path)
    known = [m for m in mappings if m.gguf_architectures]
    if not any(arch in m.gguf_architectures for m in known):
        names = " or ".join(m.title for m in known) or "any family"
        archs = ", ".join(a for m in known for a in m.gguf_architectures)
        raise ConfigError(f"--from-hf {path}: a GGUF of architecture {arch!r}, not {names} "
                          f"(general.architecture = {archs}); loom imports GGUF only for "
                          f"{names}")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        d, name = os.path.split(os.path.abspath(path))
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    except ImportError as e:
        raise ConfigError(f"--from-hf {path}: reading GGUF needs transformers, gguf and "
                          f"accelerate (pip install transformers gguf accelerate): {e}") from None
    backend = getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tokenizer", None)
    if backend is not None:
        backend.save(tokenizer_out)
    config = model.config.to_dict()
    return config, {k: v.detach() for k, v in model.state_dict().items()}
