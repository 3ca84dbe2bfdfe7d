"""Give a random-weight target a learnable language: refit its lm_head to a synthetic Markov chain.

    python -m training.fit_target_head --model-path DIR --out DIR2 [--device cuda]

A target with random weights has near-flat logits and chaotic greedy text, so nothing can learn
to predict it (an EAGLE draft only memorises the text it was distilled on). This replaces the
target's lm_head, and only it, so that the target speaks a synthetic first-order language:

1. A random sparse first-order Markov chain over token ids [0, min(vocab, 1000)) (the range
   bench.spec and the tests draw prompts from): every token has `successors` next tokens; the
   most likely one has probability 0.55-0.75 and every other at least 0.1 less (greedy choices
   are never near-ties). Seeded, deterministic.
2. The target (in the dtype it is served in, on `device`) runs teacher-forced over corpus
   sequences sampled from the chain, each behind a short random-token prefix (so the fit also
   holds after random prompts); we keep the input of lm_head, norm(stream mean), exactly as the
   model computes it, and the next-token labels of the chain part.
3. lm_head is fitted in closed form by ridge regression onto the one-hot labels:
   W = (X rows summed per label) @ (X^T X + lam I)^-1, solved in float64. Rows of tokens never
   seen as labels (everything outside the chain's range, EOS included) come out exactly 0.
4. W is scaled so that the median top logit on the fitting data is TOP_LOGIT (20), and written
   into DIR2 under the same tensor name and dtype; every other tensor is copied unchanged.

The result is a synthetic construction, not a trained model: greedy text follows the chain's most
likely successors (soon a cycle), which an EAGLE draft can learn and then predict on prompts it
never saw (training/distill_nextn.py --fit-target-head).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from safetensors import safe_open

from serving.config import ModelConfig
from serving.models.glm5_next import Glm5NextForCausalLM
from serving.models.loader import (
    checkpoint_files,
    load_weights,
    resolve_dtype,
    rewrite_checkpoint,
)
from serving.tools.generate import StepRunner

CHAIN_TOKENS = 1000  # bench.spec and the tests draw prompt tokens from [0, 1000)
# W is scaled so that the median top logit over the fitting positions is TOP_LOGIT (a constant
# in logit units; the factor itself depends on how well the hidden states identify the token:
# ~30 where the fit is sharp, more on the 64-wide tiny preset). Why 20: the tokens outside the
# chain keep logit ~0, so a temperature-1 sample stays on the chain (1000 tokens at logit 0
# hold ~1000 * e^-20 of the mass), and the draft, which shares lm_head, can reach a low
# cross-entropy. Argmax is scale-free, so the scale is not what keeps bfloat16 from flipping
# greedy choices: the chain's own margin does (top-1 - top-2 >= 0.1 in probability, i.e.
# >= 13% of the top logit on a sharp fit, where bfloat16 rounds a logit by <= 2^-9 of itself);
# fit_head reports how often the served dtype's argmax differs from float32's.
TOP_LOGIT = 20.0


def markov_chain(
    num_tokens: int, successors: int = 3, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """succ [num_tokens, k] next tokens, probs [num_tokens, k]: column 0 the most likely."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.stack(
        [torch.randperm(num_tokens, generator=g)[:successors] for _ in range(num_tokens)]
    )
    top = 0.55 + 0.2 * torch.rand(num_tokens, generator=g)
    probs = torch.zeros(num_tokens, successors)
    probs[:, 0] = top
    if successors > 1:
        rest = 1 - top
        second = rest * (0.5 + 0.3 * torch.rand(num_tokens, generator=g))
        probs[:, 1] = second if successors > 2 else rest
        if successors > 2:
            split = torch.rand(num_tokens, successors - 2, generator=g) + 0.1
            probs[:, 2:] = (rest - second)[:, None] * split / split.sum(1, keepdim=True)
    return succ, probs


def sample_corpus(
    succ: torch.Tensor,
    probs: torch.Tensor,
    count: int,
    length: int,
    prefix_len: int,
    seed: int = 0,
) -> torch.Tensor:
    """[count, prefix_len + length]: a random-token prefix, then the chain from its last token."""
    g = torch.Generator().manual_seed(seed)
    n = succ.shape[0]
    seqs = torch.empty(count, prefix_len + length, dtype=torch.long)
    seqs[:, :prefix_len] = torch.randint(0, n, (count, prefix_len), generator=g)
    cur = seqs[:, prefix_len - 1] if prefix_len else torch.randint(0, n, (count,), generator=g)
    for i in range(prefix_len, prefix_len + length):
        pick = torch.multinomial(probs[cur], 1, generator=g).squeeze(1)
        cur = succ[cur, pick]
        seqs[:, i] = cur
    return seqs


def head_inputs(
    model: Glm5NextForCausalLM, runner: StepRunner, seqs: list[list[int]]
) -> torch.Tensor:
    """norm(stream mean) at every position, float32 [sum(len), H]: what lm_head multiplies."""
    states = [runner.add(s) for s in seqs]
    try:
        with torch.inference_mode():
            out = runner.step(states, [len(s) for s in seqs], logits="last")
            return model.norm(out.hidden).float()
    finally:
        for s in states:
            runner.release(s)


