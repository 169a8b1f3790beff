"""Beam search on the engine against transformers' generate(num_beams=...): a tiny random
checkpoint written by transformers (shipped tokenizer), the same token ids for every
returned beam; beams alone and in a busy batch; blocks shared, never leaked."""
from __future__ import annotations

import pytest
import torch
import transformers

from engine_utils import assert_all_blocks_free, make_llm
from pagedserve import SamplingParams
from pagedserve.model.loader import load_model

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "1, 2, 3, 5, 8,"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(gguf_path, tmp_path_factory):
    """(our LLM, transformers' model, prompts as ids, a stop token the model often picks)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = load_model(gguf_path).tokenizer
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, **TINY)).eval()
    with torch.no_grad():  # sharper distributions than random init's near-uniform ones, as a trained model's
        ref.lm_head.weight.mul_(8)
    ref.save_pretrained(path)
    tokenizer.save(path)
    llm = make_llm(load_model(path))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    # A token the best beam reaches early: as a stop token it makes beams finish on "stop".
    best = llm.beam_search(prompts[0], beam_width=4, max_tokens=4, ignore_eos=True, use_tqdm=False)[0]
    return llm, ref, prompts, best.outputs[0].token_ids[2]


def reference_beams(ref, ids: list[int], stops: list[int], **options) -> list[list[int]]:
    """transformers' beams, best first, each cut after its stop token (the rest is padding)."""
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=stops,
                           pad_token_id=stops[0], num_return_sequences=options["num_beams"], **options)
    beams = []
    for seq in out[:, len(ids):].tolist():
        ends = [i for i, t in enumerate(seq) if t in stops]
        beams.append(seq[: ends[0] + 1] if ends else seq)
    return beams


@pytest.mark.parametrize("length_penalty, early_stopping, both_reasons",
                         [(1.0, False, True), (2.0, True, False), (-0.5, "never", True)])
def test_beams_equal_transformers(tiny, length_penalty, early_stopping, both_reasons):
    llm, ref, prompts, stop = tiny
    params = SamplingParams(n=4, temperature=0, max_tokens=MAX_TOKENS, beam_width=4, length_penalty=length_penalty,
                            early_stopping=early_stopping, stop_token_ids=[stop])
    outs = llm.generate(prompts, params, use_tqdm=False)
    stops = sorted(llm.tokenizer.stop_token_ids | {stop})
    reasons = set()
    for ids, out in zip(prompts, outs):
        expected = reference_beams(ref, ids, stops, num_beams=4, length_penalty=length_penalty,
                                   early_stopping=early_stopping)
        assert [c.token_ids for c in out.outputs] == expected
        reasons |= {c.finish_reason for c in out.outputs}
    if both_reasons:  # both ways a beam ends were exercised (a penalty of 2 favours the long ones)
        assert reasons == {"stop", "length"}
    assert_all_blocks_free(llm)


def test_beam_width_one_is_greedy(tiny):
    llm, _, prompts, _ = tiny
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)
    beams = llm.beam_search(prompts, beam_width=1, max_tokens=MAX_TOKENS, ignore_eos=True, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in beams] == [o.outputs[0].token_ids for o in greedy]


def test_beams_alone_equal_beams_in_a_busy_batch(tiny):
    llm, _, prompts, _ = tiny
    alone = llm.beam_search(prompts[1], beam_width=3, max_tokens=MAX_TOKENS, n=2, use_tqdm=False)[0]
    busy = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True, n=1 + i % 2) for i in range(6)]
    beam = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, beam_width=3)
    outs = llm.generate([prompts[0]] * 3 + [prompts[1]] + [prompts[2]] * 3, [*busy[:3], beam, *busy[3:]],
                        use_tqdm=False)
    assert [c.token_ids for c in outs[3].outputs] == [c.token_ids for c in alone.outputs]
    assert [c.text for c in outs[3].outputs] == [c.text for c in alone.outputs]
    assert_all_blocks_free(llm)


def test_beams_share_the_prompt_blocks_and_abort_frees_them(tiny):
    llm, _, _, _ = tiny
    engine = llm.engine
    bs = engine.config.kv.block_size
    prompt = list(range(1000, 1000 + 3 * bs + 2))  # three full blocks and a partial one
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, beam_width=4, n=4, ignore_eos=True),
                       request_id="beams")
    for _ in range(3):
        engine.step()
    kv = engine.scheduler.kv_cache
    members = engine.scheduler.running
    assert len(members) == 4
    assert len({kv.block_ids(m)[:3] for m in members}) == 1  # the prompt's full blocks, held by all four
    # Nothing copies a prompt: the full prompt blocks once, plus at most each beam's own tail.
    assert kv.num_blocks - kv.num_free_blocks <= 3 + 4
    assert engine.abort("beams")
    engine.step()
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("options, param", [
    (dict(beam_width=0), "beam_width"),
    (dict(beam_width=2, n=3), "n"),
    (dict(beam_width=2, temperature=0.7), "temperature"),
    (dict(beam_width=2, top_k=5), "top_k"),
    (dict(beam_width=2, stop=["."]), "stop"),
    (dict(beam_width=2, logprobs=1), "logprobs"),
    (dict(beam_width=2, early_stopping=1), "early_stopping"),
    (dict(beam_width=2, length_penalty=float("nan")), "length_penalty"),
])
def test_bad_beam_search_params_name_the_parameter(options, param):
    with pytest.raises(ValueError, match=f"^{param}"):
        SamplingParams(**{"temperature": 0, **options})


@pytest.mark.slow
def test_beams_equal_transformers_on_the_shipped_model(hf_model, reference_prompts):
    """SmolLM2-135M in fp32 against transformers' own load of the same GGUF."""
    llm = make_llm(load_model())
    stops = sorted(llm.tokenizer.stop_token_ids)
    prompts = reference_prompts[2:5]
    for length_penalty, early_stopping in [(1.0, False), (2.0, True), (-0.5, "never"), (0.5, False)]:
        outs = llm.beam_search(prompts, beam_width=4, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                               early_stopping=early_stopping, use_tqdm=False)
        for ids, out in zip(prompts, outs):
            assert [c.token_ids for c in out.outputs] == reference_beams(
                hf_model, ids, stops, num_beams=4, length_penalty=length_penalty, early_stopping=early_stopping)
    assert_all_blocks_free(llm)
