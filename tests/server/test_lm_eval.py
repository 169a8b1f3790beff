"""EleutherAI's lm-evaluation-harness against a live server on the fp32 path
(`--quantization none`) scores what `lm-eval --model hf` scores on the same GGUF
(transformers, float32).

The reference tokenizes with the model's own tokenizer (pagedserve's, saved in Hugging
Face's layout and loaded by transformers): transformers' GGUF conversion skips SmolLM's
digit split and cuts a whitespace run before a digit differently (test_tokenizer.py), so
on the license passage it would score different tokens, not the same ones differently.

The tasks are in tests/data/lm_eval/ (YAML + JSON lines, no hub): a multiple-choice task
and a perplexity task through `local-completions` (prompts as token lists, echo with
logprobs, max_tokens 1, the server's tokenizer found through /tokenizer_info), and a
generate-until task through `local-chat-completions` with the model's chat template.
Beyond the aggregate scores, every document's loglikelihood and every generated text is
compared with the reference's.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

# Read by `datasets` and `huggingface_hub` when they are imported: nothing may come from the hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
import pytest  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import check_remote_tokenizer_support  # noqa: E402
import transformers  # noqa: E402

from pagedserve.model.tokenizer import load_tokenizer  # noqa: E402

from .server_process import SMALL_SERVER_FLAGS  # noqa: E402

TASKS_DIR = Path(__file__).parents[1] / "data" / "lm_eval"
LOGLIKELIHOOD_TASKS = ["pagedserve_mc", "pagedserve_ppl"]
GENERATE_TASK = "pagedserve_gen"
# Per scored token: the server's logits are within 1e-3 of the reference's
# (test_model_reference.py) and a log-softmax subtracts one logsumexp, so each token's
# logprob is within 2e-3; a continuation's sum within 2e-3 times its length.
LOGPROB_ATOL = 2e-3
SERVER_MAX_LENGTH = int(SMALL_SERVER_FLAGS[SMALL_SERVER_FLAGS.index("--max-model-len") + 1])
# lm-eval's API models keep a token for generation and one for context, so their rolling
# windows are max_length - 2 tokens long; HFLM's are max_length. This makes them the same.
HF_MAX_LENGTH = SERVER_MAX_LENGTH - 2


def _evaluate(model, tasks: list[str], task_manager: TaskManager, **options) -> dict:
    return lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=task_manager, log_samples=True,
                                   bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   **options)


@pytest.fixture(scope="module")
def task_manager() -> TaskManager:
    return TaskManager(include_path=str(TASKS_DIR))


@pytest.fixture(scope="module")
def reference_tokenizer(tmp_path_factory, gguf_path):
    directory = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(gguf_path).save(directory)
    return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def hf_lm(hf_model, reference_tokenizer) -> HFLM:
    return HFLM(pretrained=hf_model, tokenizer=reference_tokenizer, batch_size=16, max_length=HF_MAX_LENGTH)


def _scores(out: dict, task: str) -> dict[str, float]:
    return {name: value for name, value in out["results"][task].items()
            if isinstance(value, float) and "stderr" not in name}


def _loglikelihoods(out: dict, task: str) -> list[list[float]]:
    """Per document, the loglikelihood of each request (each choice; each passage)."""
    return [[resp[0] if isinstance(resp, (list, tuple)) else resp for resp in sample["filtered_resps"]]
            for sample in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


def _check_loglikelihood_task(ours: dict, ref: dict, task: str, scored_texts, tokenizer) -> list[list[float]]:
    """Every request's loglikelihood within the bound for its scored tokens; the bounds."""
    texts = [scored_texts(s) for s in sorted(ref["samples"][task], key=lambda s: s["doc_id"])]
    bounds = []
    for doc, (mine, theirs, scored) in enumerate(zip(_loglikelihoods(ours, task), _loglikelihoods(ref, task), texts)):
        assert len(mine) == len(theirs) == len(scored)
        bounds.append([LOGPROB_ATOL * len(tokenizer(text)["input_ids"]) for text in scored])
        for a, b, text, bound in zip(mine, theirs, scored, bounds[-1]):
            assert abs(a - b) <= bound, (task, doc, text[:40], a, b, bound)
    return bounds


