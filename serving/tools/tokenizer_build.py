"""Build the byte-level BPE tokenizer and chat template files of our checkpoints: the tiny one
(trained on serving/assets/corpus.txt) and the small trained model (on its corpus)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
CHAT_TEMPLATE_PATH = ASSETS_DIR / "chat_template.jinja"

# GLM's special tokens, in GLM's order; they take the last len(SPECIAL_TOKENS) ids.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "/nothink",
)
EOS_TOKEN = "<|endoftext|>"
# A vision checkpoint's further special tokens (GLM's: <|image|> repeated for each image token;
# the video markers transformers' Glm5NextProcessor looks up), after SPECIAL_TOKENS.
VISION_TOKENS: tuple[str, ...] = (
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)


def build_tokenizer(
    vocab_size: int = 1024,
    texts: Iterable[str] | None = None,
    specials: tuple[str, ...] = SPECIAL_TOKENS,
) -> Tokenizer:
    """BPE over `texts` (default: the tiny corpus's lines), the special tokens last."""
    bpe_size = vocab_size - len(specials)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if bpe_size < len(alphabet):
        raise ValueError(f"vocab_size must be at least {len(alphabet) + len(specials)}")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        show_progress=False,
        initial_alphabet=alphabet,
        special_tokens=[],
    )
    if texts is None:
        with CORPUS_PATH.open(encoding="utf-8") as corpus:
            tokenizer.train_from_iterator(corpus, trainer=trainer)
    else:
        tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != bpe_size:
        raise RuntimeError(
            f"corpus yields {tokenizer.get_vocab_size()} BPE tokens, need {bpe_size}"
        )

    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in specials]
    )
    # A special token that collided with a learned token would keep the BPE id instead.
    ids = [tokenizer.token_to_id(token) for token in specials]
    if ids != list(range(bpe_size, vocab_size)):
        raise RuntimeError(f"special tokens did not land at ids {bpe_size}..{vocab_size - 1}")
    return tokenizer


def write_tokenizer_files(
    out_dir: str | Path,
    vocab_size: int = 1024,
    model_max_length: int = 8192,
    texts: Iterable[str] | None = None,
    vision: bool = False,
) -> dict[str, int]:
    """vision: with VISION_TOKENS after GLM's (a vision checkpoint's tokenizer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = SPECIAL_TOKENS + (VISION_TOKENS if vision else ())
    tokenizer = build_tokenizer(vocab_size, texts, specials)
    tokenizer.save(str(out / "tokenizer.json"))

    special_ids = {token: tokenizer.token_to_id(token) for token in specials}
    extra = [token for token in specials if token != EOS_TOKEN]
    config = {
        "added_tokens_decoder": {
            str(token_id): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token, token_id in special_ids.items()
        },
        "additional_special_tokens": extra,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": model_max_length,
        "pad_token": EOS_TOKEN,
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_map = {
        "additional_special_tokens": extra,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2) + "\n", encoding="utf-8"
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(special_map, indent=2) + "\n", encoding="utf-8"
    )
    shutil.copyfile(CHAT_TEMPLATE_PATH, out / "chat_template.jinja")
    return special_ids
