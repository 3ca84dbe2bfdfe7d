"""Train the shipped small model's vision tower and merger on drawn images (vision_data.py),
the text model frozen (LLaVA stage 1: the loss only on the answer tokens), so the text weights, the
NextN draft and EAGLE's acceptance stay as they are. Writes the tower into the checkpoint as
transformers saves it (model.visual.*), with config.json's vision_config, preprocessor_config.json
and the tokenizer's <|image|> token, then checks that transformers loads it with no missing or
unexpected weights.

    python -m training.train_vision --device cuda --out CKPT --tower-out tower.safetensors
    python -m training.train_vision --eval-only --out serving/assets/small_model
    python -m training.train_vision --tower-in tower.safetensors --out serving/assets/small_model

The shipped tower was trained on an H200 (docs/SMALL_MODEL.md has the run): CKPT a copy of
serving/assets/small_model, the tower alone brought back (--tower-out) and spliced into the
shipped checkpoint here (--tower-in: writes the same config, tokenizer and preprocessor files
as training does, then the tensors, then evaluates).

<|image|> reuses the id of [sMASK] (8172), a special token no chat or corpus text contains: the
vocabulary, and so the embedding and lm_head shapes, stay as they are. Its embedding row is never
read at image positions (the tower's output replaces it).
Hazard: CPU training runs on ONE thread (the machine is shared); on CUDA the batches are drawn
by --workers processes while the GPU steps.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

from training import vision_data

IMAGE_TOKEN = "<|image|>"
REUSED_TOKEN = "[sMASK]"
VISION_CONFIG = dict(
    model_type="glm5_next_vision",
    depth=3,
    hidden_size=128,
    num_heads=2,
    intermediate_size=384,
    projection_intermediate_size=512,
)
# 112 x 112 images are 4 x 4 merged tokens; the limits keep any image small on this model.
IMAGE_TOKEN_BUDGET = (4, 256)


def preprocessor_config() -> dict:
    from serving.tools.tiny_model import preprocessor_config as tiny

    low, high = IMAGE_TOKEN_BUDGET
    return {**tiny("tiny"), "min_image_tokens": low, "max_image_tokens": high}


def set_image_token(out: Path) -> int:
    """Renames [sMASK] to <|image|> in tokenizer.json / tokenizer_config.json / special tokens."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = out / name
        text = path.read_text()
        if REUSED_TOKEN in text:
            path.write_text(text.replace(REUSED_TOKEN, IMAGE_TOKEN))
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.convert_tokens_to_ids([IMAGE_TOKEN, "<|begin_of_image|>", "<|end_of_image|>"])
    return ids


def write_config(out: Path, text_hidden: int) -> None:
    ids = set_image_token(out)
    raw = json.loads((out / "config.json").read_text())
    raw["vision_config"] = {**VISION_CONFIG, "out_hidden_size": text_hidden}
    raw["image_token_id"], raw["image_start_token_id"], raw["image_end_token_id"] = ids
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(), indent=2) + "\n"
    )


class Batcher:
    def __init__(self, out: Path):
        self.tok = AutoTokenizer.from_pretrained(out)
        self.proc = Glm5NextImageProcessorPil.from_pretrained(out)
        self.image_id = self.tok.convert_tokens_to_ids(IMAGE_TOKEN)

    def prompt_ids(self, s: vision_data.Sample, grid) -> list[int]:
        text = self.tok.apply_chat_template(
            vision_data.chat(s)[:1], tokenize=False, add_generation_prompt=True,
            enable_thinking=False,
        )  # fmt: skip
        n = int(grid.prod()) // 4
        text = text.replace(IMAGE_TOKEN, IMAGE_TOKEN * n)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def images(self, samples):
        p = self.proc(images=[s.image for s in samples], return_tensors="pt")
        return p["pixel_values"], p["image_grid_thw"]

    def batch(self, samples):
        pixels, grids = self.images(samples)
        rows, labels = [], []
        eos = self.tok.convert_tokens_to_ids("<|user|>")
        for s, g in zip(samples, grids):
            prompt = self.prompt_ids(s, g)
            answer = self.tok(s.answer, add_special_tokens=False)["input_ids"] + [eos]
            rows.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(map(len, rows))
        pad = self.tok.pad_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return ids, lab, mask, pixels, grids


def load(out: Path) -> Glm5NextForConditionalGeneration:
    model, info = Glm5NextForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    nextn = f"model.language_model.layers.{model.config.text_config.num_hidden_layers}."
    unexpected = {k for k in info["unexpected_keys"] if not k.startswith(nextn)}
    # transformers leaves the NextN layer (the draft's) unread, as for the text-only checkpoint
    assert not info["missing_keys"] and not unexpected, (info["missing_keys"], unexpected)
    return model


@torch.no_grad()
def answer(model, b: Batcher, s: vision_data.Sample, max_new: int = 16) -> str:
    pixels, grids = b.images([s])
    ids = torch.tensor([b.prompt_ids(s, grids[0])], device=model.device)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels.to(ids.device),
        image_grid_thw=grids.to(ids.device), max_new_tokens=max_new, do_sample=False,
    )  # fmt: skip
    return b.tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def shape_questions(seed: int) -> vision_data.Sample:
    """A held-out shape image asked "What shape is this?" (its answer names colour and shape)."""
    s = vision_data.sample(seed)
    while s.kind != "shape":
        seed += 1
        s = vision_data.sample(seed)
    return vision_data.Sample(s.image, "What shape is this?", "", s.kind, s.colour, s.subject), seed


