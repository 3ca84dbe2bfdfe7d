"""The vision encoder's speed (issue 45 point 9): GLM-5.3-Flash's tower and merger at their real
size (transformers' Glm5NextVisionConfig defaults: 24 blocks of width 1024, 16 heads; the
merger out to the real text width), random weights, bf16, beside transformers' own
Glm5NextVisionModel holding the same weights, in one process.

    python -m bench.vision_encoder --out vision.json [--repeats 20]     # an H200: < 60 s
    python -m bench.vision_encoder --out v.json --device cpu --tiny      # a dry run in seconds

For each image (448x448 and 1280x720, drawn with Pillow, made into pixel values and a grid by
serving/front/images.preprocess as the worker does; the host's preprocessing time is reported
apart) and each implementation (ours: serving/models/vision.VisionTower; ours_graphed: the
same tower replaying its CUDA graph for the image's grid, serving/executor/vision_graphs.py,
CUDA only; transformers with each attention implementation that loads: sdpa, eager), the
encoder alone: pixel values already on the device, one warm-up call, then --repeats calls each
between two device synchronisations, timed on the host clock (what a prefill step waits for;
launches included). A record: {"image", "impl", "ms" (median), "runs", "patches",
"image_tokens"}; ours_graphed's adds "capture_ms" (its first call: a capture, timed alike) and
the device memory the graphs hold so far (reserved after the capture less before the
graphs' buffers were made, the allocator's cache emptied) beside vision.graph_bytes' estimate
for the largest image here (the memory plan's, for the front's largest). Then per image the
speed-up of ours and of ours_graphed over each transformers variant, the largest difference
of the outputs relative to their largest magnitude (the same weights must give the same
embeddings to bf16's rounding: a wrong tower's speed means nothing), and whether the graphed
output is torch.equal to the eager one.
Targets: 448x448 <= 3 ms, 1280x720 <= 20 ms, >= 1.5x transformers in both.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from serving.config import VisionConfig
from serving.executor.vision_graphs import VisionGraphs
from serving.front.images import ImageProcessorConfig, decode_image, preprocess
from serving.models.vision import VisionTower, graph_bytes
from serving.tools.tiny_model import PRESETS, VISION_PRESETS

IMAGES = {"448x448": (448, 448), "1280x720": (1280, 720)}
TINY_IMAGES = {"112x112": (112, 112), "224x140": (224, 140)}


def drawn_png(width: int, height: int) -> bytes:
    """Noise under a few shapes: every patch differs, so no shortcut hides in the pixels."""
    rng = np.random.default_rng(width * 7919 + height)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    draw = ImageDraw.Draw(image)
    draw.rectangle((width // 8, height // 8, width // 2, height // 2), fill=(200, 30, 30))
    draw.ellipse((width // 2, height // 2, width - 8, height - 8), fill=(30, 30, 200))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def towers(tiny: bool, device: torch.device, dtype: torch.dtype):
    """Ours and transformers' per attention implementation, holding the same random weights."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    preset = "tiny" if tiny else "real"
    fields = {**VISION_PRESETS.get(preset, {}), "out_hidden_size": PRESETS[preset]["hidden_size"]}
    hf_config = Glm5NextVisionConfig(**fields)
    torch.manual_seed(0)
    theirs: dict[str, torch.nn.Module] = {}
    for impl in ("sdpa", "eager"):
        config = copy.deepcopy(hf_config)  # the attention reads its config's choice per call
        config._attn_implementation = impl
        with torch.device(device):
            model = Glm5NextVisionModel(config).to(dtype).eval()
        if theirs:  # one set of weights for all
            model.load_state_dict(next(iter(theirs.values())).state_dict(), strict=True)
        else:
            with torch.no_grad():  # norms away from 1, so each weight counts
                for name, p in model.named_parameters():
                    if "norm" in name and p.dim() == 1 and not name.endswith("bias"):
                        p.copy_(1 + 0.2 * torch.randn_like(p))
        theirs[f"transformers_{impl}"] = model
    with torch.device("meta"):
        ours = VisionTower(VisionConfig.from_dict(hf_config.to_dict()), dtype)
    ours.to_empty(device=device)
    ours.load_state_dict(next(iter(theirs.values())).state_dict(), strict=True)
    return ours.eval(), theirs


