"""Tokenizer wrapper: the model's own (with its chat template), or a byte-level stand-in for
synthetic-weight engines, whose real tokenizer cannot be downloaded here."""
from __future__ import annotations

from pathlib import Path

from trtkv.errors import TrtkvError
from trtkv.models.config import ModelArch


class HFTokenizer:
    def __init__(self, tok):
        self.tok = tok
        self.eos_token_id = tok.eos_token_id
        self.has_chat_template = bool(getattr(tok, "chat_template", None))

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        if chat and self.has_chat_template:
            text = self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                add_generation_prompt=True)
            return list(self.tok(text, add_special_tokens=False)["input_ids"])
        return list(self.tok(prompt)["input_ids"])

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class ByteTokenizer:
    """UTF-8 bytes offset by 3 (0..2 reserved: pad, bos, eos); ids beyond 258 decode to nothing."""

    eos_token_id = None
    has_chat_template = False

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        return self.encode(prompt)

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


def load_tokenizer(path: Path, arch: ModelArch):
    if not path.is_dir() or not any(path.iterdir()):
        return ByteTokenizer(arch.vocab_size)
    try:
        from transformers import AutoTokenizer

        return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
    except Exception as e:
        raise TrtkvError(f"cannot load the tokenizer in {path}: {e}") from None
