"""The vision tower through CUDA graphs (serving/executor/vision_graphs.py): the flags, the
memory plan, the CPU's eager path; on CUDA, GLM-5.3-Flash's real-size tower in bf16 with random
weights, each graphed image torch.equal to the eager tower run on that image alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from serving.config import ModelConfig, VisionConfig
from serving.engine.memory_report import vision_graph_tokens
from serving.models.rank_plan import predict_rank
from serving.models.vision import activation_bytes, graph_bytes
from serving.server_args import ServerArgs
from serving.server_args_checks import ArgsError
from tests.test_vision_engine import engine


def args_of(path, *flags: str) -> ServerArgs:
    return ServerArgs.from_cli(["--model-path", str(path), *flags])


def test_vision_graph_flags(tiny_vision_ckpt) -> None:
    """auto: on with CUDA only; full off CUDA and fewer than two shapes are refused."""
    path = tiny_vision_ckpt
    default = args_of(path)
    assert default.cuda_graph_backend_vision == "auto"
    assert default.cuda_graph_vision_max_shapes == 16
    assert args_of(path, "--cuda-graph-backend-vision", "full").use_vision_graphs()
    assert args_of(path, "--device", "cuda").use_vision_graphs()
    off = args_of(path, "--device", "cuda", "--cuda-graph-backend-vision", "disabled")
    assert not off.use_vision_graphs() and vision_graph_tokens(off) == 0
    cpu = args_of(path, "--device", "cpu")
    assert not cpu.use_vision_graphs() and vision_graph_tokens(cpu) == 0
    # the plan's largest image is the front's limit: the flag, capped by the checkpoint's
    # preprocessor_config.json max_image_tokens (64 on this tiny checkpoint)
    cuda = args_of(path, "--device", "cuda", "--max-image-tokens", "20")
    assert vision_graph_tokens(cuda) == 20 == cuda.image_token_limit()
    above = args_of(path, "--device", "cuda", "--max-image-tokens", "300")
    assert (
        vision_graph_tokens(above) == 64 == vision_graph_tokens(args_of(path, "--device", "cuda"))
    )
    two = args_of(path, "--cuda-graph-vision-max-shapes", "2")
    assert two.cuda_graph_vision_max_shapes == 2
    with pytest.raises(SystemExit):  # argparse's choices
        args_of(path, "--cuda-graph-backend-vision", "piecewise")
    full_on_cpu = args_of(path, "--device", "cpu", "--cuda-graph-backend-vision", "full")
    with pytest.raises(ArgsError, match="--cuda-graph-backend-vision full: needs a CUDA"):
        full_on_cpu.validate()
    one = args_of(path, "--device", "cpu", "--cuda-graph-vision-max-shapes", "1")
    with pytest.raises(ArgsError, match="--cuda-graph-vision-max-shapes: must be >= 2"):
        one.validate()


def test_the_plan_holds_what_the_graphs_keep(tiny_vision_ckpt) -> None:
    config = ModelConfig.from_pretrained(tiny_vision_ckpt)
    sizes = dict(
        tp_size=1, ep_size=1, dtype=torch.bfloat16, context=512, running=4, extra=0,
        speculative_steps=0, page_size=16, mem_fraction_static=0.5, total_memory=2**30,
        vision_tokens=8192 + 8000,
    )  # fmt: skip
    eager = predict_rank(config, **sizes)
    graphed = predict_rank(config, **sizes, vision_graph_tokens=8000)
    held = graph_bytes(config.vision, 8000, 2)
    assert held > activation_bytes(config.vision, 8000, 2)  # the static buffers on top
    assert graphed.vision_peak == held + activation_bytes(config.vision, 8000, 2)  # + a warm-up
    assert eager.vision_peak == activation_bytes(config.vision, 8192 + 8000, 2)
    assert any("CUDA graphs holding an image of 8000 tokens" in line for line in graphed.lines("x"))


def test_the_cpu_takes_the_eager_path(tiny_vision_ckpt) -> None:
    """auto on the CPU: no graphs anywhere, the step's images in one tower call (today's)."""
    sched = engine(tiny_vision_ckpt, "--device", "cpu", "--cuda-graph-backend-vision", "auto")
    assert sched.runner.vision_graphs is None and sched.prefill.images.graphs is None


class ReplayReruns:
    """A stand-in for a captured graph on the CPU: replay reruns the captured function (so it
    reads the static buffers, as a graph's kernels do)."""

    def __init__(self, fn) -> None:
        self.replay = fn


def test_the_bookkeeping_with_the_capture_faked(tiny_vision_ckpt, monkeypatch) -> None:
    """On the CPU with the capture faked: the LRU, the buffers' growth, fresh copies, and
    ImagePrefill's image-by-image path giving the eager path's greedy tokens."""
    import serving.executor.vision_graphs as vision_graphs
    from tests.test_vision_engine import drain, image_request
    from tests.vision_images import IMAGE_A, IMAGE_B

    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(handles)))
    monkeypatch.setattr(
        vision_graphs, "capture", lambda fn, pool, warmups, error_mode: (ReplayReruns(fn), None)
    )
    tokens = {}
    for graphed in (False, True):
        sched = engine(tiny_vision_ckpt, "--device", "cpu")
        images, config = sched.prefill.images, sched.pool.config
        if graphed:
            images.graphs = vision_graphs.VisionGraphs(images.tower, max_shapes=2, max_tokens=25)
        sched.add(image_request("two", config, [IMAGE_A, IMAGE_B], n=6))
        sched.add(image_request("b", config, [IMAGE_B], n=6, text=5))
        tokens[graphed] = {rid: t for rid, (t, _) in drain(sched).items()}
        assert images.encoded_images == 3 and not images.held
    assert tokens[True] == tokens[False]

    graphs = images.graphs
    assert graphs.captures == 2  # A's grid, B's
    tower = images.tower
    for grid in [(1, 2, 2), (1, 4, 6), (1, 2, 2), (1, 10, 10)]:
        x = torch.randn(grid[0] * grid[1] * grid[2], graphs.pixel_width)
        got = graphs.encode(x, grid)
        with torch.inference_mode():
            assert torch.equal(got, tower(x, [grid]))
    # two grids held at most, the least recently used evicted, never the last one
    assert graphs.captures == 5 and list(graphs.graphs) == [(1, 2, 2), (1, 10, 10)]
    assert graphs.pixels.shape[0] == 100 and graphs.embeds.shape[0] == 25  # made up front
    grid = (1, 10, 10)
    first = graphs.encode(torch.randn(100, graphs.pixel_width), grid)
    assert not torch.equal(first, graphs.encode(torch.randn(100, graphs.pixel_width), grid))
    with pytest.raises(ValueError, match="more than the 25"):
        graphs.encode(torch.randn(144, graphs.pixel_width), (1, 12, 12))
    with pytest.raises(ValueError, match="pixel values"):
        graphs.encode(torch.randn(99, graphs.pixel_width), grid)


