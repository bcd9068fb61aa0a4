"""The raw bytes each token stands for (OpenAI's logprobs ``bytes`` field): :class:`TokenBytes`.

No torch here: the gateway and the worker both use it.
"""

from __future__ import annotations

import re

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: character -> byte.

    The mapping of GPT-2's ``bytes_to_unicode`` (openai/gpt-2, ``src/encoder.py``),
    which the ``tokenizers`` ByteLevel pre-tokenizer and decoder share: the 188
    printable bytes ``!``..``~``, ``¡``..``¬`` and ``®``..``ÿ`` stand for themselves;
    the other 68 bytes, in increasing order, take the code points 256, 257, ...
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """The raw bytes each token stands for, as OpenAI's logprobs ``bytes`` field wants.

    A token may hold part of a UTF-8 character (a CJK character or an emoji split
    over two tokens); decoding it alone gives U+FFFD, while these bytes, joined over
    consecutive tokens, give the text back. Byte-level BPE tokens map their
    characters back through the byte-level alphabet; SentencePiece byte-fallback
    tokens ``<0xNN>`` are that byte, and ``▁`` is a space; added and special tokens
    are their text in UTF-8.

    Args:
        hf: the ``tokenizers.Tokenizer``.
    """

    def __init__(self, hf: HFTokenizer) -> None:
        self._hf = hf
        self._added = frozenset(hf.get_added_tokens_decoder())
        self._byte_level = isinstance(hf.decoder, decoders.ByteLevel)

    def __call__(self, token_id: int) -> bytes:
        """The bytes of ``token_id``.

        Raises:
            ValueError: ``token_id`` is not in the vocabulary.
        """
        piece = self._hf.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        if token_id in self._added:
            return piece.encode()
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return piece.replace("\u2581", " ").encode()