def timed_ms(fn, repeats: int, device: torch.device, warm_up: bool = True) -> list[float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if warm_up:
        fn()
    sync()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        runs.append(round(1000 * (time.perf_counter() - t0), 4))
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset's tower (a dry run)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ours, theirs = towers(a.tiny, device, dtype)
    processor = ImageProcessorConfig(min_image_tokens=4) if a.tiny else ImageProcessorConfig()
    records: list[dict] = []
    images = {}  # label -> (preprocessed, host ms)
    for label, (width, height) in (TINY_IMAGES if a.tiny else IMAGES).items():
        data = drawn_png(width, height)
        t0 = time.perf_counter()
        done = preprocess(decode_image(data), processor)
        images[label] = done, round(1000 * (time.perf_counter() - t0), 3)
    graphs, base = None, 0
    largest = max(done.num_tokens for done, _ in images.values())
    if device.type == "cuda":
        # a worker captures its decode graphs first, so the capture stream's cuBLAS workspace
        # (made by the first matmul ever captured on it, in that capture's pool) lives in the
        # decode pool, not the tower's: the same here, or the tower's pool would hold it
        probe = torch.randn(64, 64, device=device, dtype=dtype)
        probe @ probe  # cuBLAS's handle, made outside any capture
        torch.cuda.synchronize(device)
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            probe @ probe
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved(device)
        # buffers for the largest image here, as a worker's for the front's largest
        graphs = VisionGraphs(ours, max_shapes=len(IMAGES), max_tokens=largest)
    for label, (done, host_ms) in images.items():
        pixels = torch.from_numpy(done.pixel_values).to(device, dtype)
        grids = [tuple(done.grid_thw)]
        grid_t = torch.tensor(grids, device=device)
        calls = {"ours": lambda x=pixels, g=grids: ours(x, g)}
        graphed = {}
        if graphs is not None:
            calls["ours_graphed"] = lambda x=pixels, g=grids[0]: graphs.encode(x, g)
            capture_ms = timed_ms(calls["ours_graphed"], 1, device, warm_up=False)[0]
            torch.cuda.empty_cache()
            graphed = {
                "capture_ms": capture_ms,
                "graphs_held_bytes": torch.cuda.memory_reserved(device) - base,
                "planned_bytes": graph_bytes(ours.config, largest, pixels.element_size()),
            }
        for name, model in theirs.items():
            calls[name] = lambda m=model, x=pixels, g=grid_t: m(x, grid_thw=g).pooler_output
        outputs = {}
        with torch.inference_mode():
            for impl, call in calls.items():
                out = call()
                outputs[impl] = (torch.cat(out) if isinstance(out, (list, tuple)) else out).float()
                runs = timed_ms(call, a.repeats, device)
                records.append(
                    {
                        "image": label,
                        "impl": impl,
                        "ms": statistics.median(runs),
                        "runs": runs,
                        "patches": int(pixels.shape[0]),
                        "image_tokens": done.num_tokens,
                        "preprocess_host_ms": host_ms,
                        **(graphed if impl == "ours_graphed" else {}),
                    }
                )
                print(json.dumps(records[-1]), flush=True)
        ref = outputs["transformers_sdpa"]
        mine = {r["impl"]: r["ms"] for r in records if r["image"] == label}
        summary = {
            "image": label,
            **{
                f"speedup_{impl}": {
                    k: round(v / mine[impl], 2) for k, v in mine.items() if k.startswith("trans")
                }
                for impl in ("ours", "ours_graphed")
                if impl in mine
            },
            "max_rel_diff": {
                k: (v - ref).abs().max().item() / ref.abs().max().item()
                for k, v in outputs.items()
                if k != "transformers_sdpa"
            },
        }
        if graphs is not None:
            summary["graphed_equals_eager"] = torch.equal(outputs["ours_graphed"], outputs["ours"])
        records.append(summary)
        print(json.dumps(summary), flush=True)
        # bf16 rounds each of 24 blocks differently in the two implementations
        limit = 0.1 if dtype == torch.bfloat16 else 1e-4
        assert all(v <= limit for k, v in summary["max_rel_diff"].items() if "ours" in k), summary
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
