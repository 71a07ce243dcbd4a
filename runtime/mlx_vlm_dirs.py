"""An embedded tiny VLM (`cas_bank.runtime.vlm_models`) written as a model directory
that mlx-vlm's own loader and server read (`mlx_vlm.utils.load(path)`,
`python -m mlx_vlm.server --model path`, `cas-bank mlx-vlm-server --model path`).

mlx-vlm's server loads a model only from a path: its config, its weights and a
Hugging Face processor (`AutoProcessor.from_pretrained`). `vlm_model_dir(path)` writes:

- `config.json`: the embedded config, with `eos_token_id` (`<|im_end|>`);
- `model.safetensors`: the seeded random weights (mlx-vlm's own parameter names);
- `tokenizer.json` + `tokenizer_config.json`: a byte-level BPE trained here with the
  `tokenizers` library (milliseconds), its vocabulary filled to the model's 512 ids
  with reserved tokens so that the vision tokens sit where the config says
  (`<|image_pad|>` 508, `<|video_pad|>` 509, `<|vision_start|>` 510, `<|vision_end|>`
  511), and a Qwen2-VL-style chat template (an image part of a message becomes
  `<|vision_start|><|image_pad|><|vision_end|>`, which the processor widens to one
  `<|image_pad|>` per merged patch);
- `preprocessor_config.json`: Qwen2-VL's image processor at `PROCESSOR_CONFIG`'s
  sizes (56×56 to 112×112 pixels: 4 to 16 image tokens).

Nothing is downloaded. Needs the `vision` extra (mlx-vlm, transformers, tokenizers).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import mlx.core as mx
from mlx.utils import tree_flatten

from .vlm_models import (
    IMAGE_TOKEN,
    PROCESSOR_CONFIG,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    VOCAB,
    vlm_config,
)

SPECIALS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VISION_SPECIALS: Final = {
    IMAGE_TOKEN: "<|image_pad|>",
    VIDEO_TOKEN: "<|video_pad|>",
    VISION_START: "<|vision_start|>",
    VISION_END: "<|vision_end|>",
}
_MERGES_VOCAB: Final = 360  # bytes (256) + specials + ~100 merges

CHAT_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] in ('image', 'image_url', 'input_image') %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ('text', 'input_text') %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _training_text() -> list[str]:
    lines = [
        "You are a careful assistant. Look at the screenshot and answer briefly.",
        "What is shown in this picture? Describe the colours, the shapes and the text.",
    ]
    return lines + [f"question {i}: how many windows are open in the picture?" for i in range(30)]


def bpe_tokenizer_json() -> str:
    """The tokenizer: a trained byte-level BPE, filled to `VOCAB` ids, the vision
    tokens at their config ids (tokenizer.json text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_MERGES_VOCAB,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer)
    names = [
        VISION_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(tok.get_vocab_size(), VOCAB)
    ]
    tok.add_special_tokens(names)
    for token_id, name in VISION_SPECIALS.items():
        assert tok.token_to_id(name) == token_id, (name, tok.token_to_id(name))
    return str(tok.to_str())


def _config(given: Mapping[str, Any], eos: int) -> dict[str, Any]:
    config = copy.deepcopy(dict(given))
    config["eos_token_id"] = [eos]
    # transformers reads config.json too (AutoProcessor), and its Qwen2-VL vision config
    # types `mlp_ratio` as an int: 2.0 written as 2 (the same model for mlx-vlm).
    vision = config["vision_config"]
    if "mlp_ratio" in vision and float(vision["mlp_ratio"]).is_integer():
        vision["mlp_ratio"] = int(vision["mlp_ratio"])
    return config


def _build(config: Mapping[str, Any], seed: int) -> Any:
    """The mlx-vlm model of `config`, weights drawn from `seed` (as `build_vlm`)."""
    from mlx_vlm.utils import get_model_and_args

    module, _ = get_model_and_args(dict(config))
    model_config = module.ModelConfig.from_dict(copy.deepcopy(dict(config)))
    model_config.vision_config = module.VisionConfig.from_dict(dict(config["vision_config"]))
    model_config.text_config = module.TextConfig.from_dict(dict(config.get("text_config", config)))
    mx.random.seed(seed)
    model = module.Model(model_config)
    mx.eval(model.parameters())
    return model


def vlm_model_dir(
    path: str | Path,
    name: str = "tiny-qwen2-vl",
    *,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
    max_pixels: int | None = None,
) -> Path:
    """Write embedded VLM `name` (weights from `seed`) as an mlx-vlm model directory at
    `path` (created; files already there are overwritten). Returns the directory.

    `config`: another config of the same family instead of `name`'s (the benchmark's
    larger model; vocabulary and vision token ids as the embedded ones). `max_pixels`:
    the image processor's bound instead of `PROCESSOR_CONFIG`'s (larger images, more
    image tokens)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = bpe_tokenizer_json()
    (out / "tokenizer.json").write_text(tokenizer)
    eos = int(json.loads(tokenizer)["model"]["vocab"].get("<|im_end|>", -1))
    if eos < 0:  # added specials live in added_tokens, not the BPE's vocab
        eos = next(
            t["id"] for t in json.loads(tokenizer)["added_tokens"] if t["content"] == "<|im_end|>"
        )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 32768,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        **PROCESSOR_CONFIG,
        **({"max_pixels": max_pixels} if max_pixels else {}),
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=1))
    written = _config(config if config is not None else vlm_config(name), eos)
    (out / "config.json").write_text(json.dumps(written, indent=1, sort_keys=True))
    model = _build(written, seed)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out
