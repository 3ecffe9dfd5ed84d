"""A word-per-id tokenizer for a random-weight model, so that a text prompt is exactly the token
ids a benchmark drew: what a router that takes text prompts only (sglang-router's
``/v1/completions``) needs in front of ``vllm serve``.

    save_word_tokenizer(model_dir, vocab_size=1000)      # tokenizer.json + tokenizer_config.json
    text = words([5, 17, 998])                           # "w5 w17 w998"
    AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=True).input_ids == [5, 17, 998]

Id 0 is the unknown word (``<unk>``); id ``i > 0`` is the word ``w{i}``.  Words are split on
whitespace and nothing is added around them (no BOS, no EOS), so ``len(ids)`` is the prompt's
token count as an instance reports it in ``usage.prompt_tokens``.  Needs ``tokenizers`` and
``transformers`` (the ``hf`` extra), imported when a tokenizer is saved.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["UNKNOWN", "save_word_tokenizer", "words"]

UNKNOWN = "<unk>"


def words(ids: Iterable[int]) -> str:
    """The text whose tokens are ``ids`` (each ``> 0``) under :func:`save_word_tokenizer`'s tokenizer."""
    out = []
    for i in ids:
        if i <= 0:
            raise ValueError(f"id {i} has no word: id 0 is {UNKNOWN}, and ids are non-negative")
        out.append(f"w{i}")
    return " ".join(out)


def save_word_tokenizer(path: str, vocab_size: int, model_max_length: int = 4096) -> None:
    """Write a WordLevel tokenizer of ``vocab_size`` ids to the directory ``path`` (``tokenizer.json``
    and what ``transformers.AutoTokenizer`` reads besides); a model directory already there keeps
    its other files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {UNKNOWN: 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNKNOWN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNKNOWN,
                            model_max_length=model_max_length).save_pretrained(path)
