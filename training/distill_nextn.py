"""Distil the NextN draft layer on its own target's greedy outputs, so EAGLE speed-ups can be
measured on checkpoints with random weights.

    python -m training.distill_nextn --model-path DIR --out DIR2 [--steps 400] [--device cuda]
    python -m training.distill_nextn --model-path DIR --out DIR2 --fit-target-head
    python -m training.distill_nextn --model-path DIR --out DIR2 --corpus data/corpus \
        --labels target --depth 3 --lr 5e-4 [--dtype float32]

1. The target continues random prompts greedily (the text EAGLE will have to predict).
2. Target forwards over the sequences (16 at a time) give their pre-norm hidden states h_i
   (and, for --labels target, the target's greedy choice at every position).
3. The draft is trained, through the same forward the server runs (caches included), to map
   (embed(x_{i+1}), h_i) to the label of position i+1 with cross-entropy; only the draft's
   weights change. Labels: `text` (default) the next token x_{i+2}, prompt positions weighted
   0.2 (random prompt tokens are unpredictable); `target` the target's argmax at position i+1,
   every position weighted 1 (what greedy verification accepts, prompts included). With
   --top-k K > 1 a `target` label is the target's top-K distribution (renormalised), and the
   loss the cross-entropy against it: the draft learns the target's near-ties too, not one side.
4. DIR is copied to DIR2 with the new NextN tensors (the target's tensors byte-identical).

--depth K (default 1: step 3 as above) also trains EAGLE's draft steps 2..K, unrolled exactly as
serving/speculative/eagle.py runs them: each row is cut at a random n in the greedy part; the
draft extends over positions 0..n-1 with the target's hiddens (the prefill/catch-up; all its
positions trained as at depth 1), then takes K-1 decode steps at positions n, n+1, .. feeding
back its own pre-norm hidden (not the target's) with the text's next token (the target's greedy
token, which is what d_k is conditioned on whenever verification reaches it), through the same
draft cache. Step k's label is the target's choice k positions ahead; the loss weights steps
1..K by 1.0, 0.8, 0.6, .. (floor 0.2; depth_weights), and the hidden chain keeps its gradients.
Without it the draft only ever saw the target's hiddens and is off-distribution from step 2 on.

A random target has no structure to learn: its draft only memorises the distillation text and
accepts almost nothing on new prompts. --fit-target-head first refits the target's lm_head to a
synthetic first-order Markov language (training/fit_target_head.py, written to DIR2) and then
distils on that target with --labels target, so the draft generalises to prompts it never saw.
Acceptance then measures that synthetic construction, not a trained model.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from kernels import torch_path
from serving.config import ModelConfig
from serving.forward_batch import ForwardBatch
from serving.memory.pool import MemoryPool, PoolPlan
from serving.models.loader import (
    export_checkpoint,
    load_weights,
    resolve_dtype,
    rewrite_checkpoint,
)
from serving.models.nextn import NextNDraft
from serving.tools.generate import StepRunner


def gen_batch(device: str) -> int:
    """Sequences continued together: more on a GPU, where a step of this small model costs its
    kernel launches whatever the batch."""
    return 256 if device.startswith("cuda") else 64


def training_prompts(vocab: int, count: int, prompt_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, min(vocab, 1000), (prompt_len,), generator=g).tolist()
        for _ in range(count)
    ]


def corpus_prompts(
    model_path: str, corpus: str, count: int, prompt_len: int, seed: int
) -> list[list[int]]:
    """`count` windows of `prompt_len` tokens at random places of the corpus's training
    documents (training/corpus.py), in the checkpoint's tokenizer."""
    import random
    from pathlib import Path

    from tokenizers import Tokenizer

    from training.corpus import read_docs

    tok = Tokenizer.from_file(f"{model_path}/tokenizer.json")
    docs = [d["text"] for d in read_docs(Path(corpus) / "train.jsonl.gz")]
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < count:
        ids = tok.encode(rng.choice(docs)[:20000], add_special_tokens=False).ids
        if len(ids) > prompt_len:
            at = rng.randrange(len(ids) - prompt_len)
            out.append(ids[at : at + prompt_len])
    return out


def make_data(
    runner: StepRunner, prompts: list[list[int]], gen_len: int, batch: int
) -> list[list[int]]:
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        gens = runner.greedy(chunk, gen_len)
        out += [p + c for p, c in zip(chunk, gens)]
        print(f"data: {len(out)} of {len(prompts)} sequences", flush=True)
    return out


