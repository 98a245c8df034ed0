"""Tokenizer helpers with a stand-in tokenizer: the byte-level alphabet, each token's own text
and bytes (cached), special ids, and the streaming decode's choice of decoder."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest

from adaptermesh.worker.tokenizer_helpers import (
    CHAR_TO_BYTE,
    FIM_TOKEN_SETS,
    TokenizerHelper,
    byte_to_char,
    fim_token_ids,
    is_byte_level,
    piece_of,
    special_ids,
)


class FakeBackend:
    def __init__(self, decoder: dict[str, Any] | None) -> None:
        self.decoder = decoder
        self.decoded: list[list[int]] = []

    def to_str(self) -> str:
        return json.dumps({"decoder": self.decoder})

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        self.decoded.append(token_ids)
        return "backend:" + ",".join(map(str, token_ids))


class FakeAdded:
    def __init__(self, special: bool) -> None:
        self.special = special


class FakeTokenizer:
    """Vocabulary: 0 '<s>' (special), 1 'Ġhi' (byte-level space + hi), 2 '<0xE2>', 3 '▁word',
    4 'Ã©' (the byte-level spelling of 'é'), 5 '<tool>' (added, special), 6 '<note>' (added)."""

    vocab: ClassVar[list[str]] = [
        "<s>",
        "\u0120hi",
        "<0xE2>",
        "\u2581word",
        "\u00c3\u00a9",
        "<tool>",
        "<note>",
    ]

    def __init__(self, backend: FakeBackend | None = None) -> None:
        self.backend_tokenizer = backend
        self.all_special_ids = [0]
        self.added_tokens_decoder = {5: FakeAdded(True), 6: FakeAdded(False)}
        self.conversions = 0
        self.chat_template: str | None = None

    def get_vocab(self) -> dict[str, int]:
        return {token: index for index, token in enumerate(self.vocab)}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        self.conversions += 1
        return self.vocab[token_id]

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return "decoded:" + ",".join(map(str, token_ids))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [len(word) for word in text.split()]
        return {"input_ids": [0, *ids] if add_special_tokens else ids}

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool
    ) -> str:
        assert add_generation_prompt
        assert not tokenize
        return " ".join(message["content"] for message in messages)


def test_byte_level_alphabet_is_a_bijection() -> None:
    table = byte_to_char()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A"
    assert table[ord(" ")] == "\u0120"  # the space is the first byte outside the kept ranges + 256
    assert {char: byte for byte, char in table.items()} == CHAR_TO_BYTE


def test_is_byte_level() -> None:
    assert is_byte_level(FakeTokenizer(FakeBackend({"type": "ByteLevel"})))
    assert is_byte_level(
        FakeTokenizer(FakeBackend({"type": "Sequence", "decoders": [{"type": "ByteLevel"}]}))
    )
    assert not is_byte_level(FakeTokenizer(FakeBackend({"type": "Metaspace"})))
    assert not is_byte_level(FakeTokenizer(None))


def test_special_ids_are_named_and_added_special_tokens() -> None:
    assert special_ids(FakeTokenizer()) == frozenset({0, 5})


@pytest.mark.parametrize(
    ("token_id", "byte_level", "piece"),
    [
        (0, True, ("<s>", b"<s>")),  # special: spelt out
        (5, False, ("<tool>", b"<tool>")),
        (2, False, ("\ufffd", b"\xe2")),  # a SentencePiece byte token is that byte
        (1, True, (" hi", b" hi")),
        (4, True, ("\u00e9", "\u00e9".encode())),  # two byte-level characters, one UTF-8 character
        (3, False, (" word", b" word")),  # SentencePiece's word boundary is a space
        (1, False, ("decoded:1", b"decoded:1")),  # otherwise the tokenizer decodes it alone
    ],
)
def test_piece_of(token_id: int, byte_level: bool, piece: tuple[str, bytes]) -> None:
    tokenizer = FakeTokenizer()
    assert piece_of(tokenizer, token_id, byte_level, special_ids(tokenizer)) == piece


def test_helper_caches_pieces_and_measures_the_longest_token() -> None:
    tokenizer = FakeTokenizer(FakeBackend({"type": "ByteLevel"}))
    helper = TokenizerHelper(tokenizer)
    assert helper.max_token_chars == 6
    assert helper.token_piece(1) == (" hi", b" hi")
    assert helper.token_piece(1) == (" hi", b" hi")
    assert tokenizer.conversions == 1


def test_helper_text_work() -> None:
    backend = FakeBackend({"type": "ByteLevel"})
    helper = TokenizerHelper(FakeTokenizer(backend))
    assert helper.tokenize("ab cde") == [0, 2, 3]
    assert helper.detokenize([1, 2]) == "decoded:1,2"
    assert helper.decode_for_stream([3, 4]) == "backend:3,4"  # the Rust tokenizer directly
    assert backend.decoded == [[3, 4]]
    assert TokenizerHelper(FakeTokenizer(None)).decode_for_stream([3]) == "decoded:3"


def test_chat_template() -> None:
    tokenizer = FakeTokenizer()
    helper = TokenizerHelper(tokenizer)
    messages = [{"role": "user", "content": "ab cde"}]
    assert helper.apply_chat_template(messages) is None  # no template
    tokenizer.chat_template = "{{ messages }}"
    assert helper.apply_chat_template(messages) == [2, 3]  # no special tokens added twice


@pytest.mark.parametrize("names", FIM_TOKEN_SETS)
def test_fim_token_ids_find_each_family_s_set(names: tuple[str, str, str]) -> None:
    vocab = {"a": 0, names[0]: 10, names[1]: 11, names[2]: 12}
    assert fim_token_ids(vocab) == (10, 11, 12)
    # A set with one token missing is no set.
    assert fim_token_ids({names[0]: 10, names[1]: 11}) is None
    assert fim_token_ids({}) is None


class _Marking:
    """A tokenizer that wraps a text's ids in the given leading and trailing tokens."""

    def __init__(self, lead: list[int], trail: list[int], vocab: dict[str, int]) -> None:
        self.lead, self.trail, self.vocab = lead, trail, vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [ord(c) for c in text]
        return {"input_ids": [*self.lead, *ids, *self.trail] if add_special_tokens else ids}


@pytest.mark.parametrize(("lead", "trail"), [([], []), ([1], []), ([1], [2]), ([], [2])])
def test_fill_in_middle_keeps_leading_special_tokens_only(
    lead: list[int], trail: list[int]
) -> None:
    vocab = {"<fim_prefix>": 5, "<fim_suffix>": 6, "<fim_middle>": 7, "a": 97}
    helper = TokenizerHelper(_Marking(lead, trail, vocab))
    assert helper.fill_in_middle("ab", "c") == [*lead, 5, 97, 98, 6, 99, 7]
    assert helper.fill_in_middle([40, 41], "") == [5, 40, 41, 6, 7]
    assert TokenizerHelper(_Marking(lead, trail, {"a": 97})).fill_in_middle("ab", "c") is None
