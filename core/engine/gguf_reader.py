"""gguf-py's GGUFReader with its arrays read at numpy speed, field for field the same.

Why: gguf-py reads an array field one element at a time, a recursive call and a few numpy views each, so a
tokenizer's 49k-152k tokens, merges and token types took 2.3 s (SmolLM2) to 7.4 s (Qwen2.5) per open on one
core, and an engine opens each GGUF file several times (its numerics check, its block matrices, its
checkpoint), as does every server and judge worker. This reader builds the same parts (one numpy view per
element: a 1-element array for a number, a length and a byte view for a string; plain ndarray views of the
same mapping, not memmap ones), the same data indices and types, from one view of a numeric array and one walk
over a string array's lengths. Other fields, the tensor infos and the tensors are gguf-py's own code.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType


class FastArraysReader(GGUFReader):
    """A GGUFReader whose array fields (of numbers or strings) are built without a call per element."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        if len(raw_itype) != 1 or len(alen) != 1:
            raise ValueError("array header past the end of the file")
        itype, count, offs = GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
        if count == 0:  # gguf-py then types it [ARRAY] alone
            return super()._get_field_parts(orig_offs, raw_type)
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            if len(values) != count:
                raise ValueError(f"array of {count} values past the end of the file")
            parts = [raw_itype, alen, *values.view(np.ndarray).reshape(count, 1)]
            return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), [GGUFValueType.ARRAY, itype]
        if itype != GGUFValueType.STRING:  # nested arrays: gguf-py's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        return self._string_array(orig_offs, raw_itype, alen, count)

    def _string_array(self, orig_offs: int, raw_itype: np.ndarray, alen: np.ndarray, count: int
                      ) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        """A string array's parts as gguf-py builds them, [type, count, len 0, bytes 0, len 1, ...], the
        lengths read in one walk over the mapped bytes and viewed from one array of them."""
        data = self.data.view(np.ndarray)  # slices of a memmap cost a finalizer call each
        buf, size = memoryview(data), len(data)
        swapped = self.byte_order == "S"
        order = ("big" if sys.byteorder == "little" else "little") if swapped else sys.byteorder
        starts, lengths, offs = [], [], orig_offs + 12
        for _ in range(count):
            if offs + 8 > size:
                raise ValueError("string array past the end of the file")
            n = int.from_bytes(buf[offs:offs + 8], order)
            if offs + 8 + n > size:
                raise ValueError("string array past the end of the file")
            starts.append(offs + 8)
            lengths.append(n)
            offs += 8 + n
        lens = np.array(lengths, dtype=np.uint64)
        if swapped:
            lens = lens.byteswap().view(lens.dtype.newbyteorder("S"))
        parts: list[np.ndarray] = [raw_itype, alen]
        for i, (start, n) in enumerate(zip(starts, lengths)):
            parts.append(lens[i:i + 1])
            parts.append(data[start:start + n])
        return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), [GGUFValueType.ARRAY, GGUFValueType.STRING]
