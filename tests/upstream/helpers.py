"""What the upstream ports share: the scripted replies of tests/scripted_checkpoint.py.

After the prompt's `<think>` the script reasons "Hm", closes the thought, writes one `lookup` call
with ids [7, 8] and ends the turn with `<|observation|>` (an end token: finish_reason "stop",
matched_stop its id). Thinking off, the prompt ends with `</think>` and the call comes at once.
Where a prompt leaves the script, the logits tie and no test may rest on which token wins.
"""

from __future__ import annotations

from typing import Any

from tests.scripted_checkpoint import script_ids
from tests.test_openai_server import MODEL, USER, Peer

EOT = "<|observation|>"


def script_after(peer: Peer, start: str = "<think>") -> list[int]:
    """The script's ids after `start`, the end token included."""
    chain = script_ids(peer.tokenizer)
    return chain[chain.index(peer.tokenizer.token_to_id(start)) + 1 :]


def script_text(
    peer: Peer, n: int | None = None, *, start: str = "<think>", raw: bool = True
) -> str:
    """The first n tokens of the reply as text (all but the end token when n is None)."""
    ids = script_after(peer, start)[:-1] if n is None else script_after(peer, start)[:n]
    return peer.tokenizer.decode(ids, skip_special_tokens=not raw)


def eot_id(peer: Peer) -> int:
    return peer.tokenizer.token_to_id(EOT)


def chat(peer: Peer, **fields: Any) -> Any:
    body = {"model": MODEL, "messages": USER, "temperature": 0, **fields}
    return peer.client.chat.completions.create(**body)


def complete(peer: Peer, **fields: Any) -> Any:
    return peer.client.completions.create(**{"model": MODEL, "temperature": 0, **fields})


def closing_bias(peer: Peer, *pieces: str) -> dict[str, int]:
    """A logit_bias that makes a grammar close its JSON as soon as it may: where the grammar
    leaves a choice the biased pieces win, elsewhere the grammar decides; without it the scripted
    checkpoint (ties off the script) would fill strings and numbers until max_tokens."""
    return {str(peer.tokenizer.token_to_id(p)): 100 for p in pieces}
