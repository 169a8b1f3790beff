"""The offline API: `LLM(...).generate(prompts, params)`, `.chat(messages, params)`, and
`.embed(prompts)` / `.score(text_1, text_2)` on the same engine."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from tqdm.auto import tqdm

from ..engine_config import EngineConfig
from ..multimodal.inputs import ImageInput
from ..outputs import OutputAccumulator, RequestOutput
from ..pooling_params import PoolingParams, cosine_similarity, score_pairs
from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine

Prompt = str | list[int]
Conversation = Sequence[Mapping[str, Any]]


class LLM:
    """Run many prompts through the engine; options mirror the CLI flags
    (block_size, kv_cache_memory, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, enable_chunked_prefill, long_prefill_token_threshold,
    scheduling_policy, policy, ...)."""

    def __init__(self, model: str | None = None, **engine_options: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_name: str | Sequence[str | None] | None = None,
        images: Sequence[ImageInput] | Sequence[Sequence[ImageInput]] = (),
    ) -> list[RequestOutput]:
        """RequestOutputs in the order of `prompts` (a string, token ids, or a list of either).
        `lora_name`: the loaded LoRA adapter to run (one for all prompts, or one per prompt;
        None: the base model). `images` (a vision model: docs/vision.md): the images of a
        single prompt, or one sequence of images per prompt."""
        prompts = _prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        if lora_name is None or isinstance(lora_name, str):
            loras = [lora_name] * len(prompts)
        elif len(lora_name) != len(prompts):
            raise ValueError(f"lora_name has {len(lora_name)} entries for {len(prompts)} prompts")
        else:
            loras = list(lora_name)
        per_prompt = _images_per_prompt(images, len(prompts))
        return self._run([partial(self.engine.add_request, p, sp, lora_name=lora, images=im)
                          for p, sp, lora, im in zip(prompts, params, loras, per_prompt)], use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        beam_width: int,
        max_tokens: int = 16,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        n: int | None = None,
        ignore_eos: bool = False,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Beam search, as transformers' generate(num_beams=beam_width, do_sample=False,
        length_penalty=..., early_stopping=...): per prompt, the best n (default beam_width)
        finished beams, best first."""
        params = SamplingParams(n=beam_width if n is None else n, temperature=0.0, max_tokens=max_tokens,
                                ignore_eos=ignore_eos, beam_width=beam_width, length_penalty=length_penalty,
                                early_stopping=early_stopping)
        return self.generate(prompts, params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt),
                add_special_tokens=False,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_name)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, lora_name: str | None = None) -> list[RequestOutput]:
        """Embed each prompt (a string or token ids): RequestOutputs in order, each with its
        `embedding` (the pooled final hidden state; L2-normalised unless pooling_params says not)."""
        return self._run([partial(self.engine.add_pooling_request, p, pooling_params, lora_name=lora_name)
                          for p in _prompt_list(prompts)], use_tqdm)

    def score(self, text_1: Prompt | Sequence[Prompt], text_2: Prompt | Sequence[Prompt],
              use_tqdm: bool = True, lora_name: str | None = None) -> list[float]:
        """The cosine similarity of each pair's embeddings (one text_1 against every text_2, or
        two equal-length lists pairwise, as vLLM's score for an embedding model)."""
        pairs = score_pairs(text_1, text_2, _is_one_prompt)
        texts = [t for pair in pairs for t in pair]
        vectors = [out.embedding for out in self.embed(texts, use_tqdm=use_tqdm, lora_name=lora_name)]
        return [cosine_similarity(vectors[2 * i], vectors[2 * i + 1]) for i in range(len(pairs))]

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter folder under `name` (needs enable_lora); ValueError if it cannot be."""
        self.engine.add_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def stats(self) -> dict:
        return self.engine.stats()

    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} prompts")
        return list(sampling_params)

    def _run(self, adds: Sequence[Callable[[], str]], use_tqdm: bool) -> list[RequestOutput]:
        """Queue each request (an `add` returns its id), step until all finish; their outputs in order."""
        engine = self.engine
        total = len(adds)
        ids: list[str] = []
        try:
            for add in adds:
                ids.append(add())
        except Exception:
            for rid in ids:
                engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        outputs = OutputAccumulator()
        bar = tqdm(total=total, desc="generating", disable=not use_tqdm or total < 2)
        try:
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    out = outputs.add(delta)
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    engine.abort(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]


def _is_one_prompt(prompt: object) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int))


def _images_per_prompt(images: Sequence[ImageInput] | Sequence[Sequence[ImageInput]], num_prompts: int
                       ) -> list[Sequence[ImageInput]]:
    """One sequence of images per prompt: ImageInputs given flat belong to a single prompt."""
    if not images:
        return [()] * num_prompts
    if all(isinstance(image, ImageInput) for image in images):
        if num_prompts != 1:
            raise ValueError(f"images: give one sequence of images per prompt ({num_prompts} prompts)")
        return [images]
    if len(images) != num_prompts:
        raise ValueError(f"images has {len(images)} entries for {num_prompts} prompts")
    return list(images)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    return [prompts] if _is_one_prompt(prompts) else list(prompts)
