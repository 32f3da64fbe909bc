"""Finiteness of a version's dense tensors, read from the bytes its verification hashes anyway.

A staged version is read from its files twice before its copy if each check reads them: the
sha256 of every file, then every value finite in the serving dtype (uploaded to the device in
chunks on a GPU: 4-6 s for 16 GB on an H200, after 5 s of hashing). `FiniteScan` rides the
hashing's read instead (`manifest.AlsoRead`): it parses each safetensors file's header, and
for every tensor whose stored values are finite exactly when they are finite in the serving
dtype (the same dtype, or a cast that cannot overflow: 16-bit to float32, float16 to
bfloat16), tests the exponent bits of each piece as it is read (all ones: NaN or Inf), a
few integer instructions per value. What it cannot decide that way (float32 stored for 16-bit
serving, other files, quantized codes) it leaves to `checks.validate`, which checks whatever
`finite` does not name.

Several hashing threads may read one file at once (a file hashed block by block): the counts
are kept under a lock, and each thread tests its pieces in a scratch buffer of its own.
"""

from __future__ import annotations

import bisect
import json
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

import numpy as np
import numpy.typing as npt
import torch

# Stored dtype -> (the little-endian unsigned integer of its width, its exponent bits).
_EXPONENT = {
    "BF16": ("<u2", 0x7F80),
    "F16": ("<u2", 0x7C00),
    "F32": ("<u4", 0x7F800000),
}
_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# (stored, serving) pairs of different dtypes whose cast keeps every finite value finite.
_WIDENING = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float16, torch.bfloat16),
}
_MAX_HEADER = 100 * 2**20  # as the safetensors reader


@dataclass(frozen=True)
class _Tensor:
    name: str
    start: int  # byte offset in its file
    end: int
    uint: str  # the unsigned integer of its width (a numpy dtype)
    exponent: int  # its exponent bits


class FiniteScan:
    """Tests the values of a version's safetensors files as their hashing reads them."""

    def __init__(self, paths: Sequence[Path], dtype: torch.dtype) -> None:
        """`paths`: the version's files (others than safetensors are skipped); `dtype`: the
        serving dtype the values must be finite in."""
        self._tensors = {path: _decidable(path, dtype) for path in paths}
        self._starts = {path: [t.start for t in ts] for path, ts in self._tensors.items()}
        self._bad: dict[Path, set[str]] = {path: set() for path in paths}
        self._seen: dict[Path, dict[str, int]] = {path: {} for path in paths}  # bytes read
        self._lock = threading.Lock()  # over _bad and _seen
        self._scratch = threading.local()  # .buffer: each reading thread's own

    def cuts(self, path: Path) -> Sequence[int]:
        return sorted({o for t in self._tensors.get(path, ()) for o in (t.start, t.end)})

    def read(self, path: Path, offset: int, piece: memoryview) -> None:
        tensors = self._tensors.get(path, [])
        i = bisect.bisect_right(self._starts[path], offset) - 1
        if i < 0 or offset >= tensors[i].end:
            return  # a header, or a tensor it cannot decide
        tensor = tensors[i]
        if piece.nbytes % np.dtype(tensor.uint).itemsize:
            return  # cut mid-value (a short read): never counted whole, so left to validation
        values = np.frombuffer(piece, dtype=tensor.uint)
        scratch: npt.NDArray[np.uint8] | None = getattr(self._scratch, "buffer", None)
        if scratch is None or scratch.nbytes < piece.nbytes:
            scratch = self._scratch.buffer = np.empty(piece.nbytes, dtype=np.uint8)
        bits = scratch[: piece.nbytes].view(tensor.uint)
        np.bitwise_and(values, tensor.exponent, out=bits)
        bad = len(bits) and int(bits.max()) == tensor.exponent  # all exponent bits set
        with self._lock:
            seen = self._seen[path]
            seen[tensor.name] = seen.get(tensor.name, 0) + piece.nbytes
            if bad:
                self._bad[path].add(tensor.name)

    def finite(self) -> dict[str, bool]:
        """Every tensor it read whole: whether its values are all finite (call once every file
        has been hashed)."""
        self._scratch = threading.local()  # this thread's buffer (the others' left with them)
        return {
            t.name: t.name not in self._bad[path]
            for path, tensors in self._tensors.items()
            for t in tensors
            if self._seen[path].get(t.name, 0) == t.end - t.start
        }


class TensorEntry(TypedDict):
    """One tensor of a safetensors header (what the file says; unchecked)."""

    dtype: str  # e.g. BF16
    shape: list[int]
    data_offsets: list[int]  # [begin, end) from the start of the data


def safetensors_header(path: Path) -> tuple[int, dict[str, TensorEntry]]:
    """A safetensors file's header: the offset where its data begins, and each tensor's entry
    (`dtype`, `shape`, `data_offsets` from that offset; `__metadata__` left out).

    Raises:
        OSError, ValueError (its JSON), struct.error: not a readable safetensors header.
    """
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > _MAX_HEADER:
            raise ValueError(f"{path}: a header of {size} bytes")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, cast(dict[str, TensorEntry], header)


def _decidable(path: Path, dtype: torch.dtype) -> list[_Tensor]:
    """The tensors of a safetensors file whose finiteness in `dtype` their stored bits decide,
    by offset; none for another file or one whose header does not parse (its loading says
    what is wrong with it)."""
    if path.suffix != ".safetensors":
        return []
    try:
        data, header = safetensors_header(path)
        out = []
        for name, info in header.items():
            if info.get("dtype") not in _EXPONENT:
                continue
            stored = _DTYPE[info["dtype"]]
            if stored != dtype and (stored, dtype) not in _WIDENING:
                continue
            uint, exponent = _EXPONENT[info["dtype"]]
            begin, end = (int(x) for x in info["data_offsets"])
            if (end - begin) % np.dtype(uint).itemsize or not 0 <= begin <= end:
                continue
            out.append(_Tensor(name, data + begin, data + end, uint, exponent))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
        return []
    out.sort(key=lambda t: t.start)
    return out
