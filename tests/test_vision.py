"""The vision path against transformers 5.17's glm5_next (CPU, float32): preprocessing against
Glm5NextImageProcessorPil (fed by transformers' own load_image), the tower and merger against
Glm5NextVisionModel with the same weights copied by name, the image embeddings' scatter into the
prompt against Glm5NextModel.forward, the placeholder expansion against Glm5NextProcessor."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from serving.front.images import (
    IMAGE_TOKEN,
    ImageError,
    ImageProcessorConfig,
    decode_image,
    expand_image_placeholders,
    expand_image_token_ids,
    preprocess,
    target_size,
)
from serving.models.vision import VisionConfig, VisionTower, num_tokens, scatter_image_embeddings
from tests.hf_oracle import text_config

ROOT = Path(__file__).resolve().parents[1]
# depth 2, 4 heads of 16; out_hidden = the text width of hf_oracle's text config. A low
# swiglu_limit so the clamps bite on these random weights.
TINY = dict(
    depth=2,
    hidden_size=64,
    num_heads=4,
    intermediate_size=96,
    out_hidden_size=64,
    projection_intermediate_size=80,
    swiglu_limit=0.5,
)
IDS = dict(  # in hf_oracle's 256-token vocabulary
    image_token_id=250,
    video_token_id=251,
    image_start_token_id=246,
    image_end_token_id=247,
    video_start_token_id=248,
    video_end_token_id=249,
)


def encoded(image: Image.Image, fmt: str, **save) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return buf.getvalue()


def noise(height: int, width: int, seed: int, channels: int = 3) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def gif_two_frames() -> bytes:
    first = Image.fromarray(noise(45, 70, 1)).convert("P", palette=Image.Palette.ADAPTIVE)
    second = Image.fromarray(noise(45, 70, 2)).convert("P", palette=Image.Palette.ADAPTIVE)
    return encoded(first, "GIF", save_all=True, append_images=[second])


def rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    return encoded(Image.fromarray(noise(40, 100, 3)), "JPEG", exif=exif, quality=90)


def large_smooth() -> bytes:
    """6.9 MP (over 8,000 tokens, so fitted down); smooth, so the JPEG stays small."""
    rows = (np.arange(2300) % 256).astype(np.uint8)[:, None]
    cols = (np.arange(3000) % 256).astype(np.uint8)[None, :]
    rgb = np.stack(np.broadcast_arrays(cols, rows, rows // 2 + cols // 2), axis=-1)
    return encoded(Image.fromarray(np.ascontiguousarray(rgb)), "JPEG", quality=85)


IMAGES = {
    "png_odd_size": lambda: encoded(Image.fromarray(noise(57, 100, 4)), "PNG"),
    "png_tiny_1x1": lambda: encoded(Image.fromarray(noise(1, 1, 5)), "PNG"),
    "jpeg_wide": lambda: encoded(Image.fromarray(noise(30, 700, 6)), "JPEG"),
    "jpeg_tall_thin": lambda: encoded(Image.fromarray(noise(900, 9, 7)), "JPEG"),
    "jpeg_exif_rotated": rotated_jpeg,
    "png_rgba": lambda: encoded(Image.fromarray(noise(64, 50, 8, channels=4), "RGBA"), "PNG"),
    "png_palette_transparent": lambda: encoded(
        Image.fromarray(noise(33, 81, 9)).convert("P", palette=Image.Palette.ADAPTIVE),
        "PNG",
        transparency=0,
    ),
    "png_grey": lambda: encoded(Image.fromarray(noise(99, 61, 10, channels=1), "L"), "PNG"),
    "webp": lambda: encoded(Image.fromarray(noise(224, 300, 11)), "WEBP", quality=80),
    "gif_first_frame": gif_two_frames,
    "png_1280x720": lambda: encoded(Image.fromarray(noise(720, 1280, 12)), "PNG"),
    "jpeg_7mp": large_smooth,
}


def hf_processed(data: bytes, **kwargs):
    """transformers end to end: load_image on a data URL, then Glm5NextImageProcessorPil."""
    from transformers.image_utils import load_image
    from transformers.models.glm5_next.image_processing_pil_glm5_next import (
        Glm5NextImageProcessorPil,
    )

    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return Glm5NextImageProcessorPil(**kwargs)(load_image(url), return_tensors="np")


# ---- (a) preprocessing ----


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_preprocess_equals_transformers(name: str) -> None:
    data = IMAGES[name]()
    ref = hf_processed(data)
    ours = preprocess(decode_image(data), ImageProcessorConfig())
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert ours.pixel_values.dtype == np.float32
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert np.abs(ours.pixel_values - ref["pixel_values"]).max() <= 1e-6
    assert ours.num_tokens == int(ref["image_grid_thw"][0].prod()) // 4


def test_decoding_follows_load_image() -> None:
    """The GIF's first frame, not its second; the EXIF rotation applied (40x100 shows as
    100x40); alpha dropped, not composited."""
    gif = decode_image(gif_two_frames())
    first = Image.open(io.BytesIO(gif_two_frames())).convert("RGB")
    assert np.array_equal(np.asarray(gif), np.asarray(first))
    assert decode_image(rotated_jpeg()).size == (40, 100)
    rgba = noise(8, 8, 13, channels=4)
    decoded = decode_image(encoded(Image.fromarray(rgba, "RGBA"), "PNG"))
    assert np.array_equal(np.asarray(decoded), rgba[..., :3])


def test_token_budget_from_preprocessor_config() -> None:
    raw = {"min_image_tokens": 4, "max_image_tokens": 64, "patch_size": 14, "merge_size": 2}
    config = ImageProcessorConfig.from_dict(raw)
    for name in ("png_odd_size", "png_tiny_1x1", "png_1280x720"):
        data = IMAGES[name]()
        ref = hf_processed(data, min_image_tokens=4, max_image_tokens=64)
        ours = preprocess(decode_image(data), config)
        assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
        assert np.abs(ours.pixel_values - ref["pixel_values"]).max() <= 1e-6
    with pytest.raises(ValueError, match="do_normalize"):
        ImageProcessorConfig.from_dict({"do_normalize": False})


def test_canvas_size_equals_smart_resize() -> None:
    """Every branch (scaled up to the minimum, kept, fitted down by the bisection, no fit)
    over sizes from 1 px to 20,000 px a side."""
    from transformers.models.glm5_next.image_processing_pil_glm5_next import smart_resize

    rng = np.random.default_rng(14)
    sizes = [(1, 1), (1, 100_000), (100_000, 1), (28, 28), (29, 29), (448, 448), (14, 2000)]
    sizes += [tuple(int(v) for v in rng.integers(1, 20_000, 2)) for _ in range(3000)]
    sizes += [tuple(int(v) for v in rng.integers(1, 300, 2)) for _ in range(1000)]
    for budget in ((16, 8000), (4, 64)):
        config = ImageProcessorConfig(min_image_tokens=budget[0], max_image_tokens=budget[1])
        for h, w in sizes:
            assert target_size(h, w, config) == smart_resize(2, h, w, 2, 28, *budget), (h, w)


def test_placeholders_expand_as_the_processor_does() -> None:
    from transformers.models.glm5_next.image_processing_pil_glm5_next import (
        Glm5NextImageProcessorPil,
    )
    from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor

    # the processor's text step alone (its constructor wants a video processor, which needs
    # torchvision): replace_image_token + get_text_with_replacements
    processor = object.__new__(Glm5NextProcessor)
    processor.image_token, processor.image_processor = IMAGE_TOKEN, Glm5NextImageProcessorPil()
    images = [decode_image(IMAGES[n]()) for n in ("png_odd_size", "jpeg_wide", "png_odd_size")]
    _, replacements = processor._process_images(images)
    one = f"<|begin_of_image|>{IMAGE_TOKEN}<|end_of_image|>"
    text = f"<|user|>\nfirst {one} then {one}{one} which?<|assistant|>"
    expected = processor.get_text_with_replacements([text], replacements)[0][0]
    counts = [preprocess(im, ImageProcessorConfig()).num_tokens for im in images]
    assert expand_image_placeholders(text, counts) == expected
    assert expected.count(IMAGE_TOKEN) == sum(counts)

    ids = [5, 246, 250, 247, 6, 246, 250, 247, 7]
    expanded, starts = expand_image_token_ids(ids, [2, 3], 250)
    assert expanded == [5, 246, 250, 250, 247, 6, 246, 250, 250, 250, 247, 7]
    assert starts == [2, 7]


def test_token_ids_expand_as_the_text_does() -> None:
    """Expanding after tokenizing gives the ids of tokenizing the expanded text: <|image|> is
    one special token, so the text around it tokenizes alike (the small model's tokenizer with
    <|image|> added, as GLM's has it)."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(ROOT / "serving/assets/small_model/tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True)])
    image_id = tokenizer.token_to_id(IMAGE_TOKEN)
    one = f"<|begin_of_image|>{IMAGE_TOKEN}<|end_of_image|>"
    text = f"<|user|>\nWhat colour{one}is the square in{one}? Say it.<|assistant|>"
    counts = [5, 3]
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    expanded, starts = expand_image_token_ids(ids, counts, image_id)
    wanted = tokenizer.encode(expand_image_placeholders(text, counts), add_special_tokens=False)
    assert expanded == wanted.ids
    runs = [i for s, n in zip(starts, counts) for i in range(s, s + n)]
    assert runs == [i for i, t in enumerate(expanded) if t == image_id]


# ---- errors ----


def test_bad_images_are_refused_naming_the_problem() -> None:
    png = IMAGES["png_odd_size"]()
    cases = [
        (b"not an image at all", "cannot be decoded"),
        (png[: len(png) // 2], "cannot be decoded"),  # truncated after the header
        (encoded(Image.fromarray(noise(8, 8, 15)), "BMP"), "format BMP is not supported"),
        (encoded(Image.fromarray(noise(8, 8, 15)), "TIFF"), "format TIFF is not supported"),
    ]
    for data, words in cases:
        with pytest.raises(ImageError, match=words):
            decode_image(data)
    with pytest.raises(ImageError, match=r"bytes is over the limit of 100 bytes"):
        decode_image(png, max_bytes=100)
    with pytest.raises(ImageError, match=r"100x57 pixels is over the limit of 5000 pixels"):
        decode_image(png, max_pixels=5000)
    image = decode_image(IMAGES["png_1280x720"]())
    with pytest.raises(ImageError, match="takes 1196 image tokens, over the limit of 1000"):
        preprocess(image, ImageProcessorConfig(), max_tokens=1000)
    assert preprocess(image, ImageProcessorConfig(), max_tokens=1196).num_tokens == 1196
    with pytest.raises(ImageError, match="2 image placeholders for 1 images"):
        expand_image_placeholders(f"{IMAGE_TOKEN} {IMAGE_TOKEN}", [4])
    with pytest.raises(ImageError, match="1 image placeholders for 2 images"):
        expand_image_token_ids([1, 250, 2], [4, 4], 250)
    with pytest.raises(ImageError, match="1 image placeholders for 0 images"):
        expand_image_token_ids([1, 250, 2], [], 250)  # typed in a message, no image sent
    assert issubclass(ImageError, ValueError)


def test_the_image_module_never_imports_torch() -> None:
    code = (
        "import sys, serving.front.images; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


# ---- (b) the tower and merger, (c) the scatter ----


@pytest.fixture(scope="module")
def oracle():
    """transformers' whole glm5_next on a tiny config (the vision weights perturbed so every one
    matters), and our tower holding the same weights, copied by checkpoint name."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(0)
    config = Glm5NextConfig(text_config=text_config(), vision_config=TINY, **IDS)
    model = Glm5NextForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            if "norm" in name and p.dim() == 1 and not name.endswith("bias"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.add_(torch.randn_like(p) * 0.1)
    prefix = "model.visual."
    weights = {k[len(prefix) :]: v for k, v in model.state_dict().items() if k.startswith(prefix)}
    tower = VisionTower(VisionConfig.from_dict(config.vision_config.to_dict()), torch.float32)
    tower.load_state_dict(weights, strict=True)  # every name the same, nothing left over
    return model, tower


def pixels(*names: str) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    done = [preprocess(decode_image(IMAGES[n]()), ImageProcessorConfig()) for n in names]
    return torch.from_numpy(np.concatenate([d.pixel_values for d in done])), [
        d.grid_thw for d in done
    ]


def hf_tower(model, pixel_values: torch.Tensor, grids) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values, torch.tensor(grids))
    return torch.cat(out.pooler_output)


def test_tower_names_and_shapes_are_the_checkpoints(oracle) -> None:
    model, tower = oracle
    prefix = "model.visual."
    theirs = {k[len(prefix) :]: v.shape for k, v in model.state_dict().items() if prefix in k}
    assert {k: v.shape for k, v in tower.state_dict().items()} == theirs
    assert tower.config == VisionConfig(**TINY)


@pytest.mark.parametrize("names", [("png_odd_size",), ("jpeg_wide", "png_grey")])
def test_tower_equals_transformers(oracle, names) -> None:
    """One image; two of different sizes in one batch, each seeing only its own patches."""
    model, tower = oracle
    pixel_values, grids = pixels(*names)
    with torch.no_grad():
        ours = tower(pixel_values, grids)
    ref = hf_tower(model, pixel_values, grids)
    assert ours.shape == (sum(num_tokens(g, 2) for g in grids), 64)
    assert (ours - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())
    # the clamps of both SwiGLUs are exercised (the limit is low)
    mlp = tower.blocks[0].mlp
    with torch.no_grad():
        gate = mlp.gate_proj(tower.blocks[0].norm2(tower.patch_embed(pixel_values)))
    assert (gate > mlp.limit).any()
    if len(names) > 1:
        with torch.no_grad():
            alone = [tower(*pixels(n)) for n in names]
        assert (torch.cat(alone) - ours).abs().max() <= 1e-5


def test_scatter_equals_transformers(oracle) -> None:
    """Glm5NextModel.forward's inputs_embeds for the text model, on a prompt with two images;
    the expansion's runs are the tokens transformers' mask takes."""
    model, tower = oracle
    pixel_values, grids = pixels("png_odd_size", "jpeg_wide")
    counts = [num_tokens(g, 2) for g in grids]
    one = [IDS["image_start_token_id"], IDS["image_token_id"], IDS["image_end_token_id"]]
    ids, starts = expand_image_token_ids([10, 11] + one + [12] + one + [13, 14], counts, 250)
    input_ids = torch.tensor([ids])

    captured = {}

    class Captured(Exception):
        pass

    def capture(_module, _args, kwargs):
        captured["inputs_embeds"] = kwargs["inputs_embeds"][0]
        raise Captured  # the text model is not under test

    hook = model.model.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad(), pytest.raises(Captured):
            model.model(
                input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=torch.tensor(grids)
            )
    finally:
        hook.remove()
    expected = captured["inputs_embeds"]

    embeds = model.model.language_model.embed_tokens(input_ids[0]).detach()
    positions = torch.tensor([p for s, n in zip(starts, counts) for p in range(s, s + n)])
    mask, _ = model.model.get_placeholder_mask(input_ids, inputs_embeds=embeds[None])
    assert torch.equal(mask[0, :, 0].nonzero()[:, 0], positions)
    # the scatter itself is exact; through our tower, equal to the tower's tolerance
    exact = scatter_image_embeddings(embeds, positions, hf_tower(model, pixel_values, grids))
    assert torch.equal(exact, expected)
    with torch.no_grad():
        ours = scatter_image_embeddings(embeds, positions, tower(pixel_values, grids))
    assert (ours - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())


# ---- the real size on a GPU ----


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.gpu
def test_real_size_tower_equals_transformers_on_cuda(no_tf32) -> None:
    """GLM-5.3-Flash's tower (24 x 1024, out 4096) with random weights, one 448x448 image, on
    CUDA in float32 (TF32 off for both): ours against transformers' sdpa path, to 1e-4 of the
    output's scale. Then both in bf16, judged against that float32 output: ours no further from
    it than twice transformers' own bf16."""
    from transformers import Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    torch.manual_seed(1)
    hf_config = Glm5NextVisionConfig(out_hidden_size=4096)
    with torch.device("cuda"):
        ref = Glm5NextVisionModel(hf_config).eval()
        tower = VisionTower(VisionConfig.from_dict(hf_config.to_dict()), torch.float32)
    tower.load_state_dict(ref.state_dict(), strict=True)
    done = preprocess(Image.fromarray(noise(448, 448, 16)), ImageProcessorConfig())
    pixel_values = torch.from_numpy(done.pixel_values).cuda()
    grids = [done.grid_thw]
    grid_thw = torch.tensor(grids, device="cuda")
    with torch.no_grad():
        want = ref(pixel_values, grid_thw=grid_thw).pooler_output
        got = tower(pixel_values, grids)
    assert got.shape == (256, 4096) and torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())

    ref.to(torch.bfloat16)
    tower.to(torch.bfloat16)
    with torch.no_grad():
        hf_bf16 = ref(pixel_values, grid_thw=grid_thw).pooler_output.float()
        ours_bf16 = tower(pixel_values, grids).float()
    hf_err = ((hf_bf16 - want).norm() / want.norm()).item()
    our_err = ((ours_bf16 - want).norm() / want.norm()).item()
    assert our_err <= 2 * hf_err + 1e-3, (our_err, hf_err)
