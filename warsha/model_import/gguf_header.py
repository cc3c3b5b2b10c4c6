"""Read the key/value header of a GGUF file without loading any tensor.

Why a reader of our own: the recipe validator must name an unsupported architecture before any
work, and a packaged model arrives as several chunk files whose concatenation is the GGUF; this
streams the header across the chunks in a few milliseconds, with no dependency.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"GGUF"
# GGUF value types: (struct format, size) for the fixed-size ones.
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A file that is not a readable GGUF."""


class ChainReader:
    """Sequential reads over the concatenation of several files (the chunks of one GGUF)."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self._paths = list(paths)
        self._index = 0
        self._fh: BinaryIO | None = open(self._paths[0], "rb")  # noqa: SIM115 - closed in close()

    def read(self, n: int) -> bytes:
        """Exactly ``n`` bytes, crossing file boundaries; :class:`GGUFError` at the end."""
        out = bytearray()
        while len(out) < n:
            assert self._fh is not None
            block = self._fh.read(n - len(out))
            if block:
                out += block
                continue
            self._fh.close()
            self._index += 1
            if self._index >= len(self._paths):
                self._fh = None
                raise GGUFError(f"{self._paths[-1]}: ends inside the GGUF header: truncated; reinstall or re-copy it")
            self._fh = open(self._paths[self._index], "rb")  # noqa: SIM115
        return bytes(out)

    def close(self) -> None:
        """Close the open chunk."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _value(r: ChainReader, vtype: int, keep: bool) -> Any:
    if vtype in _SCALARS:
        fmt, size = _SCALARS[vtype]
        return struct.unpack(fmt, r.read(size))[0]
    if vtype == _STRING:
        (n,) = struct.unpack("<Q", r.read(8))
        raw = r.read(n)
        return raw.decode("utf-8", errors="replace") if keep else None
    if vtype == _ARRAY:
        (etype,) = struct.unpack("<I", r.read(4))
        (count,) = struct.unpack("<Q", r.read(8))
        if etype in _SCALARS and not keep:
            r.read(_SCALARS[etype][1] * count)
            return None
        items = [_value(r, etype, keep) for _ in range(count)]
        return items if keep else None
    raise GGUFError(f"unknown GGUF value type {vtype}")


def read_header(paths: Sequence[Path], keys: Sequence[str] = ()) -> dict[str, Any]:
    """``version``, ``tensor_count`` and the metadata values named in ``keys`` (scalars and
    strings; arrays are skipped unless named). Stops as soon as every key was seen."""
    r = ChainReader(paths)
    try:
        if r.read(4) != MAGIC:
            raise GGUFError(f"{paths[0]}: not a GGUF file (no 'GGUF' magic at its start)")
        version, n_tensors, n_kv = struct.unpack("<IQQ", r.read(20))
        out: dict[str, Any] = {"version": version, "tensor_count": n_tensors}
        wanted = set(keys)
        for _ in range(n_kv):
            if not wanted:
                break
            (klen,) = struct.unpack("<Q", r.read(8))
            key = r.read(klen).decode("utf-8", errors="replace")
            (vtype,) = struct.unpack("<I", r.read(4))
            value = _value(r, vtype, key in wanted)
            if key in wanted:
                out[key] = value
                wanted.discard(key)
        return out
    except struct.error as exc:
        raise GGUFError(f"{paths[0]}: malformed GGUF header ({exc})") from None
    finally:
        r.close()
