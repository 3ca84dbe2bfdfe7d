"""A test checkpoint whose greedy output follows a script, to drive the real server end to end.

The tiny checkpoint with every sublayer's output projection (attention o_proj, MLP and expert
down_proj) zeroed: each layer then adds nothing, the mHC streams stay proportional to the
token's embedding, and the final hidden state depends on the current token alone. lm_head is
then solved so that after each token of SCRIPT the next one wins by MARGIN logits (a
first-order chain: a token may appear only once as a source), with RUNNERS_UP second. Anywhere
else the logits are 0 up to rounding: a test must not rest on which of those wins.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

# After the template's `<think>`: reasoning "Hm", then one call of `lookup`, then GLM's
# end-of-turn after tool calls. Thinking off, the prompt ends with `</think>` and the call comes
# at once.
SCRIPT = (
    "<think>",
    "Hm",
    "</think>",
    "<tool_call>",
    "lookup",
    "<arg_key>",
    "ids",
    "</arg_key>",
    "<arg_value>",
    "[7, 8]",
    "</arg_value>",
    "</tool_call>",
    "<|observation|>",
)
MARGIN = 25.0
# Runners-up: after the key token, this piece's first token wins by MARGIN / 2 once a grammar
# forbids the script's choice (a forced boolean argument cannot start with `[`), so the forced
# answer is decided by the weights, not by which of many logits tied at 0 rounding favours.
RUNNERS_UP = {"<arg_value>": "true"}
PREFIX = "model.language_model."


def script_ids(tokenizer: Tokenizer) -> list[int]:
    ids: list[int] = []
    for piece in SCRIPT:
        special = tokenizer.token_to_id(piece)
        ids += (
            [special]
            if special is not None
            else tokenizer.encode(piece, add_special_tokens=False).ids
        )
    return ids


def write_scripted_checkpoint(tiny_dir: Path, out_dir: Path) -> Path:
    shutil.copytree(tiny_dir, out_dir, dirs_exist_ok=True)
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    layers = sum(1 for name in tensors if name.endswith("input_layernorm.weight"))
    for name, tensor in tensors.items():
        in_target = name.startswith(PREFIX + "layers.") and int(name.split(".")[3]) < layers
        if in_target and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    chain = script_ids(tokenizer)
    sources = chain[:-1]
    if len(set(sources)) != len(sources):
        raise ValueError(f"a token repeats in the script {chain}; the chain is first-order")
    embed = tensors[PREFIX + "embed_tokens.weight"].float()
    hidden = embed[sources]
    hidden = (
        tensors[PREFIX + "norm.weight"].float()
        * hidden
        * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True))
    )
    target = torch.zeros(len(sources), embed.shape[0])
    target[torch.arange(len(sources)), torch.tensor(chain[1:])] = MARGIN
    for source, piece in RUNNERS_UP.items():
        first = tokenizer.encode(piece, add_special_tokens=False).ids[0]
        target[sources.index(tokenizer.token_to_id(source)), first] = MARGIN / 2
    tensors["lm_head.weight"] = (torch.linalg.pinv(hidden) @ target).T.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