def evaluate(model, b: Batcher, n: int = 100) -> float:
    """Share of held-out shape images whose answer names both the colour and the shape."""
    model.eval()
    right, seed = 0, vision_data.HELDOUT_SEED
    for _ in range(n):
        s, seed = shape_questions(seed)
        seed += 1
        text = answer(model, b, s).lower()
        right += s.colour in text and s.subject in text
    return right / n


class Batches(torch.utils.data.IterableDataset):
    """Training batches drawn from consecutive seeds; worker w of n takes every n-th batch."""

    def __init__(self, out: Path, batch: int, first_seed: int) -> None:
        self.out, self.batch, self.first_seed = out, batch, first_seed

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        b = Batcher(self.out)
        k = w
        while True:
            seed = self.first_seed + k * self.batch
            yield b.batch([vision_data.sample(seed + i) for i in range(self.batch)])
            k += n


def train(
    out: Path,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    device: str,
    workers: int,
    minutes: float,
    init: Path | None = None,
) -> dict[str, torch.Tensor]:
    """Trains a fresh tower; returns its tensors named as transformers saves them."""  # fmt: skip
    torch.manual_seed(seed)
    text_hidden = json.loads((out / "config.json").read_text())["text_config"]["hidden_size"]
    write_config(out, text_hidden)
    model = Glm5NextForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, ignore_mismatched_sizes=True
    ).to(device)
    visual = model.model.visual
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("model.visual.")
    if init is None:
        visual.apply(model._init_weights)  # the shapes changed: a fresh tower
    else:  # go on from a tower trained before (its tensors as --tower-out wrote them)
        prefix = "model.visual."
        visual.load_state_dict({k[len(prefix) :]: v for k, v in load_file(init).items()})
    opt = torch.optim.AdamW(visual.parameters(), lr=lr, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(
        Batches(out, batch, seed * 10_000_000), batch_size=None, num_workers=workers,
        prefetch_factor=4 if workers else None,
    )  # fmt: skip
    model.train()
    t0 = time.time()
    for step, (ids, lab, mask, pixels, grids) in enumerate(loader):
        loss = model(
            input_ids=ids.to(device), attention_mask=mask.to(device), labels=lab.to(device),
            pixel_values=pixels.to(device), image_grid_thw=grids.to(device),
        ).loss  # fmt: skip
        # warm-up, then a cosine over the larger of the steps and the minutes spent
        done = max(step / steps, (time.time() - t0) / (minutes * 60))
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * done))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(visual.parameters(), 1.0)
        opt.step()
        last = step == steps - 1 or done >= 1.0
        if step % 50 == 0 or last:
            print(f"step {step} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
        if last:
            break
    return {f"model.visual.{k}": v.detach().cpu() for k, v in visual.state_dict().items()}


def save_tower(out: Path, tower: dict[str, torch.Tensor]) -> None:
    """Replaces model.visual.* in the shard that holds them (in that shard's dtype); other
    tensors stay byte-equal."""
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = next(f for k, f in index["weight_map"].items() if k.startswith("model.visual."))
    tensors = {k: v for k, v in load_file(out / shard).items() if not k.startswith("model.visual.")}
    dtype = next(iter(tensors.values())).dtype
    tower = {k: v.to(dtype).contiguous() for k, v in tower.items()}
    tensors.update(tower)
    save_file(tensors, str(out / shard), metadata={"format": "pt"})
    index["weight_map"] = {
        k: f for k, f in index["weight_map"].items() if not k.startswith("model.visual.")
    }
    index["weight_map"].update({k: shard for k in tower})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("serving/assets/small_model"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--minutes", type=float, default=6.0, help="stop training after this long")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=6, help="batch-drawing processes (CUDA)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tower-out", type=Path, help="also write the trained tower alone here")
    ap.add_argument("--tower-init", type=Path, help="train on from this tower, not a fresh one")
    ap.add_argument("--tower-in", type=Path, help="splice this trained tower in; no training")
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--eval-n", type=int, default=100)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.tower_in:
        text_hidden = json.loads((args.out / "config.json").read_text())["text_config"]
        write_config(args.out, text_hidden["hidden_size"])
        save_tower(args.out, load_file(args.tower_in))
    elif not args.eval_only:
        workers = args.workers if args.device != "cpu" else 0
        tower = train(
            args.out, args.steps, args.batch, args.lr, args.seed, args.device, workers,
            args.minutes, args.tower_init,
        )  # fmt: skip
        save_tower(args.out, tower)
        if args.tower_out:
            save_file({k: v.contiguous() for k, v in tower.items()}, str(args.tower_out))
    model = load(args.out).to(args.device)
    print(f"colour and shape named: {evaluate(model, Batcher(args.out), args.eval_n):.1%}")


if __name__ == "__main__":
    main()
