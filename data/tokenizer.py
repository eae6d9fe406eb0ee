"""Train a byte-level BPE tokenizer on the training text, or load an existing tokenizer.json."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist (data.tokenizer.path)")
    tok = Tokenizer.from_file(str(path))
    # A foreign tokenizer.json may carry truncation / padding from its training setup: the documents would be cut
    # or padded in silence. tokenizers does not save encode_special_tokens, so it is set on every load: a literal
    # "<|endoftext|>" in text is text, as in the shards data.prepare wrote (model.checkpoint sets it too).
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True
    return tok


def id_bound(tok: Tokenizer) -> int:
    """One past the largest token id: the embedding rows and the shard dtype the ids need. get_vocab_size counts
    tokens, which is less where a foreign tokenizer.json skips ids."""
    return max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1


EOS_FALLBACKS = ("</s>", "<|end_of_text|>", "<eos>")


def eos_id(tok: Tokenizer) -> int:
    token_id = tok.token_to_id(EOS)
    if token_id is None:  # a foreign tokenizer: fall back to its own end-of-text style token, if any
        for candidate in EOS_FALLBACKS:
            if tok.token_to_id(candidate) is not None:
                return tok.token_to_id(candidate)
        raise ValueError(f"the tokenizer has no end-of-text token (none of {', '.join((EOS, *EOS_FALLBACKS))}): "
                         "documents are separated by one")
    return token_id


def single_token_id(tok: Tokenizer, text: str) -> int | None:
    """The id of `text` if the tokenizer encodes it as exactly one token, else None."""
    ids = tok.encode(text, add_special_tokens=False).ids  # a post-processor's "<s> $A" would make every text two
    return ids[0] if len(ids) == 1 else None


def tokenizer_hash(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]
