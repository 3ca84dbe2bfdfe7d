"""Train a small GLM-5.3-Flash-shaped model (KDA + DSA with the kpool indexer, mHC, MoE, and the
NextN/MTP layer) on the corpus of training/corpus.py, and export it as a glm5_next
checkpoint that transformers and our loader both read.

    python -m training.corpus --out data/corpus                      # the text, once
    python -m training.train_small --corpus data/corpus --run data/small-run \\
        --device cuda --minutes 8                                         # a run of <= 10 min
    python -m training.train_small --run data/small-run --resume --minutes 8
    python -m training.train_small --run data/small-run --resume --extend 1000 --minutes 8
    python -m training.train_small --run data/small-run --export serving/assets/small_model

The run folder holds the tokenizer (byte-level BPE trained on the corpus, GLM's special tokens,
the chat template), the tokenized corpus as compressed shards in tokens/ (serving/tools/
token_shards.py; --prepare-only writes them and stops, --tokens trains on another shard folder,
such as one part staged for the GPU), state.pt (weights, optimizer, step, plan) and log.jsonl.
A run trains until its --minutes are up or the plan's steps are done, saving state.pt every
--save-every-minutes and at the end; --resume continues the same plan (the same data
order, step for step). --steps auto
(the default) plans as many steps as fit this run's --minutes, measured on its first steps.

The target trains with transformers' glm5_next (fla-core's KDA kernels on CUDA when installed,
whose backward passes exist; grouped_mm experts when torch has them) in bf16 autocast over
float32 weights. The NextN layer and the indexers train beside it (serving/tools/
train_heads.py); routing stays balanced by DeepSeek's bias update (no auxiliary loss).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from serving.tools.tiny_model import PRESETS, build_config
from serving.tools.tokenizer_build import SPECIAL_TOKENS, write_tokenizer_files
from training.corpus import read_docs

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
VISION = dict(  # transformers' Glm5NextConfig wants one; ours is the smallest it takes
    depth=1,
    hidden_size=32,
    num_heads=2,
    intermediate_size=32,
    out_hidden_size=64,
    projection_intermediate_size=32,
)
BIAS_UPDATE = 1e-3  # DeepSeek-V3's aux-loss-free balancing speed
INDEXER_ROWS = 4  # sequences of each batch the indexer loss looks at
EVAL_EVERY = 200


class TrainError(Exception):
    """A refusal: main prints it as one line and exits with status 2."""


@dataclass(frozen=True)
class Plan:
    preset: str
    seq_len: int
    batch: int
    steps: int
    lr: float
    warmup: int
    weight_decay: float
    seed: int
    nextn_weight: float
    feature_weight: float
    # --extend: a second cosine segment from this step to `steps` (0: none). It rises over
    # `warmup` steps from the floor (0.1 lr) to extend_peak * lr, then decays to the floor again.
    extend_from: int = 0
    extend_peak: float = 0.5


# ---- data ----


def _corpus_texts(corpus: Path, split: str) -> list[str]:
    path = corpus / f"{split}.jsonl.gz"
    if not path.is_file():
        raise TrainError(f"no corpus at {path} (build it: python -m training.corpus)")
    texts = [d["text"] for d in read_docs(path) if d["text"].strip()]
    if not texts:
        raise TrainError(f"the corpus {path} is empty")
    return texts


def _training_texts(corpus: Path) -> list[str]:
    from training.chat_data import chat_texts

    docs = _corpus_texts(corpus, "train")
    cookies = [c for d in read_docs(corpus / "train.jsonl.gz") if d["source"] == "fortunes"
               for c in d["text"].split("\n\n")]  # fmt: skip
    facts = corpus / "facts.jsonl.gz"
    chats = chat_texts(facts, cookies[:2000]) if facts.is_file() else []
    return docs + chats


TOKENIZER_CHARS = 60_000_000  # the tokenizer trains on an even sample of this many characters


def _encoded(tokenizer, texts: list[str], eos: int, batch: int = 2000):
    """Each text's token ids with EOS appended, as uint16 arrays, in the texts' order."""
    import numpy as np

    for i in range(0, len(texts), batch):
        for enc in tokenizer.encode_batch(texts[i : i + batch], add_special_tokens=False):
            yield np.array([*enc.ids, eos], dtype=np.uint16)


def prepare(run: Path, corpus: Path, preset: str) -> None:
    """Tokenizer files and config.json (kept when there), then the tokenized corpus as shards in
    `run`/tokens (training/token_shards.py), documents and chats shuffled together."""
    import random

    import numpy as np
    from tokenizers import Tokenizer

    from training.token_shards import write_tokens

    run.mkdir(parents=True, exist_ok=True)
    if (run / "tokens" / "index.json").is_file():
        return
    texts = _training_texts(corpus)
    heldout = _corpus_texts(corpus, "heldout")
    random.Random(0).shuffle(texts)
    chars = sum(map(len, texts))
    if not (run / "tokenizer.json").is_file():
        vocab = PRESETS[preset]["vocab_size"]
        sample = texts[:: max(1, math.ceil(chars / TOKENIZER_CHARS))]
        log.info("training the tokenizer (%d BPE + %d special) on %.1f M of %.1f M characters",
                 vocab - len(SPECIAL_TOKENS), len(SPECIAL_TOKENS),
                 sum(map(len, sample)) / 1e6, chars / 1e6)  # fmt: skip
        context = PRESETS[preset]["max_position_embeddings"]
        specials = write_tokenizer_files(run, vocab, context, sample)
        raw = build_config(preset, specials)
        (run / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    held = np.concatenate(list(_encoded(tok, heldout, eos)))
    index = write_tokens(run / "tokens", _encoded(tok, texts, eos), held)
    train_tokens = sum(s["tokens"] for s in index["shards"] if s["name"] != "heldout.u16.xz")
    log.info("corpus: %.2f M training tokens in %d shards (%.1f MiB), %.2f M held out (%.2f "
             "characters per token)", train_tokens / 1e6, len(index["shards"]) - 1,
             sum(s["bytes"] for s in index["shards"]) / 2**20, len(held) / 1e6,
             chars / train_tokens)  # fmt: skip


def windows(tokens: torch.Tensor, plan: Plan, step: int, batch: int | None = None):
    """The batch of `step`: random windows of seq_len + 1 tokens, the same for the same step."""
    g = torch.Generator().manual_seed(plan.seed * 1_000_003 + step)
    n = batch or plan.batch
    starts = torch.randint(0, len(tokens) - plan.seq_len - 1, (n,), generator=g)
    rows = torch.stack([tokens[s : s + plan.seq_len + 1] for s in starts.tolist()])
    return rows.long()


# ---- model ----


def hf_model(run: Path, device: str):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    raw = json.loads((run / "config.json").read_text())
    cfg = Glm5NextConfig(text_config=raw["text_config"], vision_config=VISION)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(cfg).to(device)
    return model


class Trainer:
    def __init__(self, run: Path, plan: Plan, device: str, tokens: Path | None = None) -> None:
        from training.token_shards import read_tokens
        from training.train_heads import TrainableNextN

        self.run, self.plan, self.device = run, plan, device
        self.model = hf_model(run, device)
        text = self.model.config.text_config
        self.text = text
        self.mtp = TrainableNextN(text).to(device)
        for module in self.mtp.modules():  # transformers' own initialisation, module by module
            self.model.model.language_model._init_weights(module)
        self.lm = self.model.model.language_model
        self.tokens = read_tokens(tokens or run / "tokens")
        log.info("tokens: %.2f M for training (%d shards), %.2f M held out",
                 len(self.tokens["train"]) / 1e6, len(self.tokens["shards"]),
                 len(self.tokens["heldout"]) / 1e6)  # fmt: skip
        self._captured: dict[str, torch.Tensor] = {}
        self._loads: dict[torch.nn.Module, torch.Tensor] = {}
        self._hooks()
        self.autocast = device.startswith("cuda")
        params = [p for p in [*self.model.parameters(), *self.mtp.parameters()] if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": plan.weight_decay},
             {"params": rest, "weight_decay": 0.0}],
            lr=plan.lr, betas=(0.9, 0.95), fused=device.startswith("cuda"),
        )  # fmt: skip
        self.step = 0

    # hooks: the pre-norm hidden (the draft's input), each indexer layer's input, expert loads
    def _hooks(self) -> None:
        m = __import__("transformers.models.glm5_next.modeling_glm5_next", fromlist=["x"])

        def keep_hidden(_mod, args):
            self._captured["hidden"] = args[0]

        self.lm.norm.register_forward_pre_hook(keep_hidden)
        self.indexed = [
            mod for mod in [*self.lm.modules(), *self.mtp.modules()]
            if isinstance(mod, m.Glm5NextTextAttention) and mod.indexer is not None
        ]  # fmt: skip
        for i, mod in enumerate(self.indexed):

            def keep_input(_mod, args, kwargs, i=i):
                self._captured[f"attn{i}"] = kwargs.get("hidden_states", args[0] if args else None)

            mod.register_forward_pre_hook(keep_input, with_kwargs=True)
        for mod in [*self.lm.modules(), *self.mtp.modules()]:
            if isinstance(mod, m.Glm5NextTextTopkRouter):

                def count(router, _args, out):
                    ids = out[2].reshape(-1)
                    load = torch.bincount(ids, minlength=router.num_experts).float()
                    self._loads[router] = self._loads.get(router, 0) + load

                mod.register_forward_hook(count)

    def lr_at(self, step: int) -> float:
        p = self.plan
        if p.extend_from and step >= p.extend_from:
            k = step - p.extend_from
            if k < p.warmup:
                return p.lr * (0.1 + (p.extend_peak - 0.1) * (k + 1) / p.warmup)
            frac = min(1.0, (k - p.warmup) / max(1, p.steps - p.extend_from - p.warmup))
            return p.lr * (0.1 + (p.extend_peak - 0.1) * 0.5 * (1 + math.cos(math.pi * frac)))
        if step < p.warmup:
            return p.lr * (step + 1) / p.warmup
        end = p.extend_from or p.steps
        frac = min(1.0, (step - p.warmup) / max(1, end - p.warmup))
        return p.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def losses(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        from training.train_heads import indexer_loss, nextn_loss

        x, y = rows[:, :-1].to(self.device), rows[:, 1:].to(self.device)
        with torch.autocast("cuda", torch.bfloat16, enabled=self.autocast):
            logits = self.model(input_ids=x).logits
            lm = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            hidden = self._captured["hidden"]
            embeds = self.lm.embed_tokens(x[:, 1:]).detach()
            draft = self.mtp(embeds, hidden[:, :-1].detach())
            kl, feature, agree = nextn_loss(
                self.mtp, draft, self.model.lm_head.weight, logits, hidden
            )
            kpool = self.text.index_kpool
            index = sum(
                indexer_loss(mod, _whole_pools(self._captured[f"attn{i}"], kpool), kpool)
                for i, mod in enumerate(self.indexed)
                if self._captured[f"attn{i}"].shape[1] >= kpool
            ) / len(self.indexed)
        total = lm + self.plan.nextn_weight * (kl + self.plan.feature_weight * feature) + index
        return {"loss": total, "lm": lm, "nextn_kl": kl, "feature": feature,
                "nextn_top1": agree, "indexer_kl": index}  # fmt: skip

    def train_step(self) -> dict[str, float]:
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.step)
        self._loads.clear()
        out = self.losses(windows(self.tokens["train"], self.plan, self.step))
        self.opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        params = [*self.model.parameters(), *self.mtp.parameters()]
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        self.opt.step()
        with torch.no_grad():  # push under-used experts up, over-used down
            for router, load in self._loads.items():
                router.e_score_correction_bias += BIAS_UPDATE * torch.sign(load.mean() - load)
        self.step += 1
        return {k: float(v.detach()) for k, v in out.items()} | {"grad_norm": float(norm)}

    @torch.no_grad()
    def heldout_loss(self, windows_n: int = 16) -> float:
        plan = dataclasses.replace(self.plan, seed=self.plan.seed + 7)
        rows = windows(self.tokens["heldout"], plan, 0, windows_n)
        self.model.eval()
        with torch.autocast("cuda", torch.bfloat16, enabled=self.autocast):
            logits = self.model(input_ids=rows[:, :-1].to(self.device)).logits
        self.model.train()
        return float(F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten().to(
            self.device)))  # fmt: skip

    # ---- state ----
    def save(self) -> None:
        state = {
            "plan": dataclasses.asdict(self.plan),
            "config": json.loads((self.run / "config.json").read_text()),
            "step": self.step,
            "model": self.model.state_dict(),
            "mtp": self.mtp.state_dict(),
            "opt": self.opt.state_dict(),
        }
        tmp = self.run / "state.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.run / "state.pt")

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.mtp.load_state_dict(state["mtp"])
        self.opt.load_state_dict(state["opt"])
        self.step = state["step"]


def _whole_pools(x: torch.Tensor, kpool: int) -> torch.Tensor:
    """The first INDEXER_ROWS sequences, cut to whole pools."""
    return x[:INDEXER_ROWS, : x.shape[1] // kpool * kpool]


def check_resumable(run: Path, state: dict, preset: str) -> None:
    """Refuse a state.pt that is not this run's model."""
    config = json.loads((run / "config.json").read_text())
    if state["plan"]["preset"] != preset:
        raise TrainError(
            f"{run}/state.pt was trained with --preset {state['plan']['preset']}, not {preset}"
        )
    if state["config"] != config:
        a, b = state["config"]["text_config"], config["text_config"]
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)) or ["(outer fields)"]
        raise TrainError(
            f"{run}/state.pt does not match {run}/config.json (differs in {', '.join(keys)}); "
            "start a new --run folder"
        )


