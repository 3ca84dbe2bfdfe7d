"""Measure a trained checkpoint (the small model): held-out perplexity, sample answers, EAGLE
accept length, and on CUDA the fast path against the torch path and bf16 against float32.

    python -m training.eval_small --model-path serving/assets/small_model \\
        [--heldout data/corpus/heldout.jsonl.gz] [--device cuda] [--stages ...] [--out F.json]

Stages (default all that the device allows):
  ppl        perplexity of the held-out documents, windows of --window tokens, our model
  samples    greedy answers to SAMPLE_QUESTIONS through the chat template
  accept     EAGLE accept length at 1 and 3 steps on held-out prompts (the real scheduler)
  agreement  fast path vs torch path on --prompts held-out prompts x --new-tokens greedy
             tokens: the share of prompts whose tokens are all equal, the
             share of token positions equal before the first difference, teacher-forced token
             agreement (the first path's greedy tokens scored by the second in one forward: the
             share that are its argmax too) and both perplexities. On CPU the fast path is the
             torch path (its kernels are CUDA-only) and the served dtype is float32
  bf16_vs_fp32
             (CUDA) the fast path in bf16 against itself in float32, measured likewise
  agreement_fp32
             (CUDA; not in the default set) the fast path against the torch path with both in
             float32, on the same prompts: the share of the bf16 disagreement that rounding makes
  fp8        the checkpoint quantized by serving/tools/quantize_fp8.py against itself in bf16 on
             the same prompts and windows: perplexities and greedy agreement (CUDA: the W8A8
             kernels for every projection, --fp8-linears all; CPU: weights dequantized at load)
Held-out text is never trained on: documents that training/corpus.py holds out by hash.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import time
from pathlib import Path

import torch

from kernels import torch_path
from serving.config import ModelConfig
from serving.front.chat import ChatTemplate
from serving.models.loader import load_weights
from serving.tools.generate import StepRunner

SAMPLE_QUESTIONS = (
    "What does `os.path.join` do?",
    "Explain list comprehensions.",
    "How do I undo the last git commit?",
    "What is the weather in Paris?",
    "What is 23 + 19?",
    "Tell me a fortune.",
)
STOP_TEXTS = ("<|user|>", "<|endoftext|>", "<|observation|>")


def heldout_texts(path: Path) -> list[str]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f]
    return [t for t in path.read_text(encoding="utf-8").split("\n\n\n") if t.strip()]


def token_windows(tok, texts: list[str], window: int, limit: int) -> list[list[int]]:
    """Non-overlapping windows of `window` tokens from the texts, at most `limit`."""
    out = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        out += [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]
        if len(out) >= limit:
            break
    return out[:limit]


def load(
    model_path: str, dtype: torch.dtype, device: str, draft: bool = False, fp8_linears="timed"
):
    config = ModelConfig.from_pretrained(model_path)
    return load_weights(
        model_path, config, dtype, device, load_draft=draft, fp8_linears=fp8_linears
    )


@torch.inference_mode()
def perplexity(model, windows: list[list[int]], device: str, batch: int = 8) -> dict:
    nll, count = 0.0, 0
    length = max(map(len, windows))
    runner = StepRunner(model, max_requests=batch, max_context=length + 16, device=device)
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        seqs = [runner.add(w) for w in chunk]
        out = runner.step(seqs, [len(w) for w in chunk], logits="all")
        logp = torch.log_softmax(out.logits.float(), -1)
        at = 0
        for w in chunk:
            target = torch.tensor(w[1:], device=logp.device)
            nll -= float(logp[at : at + len(w) - 1].gather(1, target[:, None]).sum())
            count += len(w) - 1
            at += len(w)
        for s in seqs:
            runner.release(s)
    return {"perplexity": math.exp(nll / count), "tokens": count}


def greedy(model, prompts: list[list[int]], new: int, device: str) -> list[list[int]]:
    longest = max(map(len, prompts))
    runner = StepRunner(model, max_requests=len(prompts), max_context=longest + new + 16,
                        device=device)  # fmt: skip
    return runner.greedy(prompts, new)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = 0
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        prefix += n
    total = sum(map(len, a))
    return {"prompts_identical": same / len(a), "tokens_before_first_difference": prefix / total}


CLOSE_TOP_K = 5  # vLLM's check_logprobs_close compares within the top 5 logprobs


@torch.inference_mode()
def teacher_forced(
    model, prompts: list[list[int]], outs: list[list[int]], device: str, batch: int = 8
) -> dict:
    """Score each prompt + its greedy tokens from another path (`outs`) with `model` in one
    forward pass: the share of those tokens that are `model`'s own argmax at their position.
    Unlike whole-sequence identity, one early flip costs one position, not the rest. Also one
    side of vLLM's criterion for two implementations (tests/models/utils.py
    check_logprobs_close): the share of prompts whose tokens are all `model`'s argmax, or whose
    first token that is not lies within `model`'s top CLOSE_TOP_K there (a near-tie, after
    which the two texts differ and are not compared)."""
    equal, total, close, judged = 0, 0, 0, 0
    longest = max(len(p) + len(o) for p, o in zip(prompts, outs))
    runner = StepRunner(model, max_requests=batch, max_context=longest + 16, device=device)
    for i in range(0, len(prompts), batch):
        rows = [(p, o) for p, o in zip(prompts[i : i + batch], outs[i : i + batch]) if o]
        seqs = [runner.add(p + o[:-1]) for p, o in rows]
        out = runner.step(seqs, [len(p) + len(o) - 1 for p, o in rows], logits="all")
        top = out.logits.topk(CLOSE_TOP_K, -1).indices.tolist()
        at = 0
        for p, o in rows:
            first = at + len(p) - 1  # the row that predicts o[0]
            ranked = top[first : first + len(o)]
            hits = [r[0] == t for r, t in zip(ranked, o)]
            equal += sum(hits)
            total += len(o)
            miss = next((j for j, hit in enumerate(hits) if not hit), None)
            close += miss is None or o[miss] in ranked[miss]
            judged += 1
            at += len(p) + len(o) - 1
        for s in seqs:
            runner.release(s)
    return {
        "tokens_equal_teacher_forced": equal / total if total else float("nan"),
        f"prompts_close_top{CLOSE_TOP_K}": close / judged if judged else float("nan"),
    }


def fp8_vs_bf16(
    model_path: str, dtype: torch.dtype, device: str, windows, prompts, new: int
) -> dict:
    """The block-FP8 checkpoint (quantize_fp8) against the original, both served in dtype;
    every projection in FP8 (--fp8-linears all: the accuracy of the FP8 kernels, not of the
    timed mix a server would run)."""
    import tempfile

    from serving.tools.quantize_fp8 import quantize_checkpoint

    base, _ = load(model_path, dtype, device)
    want, want_ppl = greedy(base, prompts, new, device), perplexity(base, windows, device)
    del base
    with tempfile.TemporaryDirectory() as tmp:
        fp8, _ = load(str(quantize_checkpoint(model_path, tmp)), dtype, device, fp8_linears="all")
    got, got_ppl = greedy(fp8, prompts, new, device), perplexity(fp8, windows, device)
    ppl = {"ppl_fp8": got_ppl["perplexity"], "ppl_base": want_ppl["perplexity"]}
    ppl["ppl_ratio"] = ppl["ppl_fp8"] / ppl["ppl_base"]
    return {**agreement(got, want), **ppl, "dtype": str(dtype)}


def chat_prompt(model_path: str, tok, question: str) -> list[int]:
    template = ChatTemplate((Path(model_path) / "chat_template.jinja").read_text())
    text = template.render([{"role": "user", "content": question}])
    return tok.encode(text, add_special_tokens=False).ids


def samples(model, tok, model_path: str, device: str, new: int = 96) -> list[dict]:
    prompts = [chat_prompt(model_path, tok, q) for q in SAMPLE_QUESTIONS]
    out = []
    for q, ids in zip(SAMPLE_QUESTIONS, greedy(model, prompts, new, device)):
        text = tok.decode(ids, skip_special_tokens=False)
        for stop in STOP_TEXTS:
            text = text.split(stop)[0]
        out.append({"question": q, "answer": text})
    return out


def accept_lengths(model_path: str, prompts: list[list[int]], new: int, flags=()) -> dict:
    from bench.spec import measure

    plain = measure(model_path, 0, prompts, new, ignore_eos=True, flags=flags)
    out = {}
    for steps in (1, 3):
        row = measure(model_path, steps, prompts, new, ignore_eos=True, flags=flags)
        out[f"steps_{steps}"] = {
            "accept_length": row["accept_length"],
            "acceptance_rate": row["acceptance_rate"],
            "greedy_equal_to_plain": row["outputs"] == plain["outputs"],
        }
    return out


def main() -> None:
    from tokenizers import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", default="serving/assets/small_model")
    ap.add_argument("--heldout", default="data/corpus/heldout.jsonl.gz")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stages", default="ppl,samples,accept,agreement,bf16_vs_fp32,fp8")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--ppl-windows", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()
    stages = set(args.stages.split(","))
    tok = Tokenizer.from_file(str(Path(args.model_path) / "tokenizer.json"))
    texts = heldout_texts(Path(args.heldout))
    windows = token_windows(tok, texts, args.window, args.ppl_windows)
    prompt_windows = token_windows(tok, texts[::-1], args.prompt_len, args.prompts)
    served = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    result: dict = {"model_path": args.model_path, "device": args.device}
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()

    def record(key: str, value) -> None:
        result[key] = value
        print(json.dumps({key: value}), flush=True)

    t0 = time.perf_counter()
    if "ppl" in stages:
        model, _ = load(args.model_path, served, args.device)
        record("ppl", {**perplexity(model, windows, args.device), "dtype": str(served),
                       "window": args.window})  # fmt: skip
    if "samples" in stages:
        model, _ = load(args.model_path, served, args.device)
        record("samples", samples(model, tok, args.model_path, args.device))
    if "accept" in stages:
        flags = ("--dtype", "bfloat16" if served == torch.bfloat16 else "float32")
        record("accept", {**accept_lengths(args.model_path, prompt_windows, args.new_tokens,
                                           flags), "prompts": len(prompt_windows),
                          "new_tokens": args.new_tokens})  # fmt: skip
    runs: dict[torch.dtype, dict] = {}

    def fast_run(dtype: torch.dtype, with_ppl: bool = False) -> dict:
        """The fast path in `dtype`: its model, greedy tokens and (with_ppl) perplexity, each
        computed once for every stage that compares against them."""
        run = runs.setdefault(dtype, {})
        if "model" not in run:
            run["model"], _ = load(args.model_path, dtype, args.device)
            run["tokens"] = greedy(run["model"], prompt_windows, args.new_tokens, args.device)
        if with_ppl and "ppl" not in run:
            run["ppl"] = perplexity(run["model"], windows, args.device)["perplexity"]
        return run

    if "agreement" in stages:
        fast = fast_run(served, with_ppl=True)
        with torch_path():
            slow = greedy(fast["model"], prompt_windows, args.new_tokens, args.device)
            slow_ppl = perplexity(fast["model"], windows, args.device)
            forced = teacher_forced(fast["model"], prompt_windows, fast["tokens"], args.device)
        record("fast_vs_torch", {**agreement(fast["tokens"], slow), **forced,
                                 "dtype": str(served), "ppl_fast": fast["ppl"],
                                 "ppl_torch": slow_ppl["perplexity"]})  # fmt: skip
    if "bf16_vs_fp32" in stages and served != torch.float32:
        fast, full = fast_run(served, with_ppl=True), fast_run(torch.float32, with_ppl=True)
        forced = teacher_forced(full["model"], prompt_windows, fast["tokens"], args.device)
        record("bf16_vs_fp32_fast", {**agreement(fast["tokens"], full["tokens"]), **forced,
                                     "ppl_bf16": fast["ppl"], "ppl_fp32": full["ppl"]})  # fmt: skip
    if "agreement_fp32" in stages:  # both paths in float32: what is left is not bf16 rounding
        full = fast_run(torch.float32)
        with torch_path():
            slow = greedy(full["model"], prompt_windows, args.new_tokens, args.device)
            forced = teacher_forced(full["model"], prompt_windows, full["tokens"], args.device)
        record("fast_vs_torch_fp32", {**agreement(full["tokens"], slow), **forced})
    if "fp8" in stages:
        record("fp8_vs_bf16", fp8_vs_bf16(args.model_path, served, args.device, windows,
                                          prompt_windows, args.new_tokens))  # fmt: skip
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
