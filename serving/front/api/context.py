"""What every route needs: server args, the engine client, tokenizer, template, model facts."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
from tokenizers import Tokenizer

from serving.executor.constrained import (
    CONSTRAINT_FIELDS,
    GrammarError,
    check_grammar,
    grammar_of,
    load_tokenizer,
)
from serving.front.api.context_length import input_too_long
from serving.front.api.errors import APIError
from serving.front.api.image_request import VisionSetup
from serving.front.api.structured_output import GlmTokens
from serving.front.chat import ChatTemplate, load_chat_template
from serving.front.engine_client import EngineClient, EngineUnavailable
from serving.protocol import SchedulerReady
from serving.sampling_params import SamplingParams
from serving.server_args import ArgsError, ServerArgs

INLINE_ENCODE_CHARS = 4096  # shorter texts are tokenised on the event loop (a thread costs more)

# generation_config.json fields that become sampling defaults (as SGLang and vLLM do)
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class FrontContext:
    args: ServerArgs
    client: EngineClient
    tokenizer_file: Path
    tokenizer: Tokenizer
    glm_tokens: GlmTokens | None
    chat_template: ChatTemplate | None
    model_config: dict[str, Any]
    sampling_defaults: dict[str, Any]
    created: int
    max_token_chars: int  # the longest vocabulary entry, in characters (bytes for byte-level BPE)
    vision: VisionSetup | None = None  # the image path (None: a text-only checkpoint)

    @classmethod
    def load(cls, args: ServerArgs, client: EngineClient) -> FrontContext:
        model_dir = Path(args.model_path)
        tokenizer_file = Path(args.tokenizer_path or args.model_path) / "tokenizer.json"
        if not tokenizer_file.is_file():
            flag = "--tokenizer-path" if args.tokenizer_path else "--model-path"
            raise ArgsError(f"{flag} {tokenizer_file.parent}: no tokenizer.json")
        generation = _read_json(model_dir / "generation_config.json")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        model_config = _read_json(model_dir / "config.json")
        return cls(
            args=args,
            client=client,
            tokenizer_file=tokenizer_file,
            tokenizer=tokenizer,
            glm_tokens=GlmTokens.find(tokenizer),
            chat_template=load_chat_template(
                args.model_path, args.tokenizer_path, args.chat_template
            ),
            model_config=model_config,
            sampling_defaults={k: generation[k] for k in _GENERATION_DEFAULTS if k in generation},
            created=int(time.time()),
            max_token_chars=_longest_token(tokenizer),
            vision=VisionSetup.load(args, model_config),
        )

    @property
    def model_name(self) -> str:
        return self.args.model_name

    def scheduler(self) -> SchedulerReady:
        """The scheduler's facts; EngineUnavailable (503) unless it takes requests now."""
        if not self.client.is_ready or self.client.ready is None:
            raise EngineUnavailable(self.client.state)
        return self.client.ready

    def check_model(self, model: str | None) -> None:
        # sglang-router fills in "unknown" when its client sent no model: treat it as omitted.
        if model and model != "unknown" and model not in (self.model_name, self.args.model_path):
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def check_text_length(
        self, chars: int, context_length: int, param: str, what: str = "the prompt"
    ) -> None:
        """APIError 400 for a text of `chars` characters that cannot fit the context, decided
        before tokenising (or rendering) it: every token covers at most max_token_chars
        characters, so a longer text has more tokens than the context holds. Hazard: a
        normalizer that drops characters would break this; the byte-level BPE tokenizers served
        here keep every byte."""
        bound = context_length * self.max_token_chars
        if chars > bound:
            size = (
                f"{what}: {chars} characters, more than the {bound} that {context_length} "
                f"tokens of at most {self.max_token_chars} characters each can hold"
            )
            raise input_too_long(size, context_length, param)

    async def encode_checked(
        self, text: str, add_special_tokens: bool, context_length: int, param: str
    ) -> list[int]:
        """Token ids of `text` after the length check. Long texts are tokenised in a thread
        through encode_batch, which releases the GIL (encode does not): /health, the bootstrap
        server and other requests keep being served meanwhile."""
        self.check_text_length(len(text), context_length, param)
        if len(text) <= INLINE_ENCODE_CHARS:
            return self.encode(text, add_special_tokens)
        batch = await asyncio.to_thread(
            self.tokenizer.encode_batch, [text], add_special_tokens=add_special_tokens
        )
        return batch[0].ids

    def grammar_tokenizer(self) -> llguidance.LLTokenizer:
        ready = self.scheduler()
        return load_tokenizer(str(self.tokenizer_file), tuple(sorted(ready.eos_token_ids)))

    def check_constraint(self, sampling: SamplingParams) -> None:
        """APIError 400 unless the request's output constraint compiles for this tokenizer."""
        name = next((n for n in CONSTRAINT_FIELDS if getattr(sampling, n) is not None), None)
        if name is None:
            return
        try:
            check_grammar(grammar_of(sampling), self.grammar_tokenizer(), name)
        except GrammarError as e:
            raise APIError(400, str(e), name) from e


def _longest_token(tokenizer: Tokenizer) -> int:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(token.encode()) for token in vocab), default=1)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
