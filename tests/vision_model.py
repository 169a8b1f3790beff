"""A tiny random SmolVLM / Idefics3 model saved as an HF folder, with a tokenizer that has
the image tokens and a chat template whose image parts render as `<image>`: the vision
oracle tests (tests/test_vision_model.py) and the image server tests share it."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers.models.idefics3 import Idefics3ImageProcessorPil, Idefics3Processor

SPECIAL = ["<|endoftext|>", "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
           *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
PREFIX = "describe the picture in a few words, please. " * 3
# SmolVLM's turn format, written here (nothing is downloaded): image parts become <image>.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def vision_tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([PREFIX + "\n the quick brown fox jumps over the lazy dog"] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                additional_special_tokens=SPECIAL[1:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_vision_model(folder: Path) -> tuple[transformers.Idefics3ForConditionalGeneration, Idefics3Processor]:
    """Save the model into `folder`: 32-pixel tiles of 4x4 patches, 4 tokens a tile after
    the pixel shuffle, images resized to a 64-pixel longest edge (up to 2x2 tiles)."""
    fast = vision_tokenizer()
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}),
        tokenizer=fast, image_seq_len=4)
    config = transformers.Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=len(fast), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rms_norm_eps=1e-6),
        scale_factor=2, image_token_id=fast.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    fast.save_pretrained(folder)
    return model, processor