# ---- CUDA: the real-size tower ----

REAL = VisionConfig(out_hidden_size=4096)  # GLM-5.3-Flash's: 24 blocks of 1024, out 4096
G448 = (1, 32, 32)  # a 448x448 image: 1,024 patches, 256 tokens
G224x336 = (1, 16, 24)
G112 = (1, 8, 8)


@pytest.fixture(scope="module")
def real_tower():
    from serving.models.random_init import random_vision

    return random_vision(SimpleNamespace(vision=REAL), torch.bfloat16, "cuda", seed=3)


def pixels(grid, seed: int) -> torch.Tensor:
    """Fresh float32 pixel values (normalized, as the processor's) for one image."""
    t, h, w = grid
    width = REAL.in_channels * REAL.temporal_patch_size * REAL.patch_size**2
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(t * h * w, width, generator=gen, device="cuda")


@torch.inference_mode()
def eager(tower, x: torch.Tensor, grid) -> torch.Tensor:
    return tower(x, [grid])


def assert_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and torch.isfinite(want).all()
    assert torch.equal(got, want), f"max |diff| {(got.float() - want.float()).abs().max().item()}"


@pytest.mark.gpu
def test_graphed_images_equal_the_eager_tower(real_tower) -> None:
    """448x448 and 224x336 images, one after the other as a two-image step encodes them: each
    torch.equal to the eager tower on that image alone; a replay into a NaN-poisoned output
    buffer writes every row, and the first image's copy survives the second's replay."""
    from serving.executor.vision_graphs import VisionGraphs

    graphs = VisionGraphs(real_tower, max_shapes=16, max_tokens=256)
    big, small = pixels(G448, 1), pixels(G224x336, 2)
    first = graphs.encode(big, G448)
    second = graphs.encode(small, G224x336)
    assert graphs.captures == 2 and list(graphs.graphs) == [G448, G224x336]
    assert first.shape == (256, 4096) and second.shape == (96, 4096)
    assert_equal(first, eager(real_tower, big, G448))
    assert_equal(second, eager(real_tower, small, G224x336))
    with torch.inference_mode():  # the buffers are inference tensors
        graphs.embeds.fill_(float("nan"))
    again = graphs.encode(big, G448)  # a replay: no capture
    assert graphs.captures == 2 and list(graphs.graphs) == [G224x336, G448]
    assert_equal(again, first)


@pytest.mark.gpu
def test_a_replay_reads_new_pixels(real_tower) -> None:
    from serving.executor.vision_graphs import VisionGraphs

    graphs = VisionGraphs(real_tower, max_shapes=16, max_tokens=256)
    a, b = pixels(G448, 3), pixels(G448, 4)
    out_a = graphs.encode(a, G448)
    out_b = graphs.encode(b, G448)
    assert graphs.captures == 1
    assert not torch.equal(out_a, out_b)
    assert_equal(out_b, eager(real_tower, b, G448))
    assert_equal(out_a, eager(real_tower, a, G448))  # a copy: b's replay left it alone


@pytest.mark.gpu
def test_lru_eviction_keeps_outputs_equal(real_tower) -> None:
    """max_shapes 2 over three grids: the least recently used graph goes and comes back
    recaptured into the same pool, every output equal to the eager tower's; an image larger
    than the buffers (the front's limit) is refused."""
    from serving.executor.vision_graphs import VisionGraphs

    graphs = VisionGraphs(real_tower, max_shapes=2, max_tokens=256)
    for step, grid in enumerate([G448, G224x336, G112, G448, G112]):
        x = pixels(grid, 10 + step)
        assert_equal(graphs.encode(x, grid), eager(real_tower, x, grid))
    assert graphs.captures == 4 and list(graphs.graphs) == [G448, G112]

    with pytest.raises(ValueError, match="more than the 256"):  # the buffers' size
        graphs.encode(pixels((1, 34, 34), 20), (1, 34, 34))
    x = pixels(G448, 21)  # the graphs still serve after a refusal
    assert_equal(graphs.encode(x, G448), eager(real_tower, x, G448))
