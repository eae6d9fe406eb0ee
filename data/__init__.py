"""Text sources -> BPE tokenizer -> headered token shards -> deterministic training windows."""
