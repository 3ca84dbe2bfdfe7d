"""Decode speed with and without EAGLE speculation, through the real scheduler (in process).

    python -m bench.spec --model-path DIR [--steps 0 1 3] [--batch-sizes 1 16]

For each configuration: prompts of --prompt-len random tokens (seed 4242: new prompts, not the
distillation prompts, unless --seen-prompts), --new-tokens greedy tokens each; ms per output
token = decode wall time / tokens decoded after the first. Accept length = committed tokens per
request per verify step (1 = nothing accepted); acceptance rate = accepted drafts / proposed
drafts = (accept length - 1) / steps, as in the server's /metrics. One JSON line per
configuration, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from serving.engine.build import build_engine
from serving.protocol import GenerateRequest
from serving.sampling_params import SamplingParams
from serving.server_args import ServerArgs
from training.distill_nextn import training_prompts


def measure(
    model_path: str,
    steps: int,
    prompts: list[list[int]],
    new: int,
    graphs: str = "disabled",
    ignore_eos: bool = True,
    flags: tuple[str, ...] = (),
) -> dict:
    """Greedy decode of `prompts` together (steps 0: no speculation)."""
    spec = (
        ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(steps)] if steps else []
    )
    batch = len(prompts)
    longest = max(map(len, prompts))
    args = ServerArgs.from_cli(
        [
            "--model-path",
            model_path,
            "--skip-server-warmup",
            "--cuda-graph-backend-decode",
            graphs,
            "--max-total-tokens",
            str(batch * (longest + new + 128)),
            *spec,
            *flags,
        ]
    )
    sched = build_engine(args)[0]
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=ignore_eos)
        sched.add(GenerateRequest(f"r{i}", ids, params))
    first = None
    produced = 0
    outputs: dict[str, list[int]] = {}
    while sched.has_work:
        for o in sched.step():
            produced += len(o.new_token_ids)
            outputs.setdefault(o.rid, []).extend(o.new_token_ids)
        if first is None and produced >= batch:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            first, base = time.perf_counter(), produced
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    elapsed = time.perf_counter() - first
    per_req_tokens = (produced - base) / batch
    st = sched.stats
    sched.check_invariants()
    accept = st.spec_committed_tokens / st.spec_verify_steps if st.spec_verify_steps else None
    return {
        "spec_steps": steps,
        "batch": batch,
        "graphs": graphs,
        "ms_per_token": round(1000 * elapsed / per_req_tokens, 3),
        "accept_length": None if accept is None else round(accept, 3),
        "acceptance_rate": None if accept is None else round((accept - 1) / steps, 3),
        "outputs": [outputs.get(f"r{i}", []) for i in range(batch)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--steps", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--graphs", default="disabled", choices=["disabled", "full"])
    ap.add_argument(
        "--seen-prompts",
        action="store_true",
        help="use the prompts the draft was distilled on (seed 0)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for bs in args.batch_sizes:
        for steps in args.steps:
            if args.seen_prompts:
                prompts = training_prompts(1000, bs, args.prompt_len, seed=0)
            else:
                g = torch.Generator().manual_seed(4242)
                prompts = torch.randint(0, 1000, (bs, args.prompt_len), generator=g).tolist()
            row = measure(args.model_path, steps, prompts, args.new_tokens, args.graphs)
            row.pop("outputs")
            rows.append(row)
            print(json.dumps(row), flush=True)
    prompts = "seen (distillation) prompts" if args.seen_prompts else "new prompts"
    print(
        f"summary, {prompts}, {args.prompt_len} + {args.new_tokens} tokens: "
        + "; ".join(
            f"bs {r['batch']} steps {r['spec_steps']}: {r['ms_per_token']} ms/token"
            + (
                f", accept length {r['accept_length']}, acceptance rate {r['acceptance_rate']}"
                if r["accept_length"] is not None
                else ""
            )
            for r in rows
        ),
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