Choice = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def target_hidden(
    runner: StepRunner, seqs: list[list[int]], per_forward: int = 16, top_k: int = 1
) -> tuple[list[torch.Tensor], list[Choice]]:
    """Per sequence: the target's pre-norm hiddens [L, H] and its choice after each position
    (one extend forward per `per_forward` sequences): top_k 1, the greedy token [L]; more, the
    soft label (ids [L, top_k], probabilities [L, top_k]): the target's top_k tokens with their
    probabilities renormalised over them."""
    hidden, choice = [], []
    for i in range(0, len(seqs), per_forward):
        chunk = seqs[i : i + per_forward]
        states = [runner.add(seq) for seq in chunk]
        lens = [len(seq) for seq in chunk]
        out = runner.step(states, lens, logits="all")
        # clone: a normal tensor (not an inference tensor) that autograd may save
        hidden += [h.float().clone() for h in out.hidden.split(lens)]
        if top_k == 1:
            choice += list(out.logits.argmax(-1).split(lens))
        else:
            probs, ids = torch.softmax(out.logits.float(), -1).topk(top_k, -1)
            probs = probs / probs.sum(-1, keepdim=True)
            choice += [(i.clone(), q.clone()) for i, q in zip(ids.split(lens), probs.split(lens))]
        for st in states:
            runner.release(st)
    return hidden, choice


def _soft(choice: Choice, at) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [..., K], probabilities [..., K]) of `choice` at positions `at`; a greedy choice is
    its token with probability 1."""
    if isinstance(choice, tuple):
        return choice[0][at], choice[1][at]
    ids = choice[at].unsqueeze(-1)
    return ids, torch.ones(ids.shape, device=ids.device)


def depth_weights(depth: int) -> list[float]:
    """Loss weights of draft steps 1..depth: 1.0, 0.8, 0.6, ... (floor 0.2). Step k counts only
    when steps 1..k-1 were all accepted, so it matters less."""
    return [max(0.2, 1.0 - 0.2 * k) for k in range(depth)]


def cosine_factor(step: int, steps: int, start: float, deadline: float | None) -> float:
    """The learning rate's factor: cosine from 1 to 0.1 over the run, whose progress is the
    larger of the steps done and (with a deadline) the time spent."""
    done = step / steps
    if deadline is not None:
        done = max(done, (time.perf_counter() - start) / (deadline - start))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done)))


def fresh_pool(
    config: ModelConfig, plan: PoolPlan, device: str, rows: int, length: int
) -> tuple[MemoryPool, list[int]]:
    """A new pool (empty caches, no autograd history) with `rows` rows of `length` tokens."""
    pool = MemoryPool(config, plan, torch.float32, device)
    out = []
    for _ in range(rows):
        row = pool.alloc_row()
        pages: list[int] = []
        pool.grow(row, pages, length)
        out.append(row)
    return pool, out


def unrolled_steps(
    draft: NextNDraft,
    target,
    pool: MemoryPool,
    rows: list[int],
    seqs: list[list[int]],
    choices: list[Choice],
    hiddens: list[torch.Tensor],
    cuts: list[int],
    labels: str,
    prompt_len: int,
    depth: int,
) -> list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """(logits, (label ids [N, K], label probabilities [N, K]), weights) of draft steps
    1..depth, row b cut at n = cuts[b] (prompt_len <= n <= len - 1 - depth), run as the server's
    EAGLE worker runs them
    (serving/speculative/eagle.py):

    - step 1 (prefill/catch-up extend): draft positions 0..n-1 with inputs (x_{i+1}, the target's
      h_i), leaving the draft cache as the server's before a decode step whose last committed
      token is y = x_n; the output at n-1 gives d1 (label x_{n+1}) and the hidden stashed for
      step 2. Every position of the extend is trained (as at depth 1);
    - step k >= 2 (a draft step): one decode token per row at position n+k-2, input
      (embed(x_{n+k-1}), the draft's own pre-norm hidden from step k-1), attending to that cache
      plus steps 2..k's own writes; label x_{n+k}.

    The input token is the text's (the target's greedy, as n >= prompt_len), not the draft's own
    proposal: greedy verification looks at d_k only when d_1..d_{k-1} equalled those tokens. The
    hidden chain keeps its gradients (step k's loss trains steps 1..k-1's computation too).
    Labels: `target` the target's choice after each position (choices: its argmax, or its top-K
    distribution from target_hidden(top_k=K)), `text` the next token."""
    forward = NextNDraft.forward.__wrapped__  # the server's forward, with autograd on
    device = pool.device
    r2t = pool.req_to_token
    ids = [t for s, n in zip(seqs, cuts) for t in s[1 : 1 + n]]
    batch = ForwardBatch.build(ids, rows, [0] * len(rows), cuts, r2t, logits="all")
    hidden = torch.cat([h[:n] for h, n in zip(hiddens, cuts)])
    out = forward(draft, target, batch, hidden, pool.draft)
    if labels == "target":
        parts = [_soft(c, slice(1, 1 + n)) for c, n in zip(choices, cuts)]
        label = (torch.cat([i for i, _ in parts]), torch.cat([q for _, q in parts]))
        weight = torch.ones(len(ids), device=device)
    else:
        text = torch.tensor([t for s, n in zip(seqs, cuts) for t in s[2 : 2 + n]], device=device)
        label = _soft(text, slice(None))
        weight = torch.tensor(  # random prompt tokens are unpredictable
            [0.2 if i < prompt_len - 1 else 1.0 for n in cuts for i in range(n)], device=device
        )
    steps = [(out.logits, label, weight)]
    hidden = out.hidden[torch.tensor(cuts, device=device).cumsum(0) - 1]
    rows_t = torch.tensor(rows, device=device)
    cut_t = torch.tensor(cuts, device=device)
    seq_len = max(cuts) + depth + 1  # what the server passes for `depth` steps (Eagle.verify)
    for k in range(2, depth + 1):
        tokens = torch.tensor([s[n + k - 1] for s, n in zip(seqs, cuts)], device=device)
        batch = ForwardBatch.uniform(tokens, rows_t, cut_t + k - 2, 1, r2t, seq_len)
        out = forward(draft, target, batch, hidden, pool.draft)
        hidden = out.hidden
        if labels == "target":
            parts = [_soft(c, n + k - 1) for c, n in zip(choices, cuts)]
            label = (torch.stack([i for i, _ in parts]), torch.stack([q for _, q in parts]))
        else:
            text = torch.tensor([s[n + k] for s, n in zip(seqs, cuts)], device=device)
            label = _soft(text, slice(None))
        steps.append((out.logits, label, torch.ones(len(rows), device=device)))
    return steps


def unrolled_losses(*args, **kwargs) -> list[torch.Tensor]:
    """Weighted mean cross-entropy of each draft step of unrolled_steps(*args, **kwargs) against
    its labels' distribution (a greedy label: the usual cross-entropy)."""
    out = []
    for logits, (ids, probs), weight in unrolled_steps(*args, **kwargs):
        ce = -(probs * F.log_softmax(logits.float(), -1).gather(-1, ids)).sum(-1)
        out.append((ce * weight).sum() / weight.sum())
    return out


