"""A byte-level tokenizer for demos and tests: ids 0..255 are the UTF-8 bytes, then specials.

    id      meaning
    0..255  the byte with that value
    256     BOS (prepended by ``encode(add_bos=True)``)
    257     EOS (stops generation when passed as a stop token)

The engine knows nothing about tokenization; it only sees ids.
"""

from __future__ import annotations


class ByteTokenizer:
    BOS = 256
    EOS = 257
    vocab_size = 258

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return ([self.BOS] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
