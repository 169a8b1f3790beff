"""A parsed OpenAI request checked against the model and the server's flags, and turned
into SamplingParams.

What passes the request models (http/openai_bodies.py) is checked again by
SamplingParams (whose ValueError messages start with the parameter name, which becomes
the error's `param`) and against the model and the server's flags.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from collections.abc import Iterable

from ...http.errors import APIError
from ...http.openai_bodies import MAX_CONSTRAINT_CHARS, ChatCompletionRequest, CompletionRequest, \
    DetokenizeRequest, GenerationBody, TokenizeRequest
from ...sampling_params import SamplingParams
from ...structured_output.spec import StructuredOutputs


_FIELD_NAMES = frozenset(
    name for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
    for name in model.model_fields
) | {"max_model_len", "context_length"}


def bad_request(error: ValueError | str, param: str | None = None) -> APIError:
    """A 400 from a ValueError; `param` defaults to the message's leading field name."""
    message = str(error)
    if param is None:
        match = re.match(r"[A-Za-z_]+", message)
        param = match.group(0) if match and match.group(0) in _FIELD_NAMES else None
    return APIError(400, message, param=param)


# -- sampling --------------------------------------------------------------------------------


def structured_output_param(req: GenerationBody) -> str | None:
    """The one structured-output field the request set (None if none); 400 for several."""
    fields = list(req.structured_output_fields())
    if len(fields) > 1:
        raise APIError(400, f"give at most one structured-output field, got {', '.join(fields)}", param=fields[0])
    return fields[0] if fields else None


def structured_outputs(req: GenerationBody) -> StructuredOutputs | None:
    """The request's output constraint, checked for shape (compiling it is the server's next step)."""
    param = structured_output_param(req)
    if param is None:
        return None
    try:
        spec = StructuredOutputs(**req.structured_output_fields()[param])
    except TypeError:
        raise APIError(400, f"{param} takes only json, regex, choice, grammar and json_object", param=param) from None
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None
    size = len(spec.key[1])
    if size > MAX_CONSTRAINT_CHARS:
        raise APIError(400, f"{param} is {size} characters long; this server compiles at most "
                            f"{MAX_CONSTRAINT_CHARS}", param=param)
    return spec


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_n: int
    max_logprobs: int
    vocab_size: int
    # Longer prompt text cannot fit the context whatever it tokenises to (see `max_prompt_chars`),
    # so it is refused before spending the tokenizer's time on it.
    max_prompt_chars: int


def max_prompt_chars(vocabulary: Iterable[str], max_context_len: int) -> int:
    """Characters of text that could at most fit `max_context_len` tokens: no token covers
    more characters than its vocabulary spelling has (byte-level spellings have one
    character per byte, SentencePiece ones one per character, byte-fallback ones more).
    Characters the tokenizer drops break the bound (SmolLM2's has no token for some
    control bytes): text made almost only of those can be refused though it fits, a
    400 for input no client means to send."""
    return max_context_len * max(map(len, vocabulary), default=1)


def check_prompt_chars(text: str, limits: RequestLimits, max_context_len: int, param: str) -> None:
    if len(text) > limits.max_prompt_chars:
        raise APIError(400, f"{param} has {len(text)} characters, more than any text that fits this model's "
                            f"maximum context length of {max_context_len} tokens ({limits.max_prompt_chars} "
                            "characters at most)", param=param, code="context_length_exceeded")


def sampling_params(req: GenerationBody, limits: RequestLimits, *, max_tokens: int | None,
                    logprobs: int | None, logprobs_param: str, beam: dict | None = None) -> SamplingParams:
    """SamplingParams for a request; every invalid value is a 400 naming its field. `beam`:
    the beam-search fields (beam_search_fields), None for sampling."""
    n = 1 if req.n is None else req.n
    if n > limits.max_n:
        raise APIError(400, f"n must be at most {limits.max_n} on this server, got {n}", param="n")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise APIError(400, f"{logprobs_param} must be at most {limits.max_logprobs} on this server, got {logprobs}",
                       param=logprobs_param)
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    given = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    constraint = structured_outputs(req)
    try:
        params = SamplingParams(
            structured_outputs=constraint, n=n, max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed,
            logit_bias=req.logit_bias, stop=stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
            **{name: value for name, value in given.items() if value is not None}, **(beam or {}),
        )
        params.validate_for_vocab(limits.vocab_size)
        return params
    except ValueError as e:
        raise bad_request(e) from None


def completion_sampling_params(req: CompletionRequest, limits: RequestLimits) -> SamplingParams:
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise APIError(400, "best_of is not supported (it must equal n when given)", param="best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens == 0:
        if not req.echo:
            raise APIError(400, "max_tokens must be >= 1, or 0 with echo (to score the prompt)", param="max_tokens")
        # The engine always samples one token; the server drops it (CompletionServing).
        max_tokens = 1
    params = sampling_params(req, limits, max_tokens=max_tokens, logprobs=req.logprobs, logprobs_param="logprobs",
                             beam=beam_search_fields(req, limits))
    if req.echo and req.logprobs is not None:
        # Echoed prompts carry their tokens' logprobs too, as OpenAI's legacy API did.
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    return params


def beam_search_fields(req: CompletionRequest, limits: RequestLimits) -> dict | None:
    """The SamplingParams fields of a beam search (None without use_beam_search); 400 for
    beam fields without it, for stream, and for a width beyond --max-n."""
    given = {"beam_width": req.beam_width, "length_penalty": req.length_penalty, "early_stopping": req.early_stopping}
    if not req.use_beam_search:
        for name, value in given.items():
            if value is not None:
                raise APIError(400, f"{name} needs use_beam_search: true", param=name)
        return None
    if req.stream:
        raise APIError(400, "stream is not supported with use_beam_search (the beams are ranked once they finish)",
                       param="stream")
    width = req.beam_width if req.beam_width is not None else (req.n or 1)
    if width > limits.max_n:
        raise APIError(400, f"beam_width must be at most {limits.max_n} on this server, got {width}",
                       param="beam_width")
    fields = {name: value for name, value in given.items() if value is not None}
    fields["beam_width"] = width
    if req.temperature is None:
        fields["temperature"] = 0.0  # beams are ranked by log-probability; sampling's default does not apply
    return fields


def chat_sampling_params(req: ChatCompletionRequest, limits: RequestLimits) -> SamplingParams:
    """Params with max_tokens None when the client gave none (the server fills in the room left)."""
    if req.chat_template is not None:
        raise APIError(400, "chat_template is not accepted from requests; the server uses the model's template",
                       param="chat_template")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, limits, max_tokens=max_tokens, logprobs=logprobs, logprobs_param="top_logprobs")
    if req.prompt_logprobs is not None:
        if req.stream:
            # As in vLLM: a streamed reply has no top-level field to carry them.
            raise APIError(400, "prompt_logprobs is not supported with stream", param="prompt_logprobs")
        if req.prompt_logprobs > limits.max_logprobs:
            raise APIError(400, f"prompt_logprobs must be at most {limits.max_logprobs} on this server, got "
                                f"{req.prompt_logprobs}", param="prompt_logprobs")
        params = dataclasses.replace(params, prompt_logprobs=req.prompt_logprobs)
    return params

