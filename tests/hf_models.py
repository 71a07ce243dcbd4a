"""Local mlx-lm model directories with a real Hugging Face tokenizer, built offline.

`model_dir(path, name)` writes what `mlx_lm.load` (and `cas_bank.runtime.load_model`)
reads from a converted Hugging Face model: config.json, model.safetensors, and a
tokenizer: a byte-level BPE trained here with the `tokenizers` library on text this
module writes (`tokenizer.json`), and a Qwen-style Jinja `chat_template` in
`tokenizer_config.json` (`<|im_start|>role\\n...<|im_end|>\\n`, a default system
message when the conversation brings none). The BPE's vocabulary is filled up to the
model's with reserved special tokens, so any id a random-weight model samples decodes.

`quantized=True` quantizes the weights with mlx-lm's own `quantize_model` (4 bits,
group 32) before saving, as `mlx_lm.convert -q` would. Training takes milliseconds.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
from cas_bank.runtime import LoadedModel, build_model, save_model
from cas_bank.runtime.models import model_config, weights_digest
from cas_bank.runtime.tokenizer import ByteTokenizer
from mlx_lm.utils import _get_classes, quantize_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES_VOCAB = 360  # bytes (256) + specials + ~100 merges: tiny, and fast to train

CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def training_text() -> list[str]:
    """What the BPE learns its merges from: assistant-style prose and questions."""
    lines = [
        "You are a careful assistant for a team of engineers.",
        "Answer briefly, cite the file you read, and use the tools when needed.",
        "The weather in the city is sunny with a light wind from the west.",
    ]
    lines += [f"user question {i}: what is the weather in city {i} today?" for i in range(40)]
    return lines


@cache
def bpe_tokenizer(vocab_size: int) -> str:
    """A trained byte-level BPE filled to `vocab_size` ids, as tokenizer.json text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MERGES_VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer)
    trained = tok.get_vocab_size()
    assert trained <= vocab_size, (trained, vocab_size)
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(trained, vocab_size)])
    return tok.to_str()


def write_tokenizer(path: Path, vocab_size: int) -> None:
    (path / "tokenizer.json").write_text(bpe_tokenizer(vocab_size))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": 32768,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def wide(name: str, seed: int = 0) -> LoadedModel:
    """An embedded model with head_dim 32, so its KV quantizes in groups of 32."""
    config = model_config(name)
    config["head_dim"] = 32
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    model.eval()
    mx.eval(model.parameters())
    tokenizer = ByteTokenizer(int(config["vocab_size"]))
    return LoadedModel(model, config, f"{name}-wide", tokenizer, weights_digest(model))


def quantized(loaded: LoadedModel, bits: int = 4, group_size: int = 32) -> LoadedModel:
    """`loaded` with its weights quantized by mlx-lm (a fresh copy of the module)."""
    config = copy.deepcopy(loaded.config)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    model.update(loaded.model.parameters())
    model, config = quantize_model(model, config, group_size=group_size, bits=bits)
    model.eval()
    mx.eval(model.parameters())
    return LoadedModel(
        model, config, f"{loaded.name}-q{bits}", loaded.tokenizer, weights_digest(model)
    )


def model_dir(path: Path, name: str, *, wide_heads: bool = False, quantize: bool = False) -> Path:
    """An mlx-lm model directory of embedded model `name` with a trained BPE and a
    Qwen-style chat template (see the module docstring)."""
    loaded = wide(name) if wide_heads else build_model(name)
    if quantize:
        loaded = quantized(loaded)
    save_model(loaded, path)
    vocab = int(loaded.config.get("vocab_size") or loaded.config["text_config"]["vocab_size"])
    write_tokenizer(path, vocab)
    return path


def hf_tokenizer(path: Path) -> Any:
    """The directory's tokenizer as mlx-lm loads it (a `TokenizerWrapper`)."""
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(path)
