"""Megatron-LM compatible memory-mapped indexed dataset (``MMIDIDX`` format).

``PREFIX.idx`` layout (little-endian), as written by Megatron's ``indexed_dataset.py``::

    b"MMIDIDX\\x00\\x00"   magic (9 bytes)
    <Q 1                   version
    <B code                token dtype (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                           6 float64, 7 float32, 8 uint16)
    <Q S                   sequence count
    <Q D                   document-index count (= documents + 1; starts with 0)
    int32[S]               sequence sizes (tokens)
    int64[S]               sequence byte offsets into PREFIX.bin
    int64[D]               document indices (sequence index where each document starts/ends)

``PREFIX.bin`` holds the raw token ids back to back. loom writes one sequence per document, so
sequences and documents coincide for every dataset ``loom preprocess`` produces.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, Optional

import numpy as np

from loom.errors import ConfigError

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def best_dtype(vocab_size: int) -> type:
    """Smallest token dtype for a vocabulary: ``np.uint16`` if ``vocab_size < 65500`` else ``np.int32``."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    """Megatron's dtype code of a numpy dtype; ValueError if the dtype has none."""
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no MMIDIDX code; use one of "
                         f"{sorted(str(np.dtype(v)) for v in DTYPE_CODES.values())}") from None


def _missing(prefix: str, what: str, flag: str = "--data-path") -> ConfigError:
    return ConfigError(
        f"{flag} {prefix}: {what}; re-run `loom preprocess --input ... --output-prefix {prefix}` "
        f"to (re)build {prefix}.bin and {prefix}.idx")