def train(
    model_path: str,
    out_dir: str,
    steps: int,
    device: str,
    lr: float,
    count: int,
    prompt_len: int,
    gen_len: int,
    batch_size: int,
    seed: int,
    labels: str | None = None,
    fit_target_head: bool = False,
    fit_tokens: int = 65536,
    corpus: str | None = None,
    dtype: str = "auto",
    depth: int = 1,
    top_k: int = 1,
    minutes: float | None = None,
) -> dict:
    """Distil the draft of model_path into out_dir (module docstring). labels: "text" or
    "target" (None: "target" with fit_target_head, else "text"); top_k > 1 with "target": the
    target's top_k distribution as the label, not its argmax. The learning rate decays from lr
    to lr / 10 (cosine_factor). minutes: the training loop stops after this long even if fewer
    than `steps` ran (the export follows), so a run fits a device call."""
    fit = None
    if fit_target_head:
        from training.fit_target_head import fit_head

        fit = fit_head(model_path, out_dir, device, tokens=fit_tokens, seed=seed)
        print(f"fitted the target head: {json.dumps(fit)}", flush=True)
        model_path = out_dir
    labels = labels or ("target" if fit_target_head else "text")
    if labels not in ("text", "target"):
        raise ValueError(f"labels must be 'text' or 'target', not {labels!r}")
    if top_k < 1 or (top_k > 1 and labels != "target"):
        raise ValueError(f"top_k {top_k} needs labels 'target' and must be at least 1")
    if depth < 1:
        raise ValueError(f"depth must be at least 1, not {depth}")
    if depth > 1 and gen_len < depth + 1:  # cuts n lie in prompt_len .. length-1-depth
        raise ValueError(f"depth {depth} needs gen_len of at least {depth + 1}, not {gen_len}")
    config = ModelConfig.from_pretrained(model_path)
    # The text comes from the target in the dtype it is served in: on random weights, bfloat16
    # and float32 greedy continuations part ways within a few tokens.
    served, _ = load_weights(model_path, config, resolve_dtype(dtype, model_path), device)
    page = max(16, config.index_kpool)
    together = gen_batch(device)
    runner = StepRunner(
        served,
        max_requests=together,
        max_context=prompt_len + gen_len + 16,
        page_size=page,
        device=device,
    )
    t0 = time.perf_counter()
    if corpus is not None:
        prompts = corpus_prompts(model_path, corpus, count, prompt_len, seed)
    else:
        prompts = training_prompts(config.vocab_size, count, prompt_len, seed)
    seqs = make_data(runner, prompts, gen_len, together)
    hiddens, choices = target_hidden(runner, seqs, per_forward=together // 4, top_k=top_k)
    data_s = time.perf_counter() - t0
    del served, runner
    target, draft = load_weights(model_path, config, torch.float32, device, load_draft=True)
    for p in draft.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(
        [p for p in draft.parameters() if p.is_floating_point()], lr=lr, weight_decay=0.0
    )
    length = len(seqs[0])
    plan = PoolPlan(
        rows=batch_size,
        pages=batch_size * -(-length // page) + 1,
        page_size=page,
        max_context=length,
        with_draft=True,
        num_draft_tokens=depth + 1 if depth > 1 else 1,  # the server's ring for `depth` steps
    )
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    t1 = time.perf_counter()
    weights = depth_weights(depth)
    depth_losses: list[list[float]] = []
    deadline = None if minutes is None else t1 + 60 * minutes
    with torch_path():  # the Triton kernels have no backward passes; the data used them
        for step in range(steps):
            if deadline is not None and time.perf_counter() > deadline:
                print(f"stopped by --minutes after {step} steps", flush=True)
                break
            for group in opt.param_groups:
                group["lr"] = lr * cosine_factor(step, steps, t1, deadline)
            pool, rows = fresh_pool(config, plan, device, batch_size, length)
            pick = torch.randint(0, len(seqs), (batch_size,), generator=g).tolist()
            # depth 1: every row whole, position i: input x_{i+1} with h_i, positions 0..length-3
            cuts = [length - 2] * batch_size
            if depth > 1:
                cuts = torch.randint(
                    prompt_len, length - depth, (batch_size,), generator=g
                ).tolist()
            per_depth = unrolled_losses(
                draft, target, pool, rows, [seqs[i] for i in pick],
                [choices[i] for i in pick], [hiddens[i] for i in pick], cuts, labels, prompt_len,
                depth,
            )  # fmt: skip
            loss = sum(w * x for w, x in zip(weights, per_depth)) / sum(weights)
            depth_losses.append([x.item() for x in per_depth])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step % 50 == 0 or step == steps - 1:
                each = " ".join(f"{x:.3f}" for x in depth_losses[-1]) if depth > 1 else ""
                print(f"step {step}: loss {loss.item():.3f} {each}".rstrip(), flush=True)
    train_s = time.perf_counter() - t1
    for p in draft.parameters():
        p.requires_grad_(False)
    prefix = f"model.language_model.layers.{config.num_hidden_layers}."
    new = export_checkpoint(config, target, draft)
    rewrite_checkpoint(model_path, out_dir, {n: t for n, t in new.items() if n.startswith(prefix)})
    summary = {
        "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / min(10, len(losses)),
        "data_s": round(data_s, 1),
        "train_s": round(train_s, 1),
        "steps": len(losses),
        "labels": labels,
        "top_k": top_k,
        "depth": depth,
    }
    if depth > 1:
        tail = depth_losses[-10:]
        summary["depth_weights"] = weights
        summary["first_depth_losses"] = depth_losses[0]
        summary["last_depth_losses"] = [sum(col) / len(tail) for col in zip(*tail)]
    if fit is not None:
        summary["fit"] = fit
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--sequences", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="stop the training loop after this many minutes (then export), even before --steps",
    )
    ap.add_argument(
        "--labels",
        choices=["text", "target"],
        default=None,
        help="next text token, or the target's argmax (default: target with --fit-target-head)",
    )
    ap.add_argument(
        "--fit-target-head",
        action="store_true",
        help="first refit the target's lm_head to a synthetic Markov language "
        "(training/fit_target_head.py), then distil on it",
    )
    ap.add_argument("--fit-tokens", type=int, default=65536, help="corpus tokens for the head fit")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="the target's dtype while it writes the distillation text (as it will be served)",
    )
    ap.add_argument(
        "--depth",
        type=int,
        default=1,
        help="draft steps trained unrolled as EAGLE runs them (1: the catch-up step only)",
    )
    ap.add_argument(
        "--top-k",
        type=int,
        default=1,
        help="with --labels target: train on the target's top-K probabilities (renormalised) "
        "instead of its argmax (1)",
    )
    ap.add_argument(
        "--corpus",
        default=None,
        help="prompts from this corpus (training.corpus's output) instead of random tokens",
    )
    args = ap.parse_args()
    summary = train(
        args.model_path,
        args.out,
        args.steps,
        args.device,
        args.lr,
        args.sequences,
        args.prompt_len,
        args.gen_len,
        args.batch_size,
        args.seed,
        labels=args.labels,
        fit_target_head=args.fit_target_head,
        fit_tokens=args.fit_tokens,
        corpus=args.corpus,
        dtype=args.dtype,
        depth=args.depth,
        top_k=args.top_k,
        minutes=args.minutes,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
