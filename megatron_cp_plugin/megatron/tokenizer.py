"""Byte-level tokenizer that needs no download, for megatron.core's GPTDataset.

Ids 0-255 are the UTF-8 bytes of the text, id 256 is the end-of-document token (EOD, also
returned as EOS). There is no BOS token and no pad token inside the vocabulary: ``pad`` is -1,
the same sentinel megatron.core's datasets fall back to (GPTDataset maps it to id 0 and masks
its loss), so no real byte is ever mistaken for padding.

The class duck-types the interface megatron.core uses (``GPTDatasetConfig(tokenizer=...)``
reads ``vocab_size``, ``eod``, ``pad`` and ``unique_identifiers``; the legacy
``MegatronLegacyTokenizer`` and the new ``MegatronTokenizerBase`` names are provided too) and
does not import megatron, so it is cheap to import.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Dict, Iterable, List

__all__ = ["ByteTokenizer", "BYTE_VOCAB_SIZE", "EOD_ID"]

EOD_ID = 256
"""Id of the end-of-document token."""

BYTE_VOCAB_SIZE = 257
"""Smallest vocabulary: 256 bytes + EOD."""


class ByteTokenizer:
    """UTF-8 byte tokenizer: ids 0-255 = bytes, 256 = EOD.

    Args:
        vocab_size: size of the embedding table to report; None (default) means 257. A larger
            value (e.g. 512, to make the vocabulary divisible by 128 * tensor-parallel size)
            only adds unused ids 257..vocab_size-1 that ``tokenize`` never produces and
            ``detokenize`` skips. Must be >= 257.
    """

    def __init__(self, vocab_size: int | None = None) -> None:
        if vocab_size is None:
            vocab_size = BYTE_VOCAB_SIZE
        vocab_size = int(vocab_size)
        if vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(
                f"ByteTokenizer: vocab_size must be >= {BYTE_VOCAB_SIZE} (256 bytes + EOD), "
                f"got {vocab_size}"
            )
        self._vocab_size = vocab_size
        self.path = None  # MegatronTokenizerBase attribute; nothing is loaded from disk
        self.unique_identifiers = OrderedDict(
            [("class", f"{type(self).__module__}.{type(self).__qualname__}"),
             ("vocab_size", vocab_size)]
        )
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self._vocab_size})"

    # --- encoding / decoding -------------------------------------------------------------
    def tokenize(self, text: str) -> List[int]:
        """Return the UTF-8 bytes of ``text`` as ids (no EOD is added)."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Decode byte ids to text; special/unused ids are skipped, bad UTF-8 is replaced."""
        if hasattr(ids, "tolist"):  # numpy array / torch tensor
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, *args, **kwargs):
        """Not supported (a plain byte tokenizer has no chat template)."""
        raise NotImplementedError("ByteTokenizer has no chat template")

    # --- vocabulary ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Size of the id space (257 unless padded by the constructor argument)."""
        return self._vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        """Token string -> id: one latin-1 character per byte, '<eod>', '<unused_N>'."""
        v = {bytes([b]).decode("latin-1"): b for b in range(256)}
        v["<eod>"] = EOD_ID
        for i in range(BYTE_VOCAB_SIZE, self._vocab_size):
            v[f"<unused_{i}>"] = i
        return v

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token string (inverse of ``vocab``)."""
        return {i: t for t, i in self.vocab.items()}

    # --- special tokens ------------------------------------------------------------------
    @property
    def eod(self) -> int:
        """End-of-document id (256)."""
        return EOD_ID

    @property
    def eos(self) -> int:
        """Same as ``eod``."""
        return EOD_ID

    @property
    def pad(self) -> int:
        """-1: no pad id in the vocabulary (megatron.core's own pad sentinel)."""
        return -1

    @property
    def bos(self) -> None:
        """None: there is no BOS token."""
        return None

    # NeMo / megatron.core.tokenizers style aliases
    eod_id = eod
    eos_id = eos
    pad_id = pad
    bos_id = bos

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        """No additional special tokens."""
        return []


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int = 1) -> int:
    """The embedding and output layer's rows, as Megatron-LM pads them (--make-vocab-size-divisible-by): the
    vocabulary rounded up to a multiple of divisible_by x TP, so that each tensor-parallel rank holds an equal
    slice (ids past the tokenizer's are never inputs or targets; their logits only train downwards)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
