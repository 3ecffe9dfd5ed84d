"""The word-per-id tokenizer: a text of words is exactly the ids it was written from."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.testing.word_tokenizer import save_word_tokenizer, words

VOCAB = 1000


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_word_tokenizer(str(path), VOCAB)
    assert (Path(path) / "tokenizer.json").is_file()
    return AutoTokenizer.from_pretrained(str(path))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=300))
def test_words_round_trip_to_the_same_ids_with_nothing_added(tokenizer: object, ids: list[int]) -> None:
    """With special tokens on, as an instance tokenizes a completion's prompt: the same ids, no
    BOS or EOS, so ``usage.prompt_tokens`` is the drawn length."""
    assert tokenizer(words(ids)).input_ids == ids  # type: ignore[operator]


def test_an_unknown_word_is_id_zero_and_id_zero_has_no_word(tokenizer: object) -> None:
    assert tokenizer("w5 nonsense w7").input_ids == [5, 0, 7]  # type: ignore[operator]
    with pytest.raises(ValueError, match="id 0"):
        words([3, 0])
