"""Text to token ids and back for the HF adapter (`vd.models.hf.HFModel`): a checkpoint's own tokenizer, or
UTF-8 bytes folded into the vocabulary for a model without one (random weights, a bare checkpoint).

Leaves out the model: an adapter holds one of these and calls it for `encode` and `decode`.
"""

from __future__ import annotations

from typing import Any


class ByteCodec:
    """Text as UTF-8 bytes folded into the vocabulary, for a model without a tokenizer (random weights, a
    bare checkpoint). Decoding reads ids below 256 back as bytes and shows any other id as ``<id>``."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text: str) -> list[int]:
        return [b % self.vocab for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            out += [run.decode("utf-8", errors="replace"), f"<{i}>"]
            run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")


class TokenizerCodec:
    """Text through a checkpoint's HF tokenizer, without special tokens either way."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


Codec = ByteCodec | TokenizerCodec  # what an adapter encodes and decodes with