def ridge_head(
    x: torch.Tensor, labels: torch.Tensor, num_labels: int, ridge: float
) -> torch.Tensor:
    """[num_labels, H] float32 minimising |x W^T - onehot(labels)|^2 + lam |W|^2.

    lam = ridge * mean diagonal of x^T x (scale-free)."""
    x64 = x.double()
    gram = x64.T @ x64
    lam = ridge * gram.diagonal().mean()
    gram.diagonal().add_(lam)
    sums = torch.zeros(num_labels, x.shape[1], dtype=torch.float64, device=x.device)
    sums.index_add_(0, labels, x64)
    return torch.linalg.solve(gram, sums.T).T.float()  # gram is symmetric


def fit_head(
    model_path: str,
    out_dir: str,
    device: str = "cpu",
    tokens: int = 65536,
    seq_len: int = 128,
    prefix_len: int = 16,
    successors: int = 3,
    ridge: float = 1e-3,
    top_logit: float = TOP_LOGIT,
    batch_tokens: int = 4096,
    seed: int = 0,
) -> dict:
    """Fit lm_head of model_path to a Markov chain (module docstring); write out_dir."""
    t0 = time.perf_counter()
    config = ModelConfig.from_pretrained(model_path)
    dtype = resolve_dtype("auto", model_path)
    model, _ = load_weights(model_path, config, dtype, device)
    n = min(config.vocab_size, CHAIN_TOKENS)
    succ, probs = markov_chain(n, successors, seed)
    count = -(-tokens // seq_len)
    corpus = sample_corpus(succ, probs, count, seq_len, prefix_len, seed + 1)
    length = prefix_len + seq_len
    per_batch = max(1, batch_tokens // length)
    page = max(16, config.index_kpool)
    runner = StepRunner(
        model, max_requests=per_batch, max_context=length, page_size=page, device=device
    )
    xs, ys = [], []
    for i in range(0, count, per_batch):
        chunk = corpus[i : i + per_batch]
        # position j predicts token j+1; keep those whose next token is a chain step
        x = head_inputs(model, runner, chunk.tolist()).view(len(chunk), length, -1)
        start = max(prefix_len - 1, 0)
        xs.append(x[:, start : length - 1].reshape(-1, x.shape[-1]))
        ys.append(chunk[:, start + 1 :].reshape(-1))
    x = torch.cat(xs)
    y = torch.cat(ys).to(device)
    del xs, runner
    collect_s = time.perf_counter() - t0
    w = ridge_head(x, y, n, ridge)
    scale = top_logit / (x @ w.T).max(-1).values.median().item()
    w *= scale
    # how well the fitted target follows the chain on its own fitting data
    top2 = (x @ w.T).topk(2, dim=-1)
    best = succ[:, 0].to(device)
    prev = corpus[:, max(prefix_len - 1, 0) : length - 1].reshape(-1).to(device)
    follows = (top2.indices[:, 0] == best[prev]).float().mean().item()
    margin = top2.values[:, 0] - top2.values[:, 1]
    # the fitted head as served: does the dtype's rounding keep the argmax?
    served = (x.to(dtype) @ w.to(dtype).T).float().argmax(-1)
    served_agree = (served == top2.indices[:, 0]).float().mean().item()
    names = {}  # lm_head, and any DeepSeek-style NextN copy of it (the loader skips those)
    for path in checkpoint_files(model_path):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name == "lm_head.weight" or name.endswith(".shared_head.head.weight"):
                    names[name] = f.get_slice(name).get_dtype()
    if "lm_head.weight" not in names:
        raise ValueError(f"{model_path} has no lm_head.weight (tied embeddings are not supported)")
    stored = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    head = torch.zeros(config.vocab_size, config.hidden_size, dtype=stored[names["lm_head.weight"]])
    head[:n] = w.cpu().to(head.dtype)
    new = {name: head.to(stored[d]) for name, d in names.items()}
    rewrite_checkpoint(model_path, out_dir, new)
    return {
        "chain_tokens": n,
        "fit_tokens": int(x.shape[0]),
        "follows_chain": round(follows, 4),
        "scale": round(scale, 2),
        "median_top1_margin": round(margin.median().item(), 2),
        "margin_below_1": round((margin < 1).float().mean().item(), 4),
        "served_dtype_agrees": round(served_agree, 4),
        "collect_s": round(collect_s, 1),
        "total_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=65536, help="corpus tokens to fit on")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=16)
    ap.add_argument("--successors", type=int, default=3)
    ap.add_argument("--ridge", type=float, default=1e-3)
    ap.add_argument("--top-logit", type=float, default=TOP_LOGIT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    summary = fit_head(
        args.model_path,
        args.out,
        args.device,
        tokens=args.tokens,
        seq_len=args.seq_len,
        prefix_len=args.prefix_len,
        successors=args.successors,
        ridge=args.ridge,
        top_logit=args.top_logit,
        seed=args.seed,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