def _format(step: int, steps: int, stats: dict, tok_s: float, eta_s: float) -> str:
    return (f"step {step}/{steps}  loss {stats['lm']:.3f}  nextn_kl {stats['nextn_kl']:.3f}  "
            f"draft_top1 {stats['nextn_top1']:.2f}  indexer_kl {stats['indexer_kl']:.3f}  "
            f"{tok_s / 1e3:.0f}k tok/s  ETA {eta_s / 60:.1f} min")  # fmt: skip


def train(args: argparse.Namespace) -> None:
    run = Path(args.run)
    state_path = run / "state.pt"
    if state_path.is_file() and not args.resume:
        raise TrainError(f"{state_path} exists: pass --resume to continue it, or a new --run")
    if args.resume and not state_path.is_file():
        raise TrainError(f"--resume: no {state_path} to continue")
    state = torch.load(state_path, weights_only=False) if args.resume else None
    tokens = Path(args.tokens) if args.tokens else run / "tokens"
    if args.tokens and not (tokens / "index.json").is_file():
        raise TrainError(f"--tokens: no token shards in {tokens} (no index.json)")
    if state is None:
        if not (tokens / "index.json").is_file():
            prepare(run, Path(args.corpus), args.preset)
        plan = Plan(args.preset, args.seq_len, args.batch, 0 if args.steps == "auto" else
                    int(args.steps), args.lr, args.warmup, 0.1, args.seed, 0.3, 1.0)  # fmt: skip
    else:
        check_resumable(run, state, args.preset)
        plan = Plan(**state["plan"])
        if args.extend:
            if state["step"] < plan.steps:
                raise TrainError(
                    f"--extend: {run}/state.pt is at step {state['step']} of "
                    f"{plan.steps}; finish its plan first (--resume)"
                )
            plan = dataclasses.replace(
                plan, steps=plan.steps + args.extend, extend_from=state["step"]
            )
            log.info(
                "extending the plan by %d steps to %d (a second cosine segment)",
                args.extend,
                plan.steps,
            )
    began = time.monotonic()  # --minutes counts from here: loading the tokens and the first
    # steps' compiling and autotuning (minutes on a fresh GPU machine) are inside the budget
    trainer = Trainer(run, plan, args.device, tokens)
    if state is not None:
        trainer.load(state)
        log.info("resumed at step %d of %d", trainer.step, plan.steps)
    _select_experts_impl(trainer)
    budget = args.minutes * 60
    tokens_per_step = plan.batch * plan.seq_len
    timed_from, timed_steps = None, 0
    logf = (run / "log.jsonl").open("a")
    saved_at, first_step = time.monotonic(), trainer.step
    while trainer.plan.steps == 0 or trainer.step < trainer.plan.steps:
        stats = trainer.train_step()
        now = time.monotonic()
        if trainer.step == 3 or (state is not None and timed_from is None):
            timed_from, timed_steps = now, trainer.step  # the first steps compile and tune
        if trainer.plan.steps == 0 and trainer.step == 13:  # --steps auto: fit this run
            per_step = (now - timed_from) / (trainer.step - timed_steps)
            steps = int((budget - (now - began)) / per_step) + trainer.step
            trainer.plan = dataclasses.replace(trainer.plan, steps=max(steps, trainer.step + 1))
            log.info("planned %d steps (%.0f ms per step)", trainer.plan.steps, per_step * 1e3)
        if trainer.step % args.log_every == 0 or trainer.step == trainer.plan.steps:
            rate = 0.0
            if timed_from is not None and trainer.step > timed_steps:
                rate = (trainer.step - timed_steps) * tokens_per_step / (now - timed_from)
            left = trainer.plan.steps - trainer.step if trainer.plan.steps else 0
            eta = left * tokens_per_step / rate if rate else float("nan")
            record = {"step": trainer.step, "lr": trainer.lr_at(trainer.step), **stats,
                      "tokens_per_s": rate, "elapsed_s": now - began}  # fmt: skip
            if trainer.step % EVAL_EVERY == 0 or trainer.step == trainer.plan.steps:
                record["heldout_lm"] = trainer.heldout_loss()
            logf.write(json.dumps(record) + "\n")
            logf.flush()
            print(_format(trainer.step, trainer.plan.steps, stats, rate, eta), flush=True)
        if now - began > budget or trainer.step - first_step == args.run_steps:
            log.info("this run's time or steps are used up at step %d: saving", trainer.step)
            break
        if now - saved_at > args.save_every_minutes * 60:  # a killed run loses little
            trainer.save()
            saved_at = time.monotonic()
    trainer.save()
    log.info("saved %s at step %d of %d", state_path, trainer.step, trainer.plan.steps)