class IndexedDatasetBuilder:
    """Writes ``PREFIX.bin`` / ``PREFIX.idx`` atomically.

    Tokens go to temporary files; :meth:`finalize` writes the index and renames both into place
    with ``os.replace``, so a crash never leaves a half-written dataset under ``PREFIX``.

    Args:
        prefix: output path without extension.
        dtype: numpy token dtype (see :func:`best_dtype`); ValueError if it has no MMIDIDX code.
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        d = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(d, exist_ok=True)
        self._tmp_bin = f"{self.prefix}.bin.tmp{os.getpid()}"
        self._tmp_idx = f"{self.prefix}.idx.tmp{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        self._sizes: list[int] = []
        self.num_tokens = 0
        self.max_token_id = -1  # largest id written (-1: none yet)

    def add_document(self, ids: Iterable[int]) -> None:
        """Append one document (a 1-D sequence of token ids, any int dtype; cast to ``dtype``).

        Raises ValueError if an id does not fit the dataset dtype.
        """
        arr = np.asarray(ids)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.size and arr.dtype.kind in "iu" and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if int(arr.min()) < info.min or int(arr.max()) > info.max:
                raise ValueError(f"token id out of range for {self.dtype}: "
                                 f"[{int(arr.min())}, {int(arr.max())}]")
        arr = arr.astype(self.dtype, copy=False)
        if arr.size:
            self.max_token_id = max(self.max_token_id, int(arr.max()))
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(int(arr.size))
        self.num_tokens += int(arr.size)

    def finalize(self) -> None:
        """Write the index and move ``PREFIX.bin`` / ``PREFIX.idx`` into place (atomic renames)."""
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(_MAGIC)
            f.write(struct.pack("<Q", _VERSION))
            f.write(struct.pack("<B", self._code))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(self._tmp_idx, self.prefix + ".idx")

    def abort(self) -> None:
        """Drop the temporary files (nothing under ``PREFIX`` is touched)."""
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(p):
                os.remove(p)


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` / ``PREFIX.idx``.

    Attributes:
        sizes: int32[S] tokens per sequence.
        pointers: int64[S] byte offsets into ``.bin``.
        document_indices: int64[D+1] sequence index boundaries of the documents.
        dtype: numpy token dtype.

    ``len(ds)`` is the number of sequences, which is the number of documents for datasets written
    by :class:`IndexedDatasetBuilder`. ``ds[i]`` is a 1-D numpy array (dtype ``ds.dtype``).

    Raises:
        ConfigError: naming ``flag PREFIX`` (default ``--data-path``) when ``.bin``/``.idx`` is missing, the index is
            not MMIDIDX, or ``.bin`` is shorter than the index says (truncated).
    """

    def __init__(self, prefix: str, flag: str = "--data-path"):
        self.prefix = str(prefix)
        self.flag = flag
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise _missing(self.prefix, f"{p} does not exist", self.flag)
        with open(idx_path, "rb") as f:
            head = f.read(len(_MAGIC) + 8 + 1 + 8 + 8)
        if len(head) < 34 or head[:9] != _MAGIC:
            raise _missing(self.prefix, f"{idx_path} is not a Megatron MMIDIDX index (bad header)", self.flag)
        version, = struct.unpack("<Q", head[9:17])
        code, = struct.unpack("<B", head[17:18])
        n_seq, n_doc = struct.unpack("<QQ", head[18:34])
        if version != _VERSION or code not in DTYPE_CODES:
            raise _missing(self.prefix, f"{idx_path} has unsupported version {version} / dtype code {code}", self.flag)
        self.dtype = np.dtype(DTYPE_CODES[code])
        need = 34 + n_seq * 4 + n_seq * 8 + n_doc * 8
        if os.path.getsize(idx_path) < need:
            raise _missing(self.prefix, f"{idx_path} is truncated ({os.path.getsize(idx_path)} < {need} bytes)", self.flag)
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = 34
        self.sizes = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=off)
        off += n_seq * 4
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=off)
        off += n_seq * 8
        self.document_indices = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=off)
        self._idx = idx
        expected = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n_seq else 0
        actual = os.path.getsize(bin_path)
        if actual < expected:
            raise _missing(self.prefix, f"{bin_path} is truncated ({actual} bytes, the index needs {expected})", self.flag)
        self._check_belongs(idx_path, bin_path, actual, expected)
        if actual == 0:
            self._bin = np.empty(0, dtype=np.uint8)
        else:
            self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8)

    def _check_belongs(self, idx_path: str, bin_path: str, actual: int, expected: int) -> None:
        """Refuse an index that does not describe this ``.bin`` (offsets past the end or not
        contiguous, negative sizes, document boundaries out of order, a ``.bin`` longer than
        the index covers); the message names both files."""
        sizes, ptr, docs = self.sizes, self.pointers, self.document_indices
        n = len(sizes)
        why = None
        if n and (int(sizes.min()) < 0 or int(ptr[0]) != 0):
            why = "its first offset is not 0 or a size is negative"
        elif n > 1 and not np.array_equal(ptr[1:], ptr[:-1] + sizes[:-1].astype(np.int64) * self.dtype.itemsize):
            why = "its byte offsets are not contiguous"
        elif actual != expected:
            why = f"it covers {expected} bytes but {bin_path} has {actual}"
        elif len(docs) and (int(docs[0]) != 0 or int(docs[-1]) != n or bool(np.any(np.diff(docs) < 0))):
            why = "its document boundaries do not cover its sequences in order"
        if why:
            raise ConfigError(
                f"{self.flag} {self.prefix}: index {idx_path} does not belong to {bin_path} ({why}); "
                f"re-run `loom preprocess --input ... --output-prefix {self.prefix}` to rebuild both")

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        """Documents D (``len(document_indices) - 1``)."""
        return max(len(self.document_indices) - 1, 0)

    @property
    def num_tokens(self) -> int:
        """Total tokens in ``.bin``."""
        return int(self.sizes.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (1-D, dtype ``self.dtype``, read-only view).

        Raises IndexError for ``i`` out of range or a window outside the sequence.
        """
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence {i} out of range [0, {n})")
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"window [{offset}, {offset + length}) outside sequence {i} of {size} tokens")
        start = int(self.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(int(i))
