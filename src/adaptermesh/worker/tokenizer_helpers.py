"""The engine's tokenizer work: tokenize and detokenize, the streaming decode, chat templates,
and each token's own text and exact bytes (logprob entries name tokens)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

__all__ = [
    "CHAR_TO_BYTE",
    "FIM_TOKEN_SETS",
    "TokenizerHelper",
    "byte_to_char",
    "fim_token_ids",
    "is_byte_level",
    "load_tokenizer",
    "piece_of",
    "special_ids",
]


def load_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's Hugging Face tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def byte_to_char() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, every other
    byte for the code point 256 + its rank among them."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {byte: chr(byte) for byte in keep}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


CHAR_TO_BYTE = {char: byte for byte, char in byte_to_char().items()}


def is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder is byte-level BPE (GPT-2 style)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, AttributeError):
        return False
    return "ByteLevel" in json.dumps(decoder)


def special_ids(tokenizer: Any) -> frozenset[int]:
    """Named special tokens and added tokens marked special (the text skips both)."""
    ids = {int(token_id) for token_id in getattr(tokenizer, "all_special_ids", ())}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids |= {int(token_id) for token_id, token in added.items() if getattr(token, "special", False)}
    return frozenset(ids)


def piece_of(
    tokenizer: Any, token_id: int, byte_level: bool, special: frozenset[int]
) -> tuple[str, bytes]:
    """(text, exact bytes) of one token on its own. Byte-level vocabularies map back to their
    bytes (a token may hold part of a multi-byte character; its text then shows U+FFFD);
    SentencePiece byte tokens (<0xE2>) are that byte; special tokens are spelt out."""
    token = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(token, str):
        token = ""
    if token_id in special:
        return token, token.encode()
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        with contextlib.suppress(ValueError):
            raw = bytes([int(token[3:5], 16)])
            return raw.decode("utf-8", errors="replace"), raw
    if byte_level and all(char in CHAR_TO_BYTE for char in token):
        raw = bytes(CHAR_TO_BYTE[char] for char in token)
        return raw.decode("utf-8", errors="replace"), raw
    text = (
        token.replace("\u2581", " ")
        if "\u2581" in token
        else str(
            tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )
    )
    return text, text.encode()


# Fill-in-the-middle tokens (prefix, suffix, middle) of the model families that have them:
# StarCoder/SantaCoder and others, Qwen2.5-Coder, CodeLlama (SentencePiece, with and without
# the word-boundary mark), DeepSeek-Coder (begin, hole, end: the same prefix-suffix-middle order).
FIM_TOKEN_SETS: tuple[tuple[str, str, str], ...] = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>"),
    ("<PRE>", "<SUF>", "<MID>"),
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),
)


def fim_token_ids(vocab: dict[str, int]) -> tuple[int, int, int] | None:
    """The (prefix, suffix, middle) token ids of the first FIM set ``vocab`` has whole."""
    for names in FIM_TOKEN_SETS:
        ids = [vocab.get(name) for name in names]
        if all(token is not None for token in ids):
            return (int(ids[0] or 0), int(ids[1] or 0), int(ids[2] or 0))
    return None


def _leading_tokens(tokenizer: Any) -> list[int]:
    """The special tokens ``tokenizer`` puts before a text's own tokens."""
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    marked = list(tokenizer("a")["input_ids"])
    for start in range(len(marked) - len(plain) + 1):
        if marked[start : start + len(plain)] == plain:
            return marked[:start]
    return []


class TokenizerHelper:
    """One tokenizer's text work for the engine, with each token's piece cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # No token covers more characters than its vocabulary string has (byte-level BPE
        # spells one byte per character, SentencePiece one character per character), so a text
        # longer than max_model_len * this cannot fit the context: it is refused untokenised.
        self.max_token_chars = max((len(token) for token in tokenizer.get_vocab()), default=1)
        self._pieces: dict[int, tuple[str, bytes]] = {}
        self._byte_level = is_byte_level(tokenizer)
        self._special_ids = special_ids(tokenizer)
        self.fim_ids = fim_token_ids(dict(tokenizer.get_vocab()))
        # The tokens the tokenizer puts in front of a text (Llama's BOS; not one it appends),
        # kept in front of a fill-in-the-middle prompt.
        self._leading = _leading_tokens(tokenizer)

    def fill_in_middle(self, prefix: str | list[int], suffix: str) -> list[int] | None:
        """The prefix-suffix-middle prompt (leading special tokens, FIM prefix token, the
        prefix, FIM suffix token, the suffix, FIM middle token), or None when the tokenizer
        has no FIM tokens. A prefix given as token ids is used as sent."""
        if self.fim_ids is None:
            return None
        start, hole, middle = self.fim_ids
        if isinstance(prefix, str):
            head = [*self._leading, start, *self._plain(prefix)]
        else:
            head = [start, *prefix]
        return [*head, hole, *self._plain(suffix), middle]

    def _plain(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def detokenize(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def decode_for_stream(self, token_ids: list[int]) -> str:
        # The Rust tokenizer directly: the Python wrapper costs more than the decode itself, and
        # this runs for every sequence on every step.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return str(backend.decode(token_ids, skip_special_tokens=True))
        return str(
            self.tokenizer.decode(
                token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
        )

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and exact bytes on its own (cached; logprob entries name tokens)."""
        hit = self._pieces.get(token_id)
        if hit is None:
            hit = self._pieces[token_id] = piece_of(
                self.tokenizer, token_id, self._byte_level, self._special_ids
            )
        return hit

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int] | None:
        """The chat's token ids through the model's template; ``tools`` (OpenAI function
        definitions) go to the template as its ``tools`` variable."""
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        extra = {} if tools is None else {"tools": tools}
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **extra
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
