"""Attention cores: the only code that knows the cache layout (request rows, KV slots, pooled
keys, tail rings) and picks a kernel path for the batch's shape (extend, uniform, decode)."""
