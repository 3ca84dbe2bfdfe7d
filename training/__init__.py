"""The small model's pipeline, offline: corpus, tokenizer shards, training, NextN distillation,
evaluation (docs/SMALL_MODEL.md). Not in the wheel (the `training` extra holds what it needs
beyond the runtime); nothing in serving/, workers/, kernels/ or router/ imports it."""
