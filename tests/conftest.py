"""Shared fixtures. The transformers reference model and tokenizer load once per session."""
from __future__ import annotations

import os

import pytest

# Triton reads this when its kernels are first imported, and whichever test imports them
# first decides for the whole session: without a GPU the interpreter is the only place they
# run, so the session starts with it on (tests/test_triton_attention.py, the gpu_check driver).
os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedserve.model.registry import default_model_path


def pytest_terminal_summary(terminalreporter):
    """One line saying which native instruction-set paths this run exercised, so a green
    run on an AVX2-only machine says it proved nothing about the AVX-512 paths."""
    from pagedserve.kernels import ISA_FLAGS, cpu_flags, cpu_model_name, native_paths, native_unavailable_reason

    flags = cpu_flags()
    have = [f for f in ISA_FLAGS if f in flags]
    lacks = [f for f in ISA_FLAGS if f not in flags]
    write = terminalreporter.write_line
    write(f"CPU: {cpu_model_name()}; has {' '.join(have)}" + (f"; lacks {' '.join(lacks)}" if lacks else ""))
    reason = native_unavailable_reason()
    if reason is not None:
        write(f"native paths exercised: none ({reason})")
        return
    paths = native_paths()
    skipped = [p for p in paths.available if p not in paths.taken]
    missing = [p for p in paths.all if p not in paths.available]
    write("native paths exercised: " + (", ".join(paths.taken) or "none")
          + (f"; available here, not exercised: {', '.join(skipped)}" if skipped else "")
          + f"; not available on this CPU: {', '.join(missing) or 'none'}")


@pytest.fixture
def threads(request):
    """Run the test with request.param torch threads (parametrize it indirectly), restoring the count after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ray_test_cluster():
    """One real two-node Ray cluster (tests/ray_cluster.py) for every module that needs one:
    each start and stop costs ~15 s of the default run."""
    from ray_cluster import ray_cluster

    with ray_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="session")
def gguf_file(gguf_path):
    from pagedserve.model.gguf_file import GGUFFile

    return GGUFFile(gguf_path)


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    """The reference tokenizer: transformers' own GGUF conversion."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """The reference model (float32), loaded from the same GGUF by transformers."""
    import torch
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.eval()
    return model


# The held-in prompts, in a module of their own so scripts without pytest read them too.
from reference_prompts import REFERENCE_NEW_TOKENS, REFERENCE_TEXTS  # noqa: E402,F401


@pytest.fixture(scope="session")
def reference_prompts(hf_tokenizer) -> list[list[int]]:
    """Token-id prompts from 1 to 300 tokens."""
    ids = [hf_tokenizer(t)["input_ids"] for t in REFERENCE_TEXTS]
    ids.append([ids[4][i % len(ids[4])] for i in range(300)])
    ids.insert(0, [hf_tokenizer.eos_token_id])
    return ids


@pytest.fixture(scope="session")
def reference_greedy(hf_model, hf_tokenizer, reference_prompts) -> list[list[int]]:
    """The reference's greedy continuations (it stops after EOS)."""
    import torch

    out = []
    with torch.inference_mode():
        for ids in reference_prompts:
            gen = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=REFERENCE_NEW_TOKENS, do_sample=False,
                pad_token_id=hf_tokenizer.eos_token_id,
            )
            out.append(gen[0, len(ids):].tolist())
    return out
