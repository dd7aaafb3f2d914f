"""A built-in character tokenizer for the toy task: one token per ASCII character.

Ids: 0 = <pad>, 1 = <bos>, 2 = <eos>; every other character's id is its ASCII code (tab, newline
and the printable range 32..126). `vocab_size` is 128, so the id of a character is easy to read in
a tensor dump. Text outside that set is an error (it never round-trips silently).
"""

from __future__ import annotations

from typing import Iterable

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIAL = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>"}
_CHARS = frozenset([9, 10, *range(32, 127)])


class CharTokenizer:
    """Characters <-> ids. `encode(decode(ids)) == ids` for ids without specials, and
    `decode(encode(text)) == text` for any text of tab, newline and printable ASCII."""

    vocab_size = 128
    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    eos_ids: tuple[int, ...] = (EOS_ID,)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of `text`, with <bos> first and/or <eos> last when asked."""
        ids = [ord(c) for c in text]
        for pos, i in enumerate(ids):
            if i not in _CHARS:
                raise ValueError(f"character {text[pos]!r} at position {pos} is not in the "
                                 "char tokenizer's vocabulary (tab, newline, printable ASCII)")
        return ([BOS_ID] if bos else []) + ids + ([EOS_ID] if eos else [])

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; specials are dropped (or shown as <pad>/<bos>/<eos>)."""
        out = []
        for i in ids:
            i = int(i)
            if i in _SPECIAL:
                if not skip_special_tokens:
                    out.append(_SPECIAL[i])
            elif i in _CHARS:
                out.append(chr(i))
            elif not skip_special_tokens:
                out.append(f"<{i}>")
        return "".join(out)

    def decode_until_eos(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to (not including) the first <eos>."""
        ids = list(ids)
        if EOS_ID in ids:
            ids = ids[:ids.index(EOS_ID)]
        return self.decode(ids)