def _select_experts_impl(trainer: Trainer) -> None:
    """grouped_mm experts on CUDA when one training step runs with them, else the loop."""
    if not trainer.device.startswith("cuda"):
        return
    cfg = trainer.model.config.text_config
    for impl in ("grouped_mm", "eager"):
        for module in [*trainer.model.modules(), *trainer.mtp.modules()]:
            if hasattr(module, "config") and hasattr(module, "gate_up_proj"):
                module.config._experts_implementation = impl
        cfg._experts_implementation = impl
        try:
            probe = windows(trainer.tokens["train"], trainer.plan, 0, 2)
            trainer.losses(probe)["loss"].backward()
            trainer.opt.zero_grad(set_to_none=True)
            log.info("experts: %s", impl)
            return
        except Exception as e:  # noqa: BLE001 - any failure falls back to the loop
            log.warning("experts %s failed (%s: %s)", impl, type(e).__name__, e)
            trainer.opt.zero_grad(set_to_none=True)


# ---- export ----

SHARD_BYTES = 15 << 20  # shards stay under 16 MiB (the most one file may weigh in transfers)


def export(
    run: Path, out: Path, dtype: torch.dtype = torch.bfloat16, tokens: Path | None = None
) -> None:
    """state.pt -> a glm5_next checkpoint in `out`: transformers' save_pretrained of the target,
    the NextN layer at layers.{num_hidden_layers}, sharded safetensors, tokenizer, template."""
    from safetensors.torch import load_file, save_file

    from serving.config import ModelConfig
    from serving.models.loader import export_module
    from serving.models.nextn import NextNDraft

    state_path = run / "state.pt"
    if not state_path.is_file():
        raise TrainError(f"nothing to export: no {state_path}")
    state = torch.load(state_path, weights_only=False)
    check_resumable(run, state, state["plan"]["preset"])
    trainer = Trainer(run, Plan(**state["plan"]), "cpu", tokens)
    trainer.load(state)
    staging = run / "export-staging"
    shutil.rmtree(staging, ignore_errors=True)
    trainer.model.to(dtype).save_pretrained(staging)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(staging.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    raw = json.loads((run / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    from training.train_heads import draft_state

    draft = NextNDraft(config, torch.float32)
    missing = draft.load_state_dict(draft_state(trainer.mtp), strict=False)
    if missing.missing_keys or missing.unexpected_keys:
        raise RuntimeError(f"NextN mapping: {missing}")
    layer = f"layers.{config.num_hidden_layers}."
    for name, t in export_module(layer, draft).items():
        tensors[name] = t.to(torch.float32 if "e_score_correction_bias" in name else dtype)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    weight_map, shard, size, shards = {}, {}, 0, []
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        if shard and size + t.numel() * t.element_size() > SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
        shard[name] = t
        size += t.numel() * t.element_size()
    shards.append(shard)
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    hf_config = json.loads((staging / "config.json").read_text())
    hf_config["text_config"]["num_nextn_predict_layers"] = 1
    hf_config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):  # fmt: skip
        shutil.copyfile(run / name, out / name)
    gen = {"eos_token_id": raw["text_config"]["eos_token_id"],
           "pad_token_id": raw["text_config"]["pad_token_id"]}  # fmt: skip
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    shutil.rmtree(staging)
    log.info("exported step %d to %s (%d shards, %.1f MiB)", state["step"], out, len(shards),
             total / 2**20)  # fmt: skip
    report = verify_export(out, trainer)
    log.info("export check (float32, ours against transformers): %s", json.dumps(report))
    (out.parent / f"{out.name}.export_check.json").write_text(json.dumps(report, indent=2))


def verify_export(out: Path, trainer: Trainer, length: int = 48) -> dict[str, float]:
    """Our loader's target and draft against transformers' reading of the same files and the
    trained NextN layer (bf16-rounded), in float32 on one held-out window: relative errors of
    the logits and whether the argmax agrees everywhere."""
    from transformers import Glm5NextForConditionalGeneration

    from serving.config import ModelConfig
    from serving.forward_batch import ForwardBatch
    from serving.memory.pool import MemoryPool, PoolPlan
    from serving.models.loader import load_weights
    from serving.tools.generate import StepRunner

    config = ModelConfig.from_pretrained(out)
    target, draft = load_weights(out, config, torch.float32, "cpu", load_draft=True)
    ids = windows(trainer.tokens["heldout"], dataclasses.replace(trainer.plan, seq_len=length),
                  0, 1)[0, :length].tolist()  # fmt: skip
    runner = StepRunner(target, max_requests=1, max_context=length + 16, device="cpu")
    seq = runner.add(ids)
    ours = runner.step([seq], [length], logits="all")
    hf = Glm5NextForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([ids])).logits[0].float()
    mtp = trainer.mtp.float()
    with torch.no_grad():
        for p in mtp.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        embeds = hf.model.language_model.embed_tokens(torch.tensor([ids[1:]]))
        ref_hidden = mtp(embeds, ours.hidden[None, :-1])[0]
        ref_draft = F.linear(mtp.shared_head_norm(ref_hidden), hf.lm_head.weight)
    plan = PoolPlan(rows=1, pages=length // 16 + 2, page_size=16, max_context=length + 16,
                    with_draft=True)  # fmt: skip
    pool = MemoryPool(config, plan, torch.float32, "cpu")
    row, pages = pool.alloc_row(), []
    pool.grow(row, pages, length)
    batch = ForwardBatch.build(ids[1:], [row], [0], [length - 1], pool.req_to_token, "all")
    drafted = draft(target, batch, ours.hidden[:-1], pool.draft).logits

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    return {
        "target_rel_err": rel(ours.logits, theirs),
        "target_argmax_equal": float((ours.logits.argmax(-1) == theirs.argmax(-1)).float().mean()),
        "draft_rel_err": rel(drafted, ref_draft),
        "draft_argmax_equal": float((drafted.argmax(-1) == ref_draft.argmax(-1)).float().mean()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--run", required=True, help="the run folder (tokenizer, tokens, state)")
    ap.add_argument("--corpus", default="data/corpus", help="training.corpus's output")
    ap.add_argument(
        "--tokens",
        default=None,
        help="token shards to train on (default RUN/tokens, made from --corpus)",
    )
    ap.add_argument(
        "--prepare-only",
        action="store_true",
        help="write the tokenizer, config.json and RUN/tokens, then stop",
    )
    ap.add_argument("--preset", default="small", choices=sorted(set(PRESETS) - {"real"}))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=8.0, help="this run's training time")
    ap.add_argument("--steps", default="auto", help="the plan's steps, or auto (fit --minutes)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--resume", action="store_true", help="continue the run folder's state.pt")
    ap.add_argument(
        "--extend",
        type=int,
        default=0,
        metavar="STEPS",
        help="with --resume on a finished plan: STEPS more, on a second cosine "
        "segment (peak half the first's learning rate)",
    )
    ap.add_argument("--save-every-minutes", type=float, default=2.0, help="state.pt cadence")
    ap.add_argument("--run-steps", type=int, default=None, help="stop this run after N steps")
    ap.add_argument("--export", metavar="DIR", help="write the checkpoint of state.pt to DIR")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    try:
        if args.export:
            export(Path(args.run), Path(args.export), tokens=args.tokens and Path(args.tokens))
            return
        if args.prepare_only:
            prepare(Path(args.run), Path(args.corpus), args.preset)
            return
        kpool = PRESETS[args.preset]["index_kpool"]
        if args.seq_len % kpool:
            raise TrainError(f"--seq-len must be a multiple of index_kpool ({kpool})")
        train(args)
    except TrainError as e:
        print(f"train_small: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
