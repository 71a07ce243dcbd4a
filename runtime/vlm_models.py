"""Tiny vision-language models for tests and the demo: real `mlx-vlm` architectures
built from a config dict with seeded random weights, and a local image processor
configuration (nothing downloaded).

`tiny_vlm("tiny-qwen2-vl")` is mlx-vlm's Qwen2-VL (a ViT with 2×2 patch merging, a
Qwen2 language model with multimodal RoPE) at 2 text layers of 64 wide and 1 vision
layer; `tiny-qwen2.5-vl` is Qwen2.5-VL (windowed vision attention) at the same size;
`tiny-qwen3-vl` is Qwen3-VL (deepstack features, interleaved multimodal RoPE);
`tiny-gemma3` is Gemma 3 (which the bank refuses, naming it).
The Qwen models take transformers' Qwen2-VL image processor (the PIL backend: no
torchvision) sized for images of 56×56 to 112×112 pixels (4 to 16 image tokens). The text side is
the byte tokenizer of the embedded mlx-lm models (`runtime.tokenizer`): ids 0..~300;
the vision special tokens sit at the top of the 512-id vocabulary.

Needs the `vision` extra (mlx-vlm); the core library never imports this module.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import mlx.core as mx
import mlx.nn as nn
import numpy as np

VOCAB: Final = 512
IMAGE_TOKEN: Final = 508
VIDEO_TOKEN: Final = 509
VISION_START: Final = 510
VISION_END: Final = 511

_TEXT: Final[Mapping[str, Any]] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=32768,
    rope_theta=10000.0,
    # head_dim 16: 8 rotary frequencies, split over (time, height, width)
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    tie_word_embeddings=False,
)

_VISION: Final[Mapping[str, Any]] = dict(
    depth=1,
    embed_dim=32,
    hidden_size=64,  # the merger's output: the text model's width
    num_heads=2,
    patch_size=14,
    spatial_patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    in_channels=3,
    mlp_ratio=2.0,
)

_IDS: Final[Mapping[str, Any]] = dict(
    image_token_id=IMAGE_TOKEN,
    video_token_id=VIDEO_TOKEN,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
)

_CONFIGS: Final[Mapping[str, Mapping[str, Any]]] = {
    "tiny-qwen2-vl": dict(model_type="qwen2_vl", **_TEXT, **_IDS, vision_config=dict(_VISION)),
    "tiny-qwen2.5-vl": dict(
        model_type="qwen2_5_vl",
        **_TEXT,
        **_IDS,
        vision_config=dict(
            _VISION,
            model_type="qwen2_5_vl",
            out_hidden_size=64,
            intermediate_size=64,
            window_size=56,
            fullatt_block_indexes=[0],
        ),
    ),
    # Qwen3-VL: deepstack (the encoder's layer-0 features added into the first text
    # layer at the image's positions), interleaved multimodal RoPE.
    "tiny-qwen3-vl": dict(
        model_type="qwen3_vl",
        **_IDS,
        vocab_size=VOCAB,
        text_config=dict(
            {k: v for k, v in _TEXT.items() if k != "rope_scaling"},
            model_type="qwen3_vl_text",
            head_dim=16,
            rope_scaling={
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            model_type="qwen3_vl",
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=64,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
    ),
    # Gemma 3 (SigLIP, 4 tokens an image): built to show the refusal, which names it.
    "tiny-gemma3": dict(
        model_type="gemma3",
        vocab_size=VOCAB,
        image_token_index=IMAGE_TOKEN,
        hidden_size=64,
        mm_tokens_per_image=4,
        text_config=dict(
            model_type="gemma3_text",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            head_dim=16,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            sliding_window=64,
            mm_tokens_per_image=4,
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            patch_size=14,
            image_size=56,
        ),
    ),
}

VLM_NAMES: Final = tuple(_CONFIGS)

# The image processor's local configuration (transformers' Qwen2-VL processor).
PROCESSOR_CONFIG: Final[Mapping[str, Any]] = dict(
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=56 * 56,
    max_pixels=112 * 112,
)


@dataclass(frozen=True)
class TinyVLM:
    """An embedded vision-language model: the mlx-vlm module, its config dict and its
    image processor."""

    name: str
    model: nn.Module
    config: Mapping[str, Any]
    image_processor: Any


def vlm_config(name: str) -> dict[str, Any]:
    """A copy of embedded VLM `name`'s config dict (ValueError naming the known ones)."""
    if name not in _CONFIGS:
        raise ValueError(f"unknown VLM {name!r}; known: {', '.join(VLM_NAMES)}")
    return copy.deepcopy(dict(_CONFIGS[name]))


def image_processor(**settings: Any) -> Any:
    """transformers' Qwen2-VL image processor (PIL backend) from `PROCESSOR_CONFIG`,
    with `settings` over it (`min_pixels=28 * 28`: a one-position image)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(**{**PROCESSOR_CONFIG, **settings})


def build_vlm(name: str = "tiny-qwen2-vl", *, seed: int = 0) -> TinyVLM:
    """Build embedded VLM `name` with random weights drawn from `seed` (reseeds MLX's
    global generator), its image processor beside it."""
    from mlx_vlm.utils import get_model_and_args

    config = vlm_config(name)
    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(copy.deepcopy(config))
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model_config.text_config = module.TextConfig.from_dict(config.get("text_config", config))
    mx.random.seed(seed)
    model = module.Model(model_config)
    model.eval()
    mx.eval(model.parameters())
    return TinyVLM(name=name, model=model, config=config, image_processor=image_processor())


def random_image(seed: int, size: tuple[int, int] = (84, 84)) -> Any:
    """A PIL image of seeded random pixels, `size` = (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def vlm_inputs(
    processor: Any, parts: Sequence[Sequence[int] | Any]
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """`(input_ids, pixel_values, image_grid_thw)` as Qwen2-VL's processor lays them out,
    for `parts`: lists of text ids and PIL images, in order. Each image becomes
    `<vision_start>`, one `<image_pad>` per merged patch, `<vision_end>`."""
    images = [p for p in parts if not isinstance(p, (list, tuple, np.ndarray))]
    pixels = grid = None
    if images:
        out = processor(images=images, return_tensors="np")
        pixels, grid = np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])
    merge = PROCESSOR_CONFIG["merge_size"] ** 2
    ids: list[int] = []
    at = 0
    for p in parts:
        if isinstance(p, (list, tuple, np.ndarray)):
            ids.extend(int(t) for t in p)
            continue
        assert grid is not None
        n = int(np.prod(grid[at])) // merge
        ids += [VISION_START, *([IMAGE_TOKEN] * n), VISION_END]
        at += 1
    return np.asarray(ids, dtype=np.int32), pixels, grid
