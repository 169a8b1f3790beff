"""SmolVLM / Idefics3 on the paged engine against transformers' Idefics3ForConditionalGeneration:
a tiny random model with a tokenizer that has the image tokens, saved as an HF folder."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from model_utils import new_kv_caches, step_metadata  # noqa: E402
from vision_model import PREFIX, write_vision_model  # noqa: E402
from pagedserve import SamplingParams  # noqa: E402
from pagedserve.attention.backend import ReferenceBackend  # noqa: E402
from pagedserve.engine.llm import LLM  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.engine_config import EngineConfig  # noqa: E402
from pagedserve.model.loader import load_model  # noqa: E402
from pagedserve.multimodal.image_tiles import ImageTiling  # noqa: E402
from pagedserve.multimodal.inputs import ImageInput  # noqa: E402

LOGIT_ATOL = 1e-3  # the text oracle tests' (tests/test_model_reference.py)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BLOCK = 16
BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x KV heads x head_dim x fp32


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(folder, transformers' model, its processor)."""
    folder = tmp_path_factory.mktemp("idefics3")
    model, processor = write_vision_model(folder)
    return folder, model, processor


@pytest.fixture(scope="module")
def loaded(vlm):
    return load_model(vlm[0])


def picture(seed: int, width: int = 70, height: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def engine(loaded, **options) -> LLM:
    llm = LLM.__new__(LLM)
    options.setdefault("kv_cache_memory", 64 * BLOCK_BYTES)
    options.setdefault("max_num_seqs", 8)
    llm.engine = LLMEngine(EngineConfig(block_size=BLOCK, **options), loaded=loaded)
    return llm


def reference(vlm, text: str, images: list[np.ndarray]) -> dict:
    return vlm[2](text=[text], images=[[Image.fromarray(p) for p in images]], return_tensors="pt")


@pytest.mark.parametrize("size", [(70, 50), (20, 20), (32, 32), (30, 100), (64, 64), (65, 33), (1, 40)])
def test_pixel_values_equal_transformers(vlm, size):
    pixels = picture(1, *size)
    ours = ImageTiling.from_folder(vlm[0]).tile(ImageInput.from_array(pixels))
    theirs = vlm[2].image_processor(images=[[Image.fromarray(pixels)]], return_tensors="np", return_row_col_info=True)
    assert (ours.rows, ours.cols) == (theirs["rows"][0][0], theirs["cols"][0][0])
    assert ImageTiling.from_folder(vlm[0]).grid(*size) == (ours.rows, ours.cols)  # tokens_per_image's count
    np.testing.assert_array_equal(ours.pixel_values, theirs["pixel_values"][0])


def test_prompt_expansion_equals_processor(vlm, loaded):
    images = [picture(2), picture(3, 20, 30)]
    text = PREFIX + "<image> and <image> ?"
    llm = engine(loaded)
    ours = llm.generate(text, SamplingParams(max_tokens=1), use_tqdm=False,
                        images=[ImageInput.from_array(p) for p in images])[0]
    assert list(ours.prompt_token_ids) == reference(vlm, text, images)["input_ids"][0].tolist()
    vision = llm.engine.vision
    assert vision.placeholder == "<image>"
    expanded = sum(vision.tokens_per_image(ImageInput.from_array(p)) for p in images)
    assert len(ours.prompt_token_ids) == len(llm.engine.tokenizer.encode(text)) - 2 + expanded


@torch.inference_mode()
def test_logits_and_greedy_tokens_equal_transformers(vlm, loaded):
    images = [picture(4)]
    text = PREFIX + "<image> what is it?"
    inputs = reference(vlm, text, images)
    ref_logits = vlm[1](**inputs).logits[0]
    llm = engine(loaded)
    request = llm.engine.vision.expand(llm.engine.tokenizer.encode(text), [ImageInput.from_array(p) for p in images])
    ids = torch.tensor(request.token_ids)
    embeds = loaded.model.embed(ids)
    embeds[ids == loaded.image_prompts.image_token_id] = loaded.vision(torch.from_numpy(request.pixel_values[0]))
    n = len(ids)
    blocks = -(-n // 16)
    meta = step_metadata([0], [n], [list(range(1, blocks + 1))])
    ours = loaded.model(ids, torch.arange(n), new_kv_caches(loaded.model, blocks + 1), meta, ReferenceBackend(),
                        torch.arange(n), inputs_embeds=embeds)
    assert (ours - ref_logits).abs().max().item() < LOGIT_ATOL
    ref_tokens = vlm[1].generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)[0, n:].tolist()
    out = llm.generate(text, GREEDY, use_tqdm=False, images=[ImageInput.from_array(images[0])])[0]
    assert list(out.outputs[0].token_ids) == ref_tokens


def test_chunked_prefill_through_an_image_equals_unchunked(loaded):
    image = ImageInput.from_array(picture(5))
    prompt = PREFIX + "<image> what is it?"
    whole = engine(loaded, max_num_batched_tokens=512, enable_prefix_caching=False)
    chunked = engine(loaded, max_num_batched_tokens=BLOCK, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    a = whole.generate(prompt, params, use_tqdm=False, images=[image])[0]
    b = chunked.generate(prompt, params, use_tqdm=False, images=[image])[0]
    span = chunked.engine.vision.tokens_per_image(image)
    assert len(a.prompt_token_ids) > BLOCK + span  # the chunks cut through the image's run
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob) < 1e-4
    assert chunked.engine.images.cache.misses == 1  # encoded once, sliced by every chunk


def test_prefix_cache_keys_the_image_and_the_encoder_cache_serves_repeats(loaded):
    llm = engine(loaded, enable_prefix_caching=True)
    first, other = ImageInput.from_array(picture(6)), ImageInput.from_array(picture(7))
    prompt = PREFIX + "<image> what is it?"
    text_blocks = len(llm.engine.tokenizer.encode(PREFIX)) // BLOCK
    assert text_blocks >= 1
    a = llm.generate(prompt, GREEDY, use_tqdm=False, images=[first])[0]
    misses = llm.engine.images.cache.misses
    same = llm.generate(prompt, GREEDY, use_tqdm=False, images=[first])[0]
    another = llm.generate(prompt, GREEDY, use_tqdm=False, images=[other])[0]
    assert same.outputs[0].token_ids == a.outputs[0].token_ids
    assert same.metrics.num_cached_tokens == (len(a.prompt_token_ids) - 1) // BLOCK * BLOCK
    assert another.metrics.num_cached_tokens == text_blocks * BLOCK  # the text before the image only
    assert llm.engine.images.cache.misses == misses + 1  # the repeat was not encoded again; the other image was
    repeat = engine(loaded, enable_prefix_caching=False)
    repeat.generate(prompt, GREEDY, use_tqdm=False, images=[first])
    repeat.generate(prompt, GREEDY, use_tqdm=False, images=[first])
    assert (repeat.engine.images.cache.misses, repeat.engine.images.cache.hits) == (1, 1)
    assert llm.engine.images.num_held == repeat.engine.images.num_held == 0


@pytest.mark.parametrize("blocks, max_tokens", [
    (64, 6),  # room for every request
    # 16 blocks for about 60 blocks of requests: some are preempted and recomputed.
    pytest.param(16, 24, marks=pytest.mark.slow),
])
def test_same_tokens_alone_and_in_a_busy_batch(loaded, blocks, max_tokens):
    images = [ImageInput.from_array(picture(10 + i, 20 + 11 * i, 70 - 9 * i)) for i in range(4)]
    prompts, imgs = [], []
    for i in range(8):
        count = i % 3  # text only, one image, two images
        prompts.append(PREFIX[: 10 * i] + (" what is it? <image>" * count or f"the quick brown fox {i} " * (i + 1)))
        imgs.append([images[(i + k) % 4] for k in range(count)])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    alone = [engine(loaded).generate(p, params, use_tqdm=False, images=im)[0].outputs[0].token_ids
             for p, im in zip(prompts[:3], imgs[:3])]
    busy = engine(loaded, max_num_batched_tokens=40, enable_prefix_caching=True, kv_cache_memory=blocks * BLOCK_BYTES)
    outs = busy.generate(prompts, params, use_tqdm=False, images=imgs)
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone
    stats = busy.stats()
    assert (stats["num_preemptions"] > 0) == (blocks < 64)
    assert busy.engine.images.cache.misses == len(images)  # recomputed prompts took the cached outputs
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    busy.engine.scheduler.check_invariants()
    assert busy.engine.images.num_held == 0


def test_bad_image_requests_are_refused(loaded, tmp_path):
    llm = engine(loaded)
    image = ImageInput.from_array(picture(8))
    with pytest.raises(ValueError, match="images"):
        llm.engine.add_request("no placeholder here", GREEDY, images=[image])
    with pytest.raises(ValueError, match="images"):
        llm.engine.add_request("two <image> <image>", GREEDY, images=[image])
    with pytest.raises(ValueError, match="kv_transfer_params"):
        llm.engine.add_request("one <image>", GREEDY, images=[image], kv_transfer_params={"do_remote_decode": True})
    assert not llm.engine.has_unfinished_requests() and llm.engine.images.num_held == 0


def test_text_only_engine_refuses_images(vlm, tmp_path):
    fast = vlm[2].tokenizer
    config = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    fast.save_pretrained(tmp_path)
    llm = engine(load_model(tmp_path))
    assert llm.engine.vision is None
    with pytest.raises(ValueError, match="images"):
        llm.engine.add_request("a <image>", GREEDY, images=[ImageInput.from_array(picture(9))])


def test_tensor_parallel_refuses_a_vision_model(vlm):
    from pagedserve.distributed.loading import load_shard

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        load_shard(str(vlm[0]), 0, 2)


def test_quantised_text_decoder_runs_beside_the_tower(vlm, loaded):
    quantised = load_model(vlm[0], quantization="q8_0")
    assert "Q8_0" in quantised.model.describe_weights()
    image = ImageInput.from_array(picture(11))
    prompt = PREFIX + "<image> what is it?"
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ours = engine(quantised).generate(prompt, params, use_tqdm=False, images=[image])[0]
    full = engine(loaded).generate(prompt, params, use_tqdm=False, images=[image])[0]
    gaps = [abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob)
            for a, b in zip(ours.prompt_logprobs[1:], full.prompt_logprobs[1:])]
    assert max(gaps) < 0.05


def test_a_processor_that_disagrees_with_the_model_is_refused(vlm, tmp_path):
    import json
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(vlm[0], folder)
    cfg = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps({**cfg, "image_seq_len": 9}))
    with pytest.raises(ValueError, match="image_seq_len"):
        load_model(folder)
    (folder / "processor_config.json").write_text(json.dumps({**cfg, "image_processor": {
        **cfg["image_processor"], "size": {"height": 64, "width": 64}}}))
    with pytest.raises(ValueError, match="size"):
        load_model(folder)


def test_encoder_cache_keeps_the_most_recent_images():
    from pagedserve.worker.image_embeds import EncoderCache

    cache, encoded = EncoderCache(capacity=2), []
    for content_hash in "abcba":
        cache.get_or_encode(content_hash, lambda h=content_hash: encoded.append(h) or torch.zeros(1))
    assert encoded == ["a", "b", "c", "a"] and len(cache) == 2  # "a" was evicted by "c", "b" was kept
    with pytest.raises(ValueError, match="capacity"):
        EncoderCache(capacity=0)
