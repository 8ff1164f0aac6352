"""A checkpoint's tokenizer files: reading them (tokenizer.json or tiktoken.model) into one loaded tokenizer, and
writing them (the tiny tokenizer of test checkpoints). On the ground floor because two services read the same files:
the tokenizer service serves them, and the shard compiles response-format grammars over their vocabulary."""