def test_local_completions_scores_equal_the_hf_reference(fp32_server, model, task_manager, hf_lm, reference_tokenizer):
    # The defaults a user would give: the harness finds the server's tokenizer itself.
    ours = _evaluate("local-completions", LOGLIKELIHOOD_TASKS, task_manager, batch_size=4, model_args={
        "model": model, "base_url": fp32_server.url + "/v1/completions", "max_length": SERVER_MAX_LENGTH,
        "num_concurrent": 3})
    ref = _evaluate(hf_lm, LOGLIKELIHOOD_TASKS, task_manager)
    assert ours["config"]["model"] == "local-completions"

    bounds = _check_loglikelihood_task(ours, ref, "pagedserve_mc", lambda s: [" " + c for c in s["doc"]["choices"]],
                                       reference_tokenizer)
    # No question's best two choices are within their bounds of a tie (for acc, and for
    # acc_norm's loglikelihood per character), so both sides pick the same answers and the
    # scores must agree exactly.
    samples = sorted(ref["samples"]["pagedserve_mc"], key=lambda s: s["doc_id"])
    for lls, bound, sample in zip(_loglikelihoods(ref, "pagedserve_mc"), bounds, samples):
        for scale in ([1.0] * len(lls), [1 / len(c) for c in sample["doc"]["choices"]]):
            scores = [ll * k for ll, k in zip(lls, scale)]
            first, second = sorted(range(len(scores)), key=lambda i: -scores[i])[:2]
            assert scores[first] - scores[second] > bound[first] * scale[first] + bound[second] * scale[second]
    assert _scores(ours, "pagedserve_mc") == _scores(ref, "pagedserve_mc")

    _check_loglikelihood_task(ours, ref, "pagedserve_ppl", lambda s: [s["doc"]["text"]], reference_tokenizer)
    # Each metric moves by at most exp(summed logprob bound / words) - 1 relative: word
    # perplexity by exactly that, byte perplexity and bits per byte by less (more bytes
    # than words; over a nat of loss per word).
    docs = [s["doc"]["text"] for s in ref["samples"]["pagedserve_ppl"]]
    tokens = sum(len(reference_tokenizer(d)["input_ids"]) for d in docs)
    words = sum(len(d.split()) for d in docs)
    rel = math.expm1(LOGPROB_ATOL * tokens / words)
    ppl_ours, ppl_ref = _scores(ours, "pagedserve_ppl"), _scores(ref, "pagedserve_ppl")
    assert ppl_ours.keys() == ppl_ref.keys() == {"word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"}
    for name, value in ppl_ref.items():
        assert ppl_ours[name] == pytest.approx(value, rel=rel), name
    print("\nlm-eval scores, pagedserve vs hf:",
          {task: (_scores(ours, task), _scores(ref, task)) for task in LOGLIKELIHOOD_TASKS})


def test_local_chat_completions_generates_what_hf_generates(fp32_server, model, task_manager, hf_lm):
    ours = _evaluate("local-chat-completions", [GENERATE_TASK], task_manager, apply_chat_template=True, model_args={
        "model": model, "base_url": fp32_server.url + "/v1/chat/completions", "num_concurrent": 4})
    ref = _evaluate(hf_lm, [GENERATE_TASK], task_manager, apply_chat_template=True)

    def replies(out: dict) -> list[str]:
        return [s["resps"][0][0] for s in sorted(out["samples"][GENERATE_TASK], key=lambda s: s["doc_id"])]

    assert all(replies(ref)) and replies(ours) == replies(ref)
    assert _scores(ours, GENERATE_TASK) == _scores(ref, GENERATE_TASK)
    print("\nlm-eval scores, pagedserve vs hf:", _scores(ours, GENERATE_TASK), _scores(ref, GENERATE_TASK))


def test_the_harness_finds_the_servers_tokenizer(server, http, model):
    """Without /tokenizer_info, local-completions falls back to downloading a tokenizer
    named after the model from the hub (and fails offline)."""
    info = http.get("/tokenizer_info").json()
    assert info["bos_token"] == "<|im_start|>" and info["eos_token"] == "<|im_end|>"
    assert info["model_max_length"] == SERVER_MAX_LENGTH and info["chat_template"].startswith("{% for message")
    assert check_remote_tokenizer_support(server.url + "/v1/completions")
    lm = LocalCompletionsAPI(model=model, base_url=server.url + "/v1/completions")
    assert lm.tokenizer_backend == "remote"
    assert (lm.eot_token_id, lm.prefix_token_id) == (2, 1)
    text = "Hello world\n\n   1. Definitions."
    assert lm.tok_encode(text) == http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
