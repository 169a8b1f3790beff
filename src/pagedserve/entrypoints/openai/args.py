"""`pagedserve serve` options: the server's own flags plus every EngineConfig flag.

Kept free of web-framework imports so building the CLI parser stays cheap.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from ...engine_config import EngineConfig, parse_memory
from ...http.bounds import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_HEADER_BYTES
from ...http.chat_images import DEFAULT_IMAGES_PER_PROMPT, ImagePolicy, check_mm_limits, parse_mm_limits
from ...http.media_fetch import normalize_domains
from ...http.middleware import API_KEY_ENV
from ...http.reasoning_parsers import REASONING_PARSERS, ReasoningFormat, detect_reasoning_parser
from ...http.tool_parsers import TOOL_PARSERS
from ...sampling_params import MAX_LOGPROBS


@dataclass
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] | None = None  # default: the model's own name
    api_key: str | None = field(default=None, repr=False)
    api_keys: str | None = None  # a keys file: tenants with budgets (http/tenant_keys.py)
    allowed_origins: list[str] = field(default_factory=list)  # CORS off when empty
    max_queued_requests: int = 512
    max_n: int = 16
    max_logprobs: int = MAX_LOGPROBS
    max_request_body_size: int = 4 << 20
    max_header_size: int = DEFAULT_MAX_HEADER_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    shutdown_timeout: float = 30.0
    uvicorn_log_level: str = "info"
    tool_call_parser: str | None = "hermes"  # None: requests with tools get a 400
    reasoning_parser: str | None = "auto"  # auto: what the chat template writes; None: replies are not split
    disable_uvicorn_access_log: bool = False
    dashboard: bool = True
    dashboard_show_prompts: bool = False
    # Images per prompt ({"image": n}) and the hosts image URLs may name (docs/images.md).
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": DEFAULT_IMAGES_PER_PROMPT})
    allowed_media_domains: list[str] = field(default_factory=list)
    data_dir: str | None = None  # files and batches (docs/batches.md); None: the batch routes answer 400
    max_batch_file_size: int = 200 << 20
    batch_storage_quota: int | None = None  # bytes of files a tenant (or, without tenants, the server) keeps
    batch_concurrency: int = 4  # batch lines in flight at once
    # Several models in one server (docs/multi-model.md): name -> path, and/or a folder of them.
    models: dict[str, str] = field(default_factory=dict)
    models_dir: str | None = None
    models_config: str | None = None  # a YAML file: per-model engine options and aliases
    max_loaded_models: int | None = None  # None: no bound
    model_load_timeout: float = 120.0  # how long a request waits for its model to load before a 503

    @property
    def multi_model(self) -> bool:
        return bool(self.models) or self.models_dir is not None or self.models_config is not None

    def __post_init__(self) -> None:
        check_mm_limits(self.limit_mm_per_prompt)
        normalize_domains(self.allowed_media_domains)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_queued_requests", "max_n", "max_request_body_size", "max_header_size", "max_batch_file_size",
                     "batch_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        if not self.header_timeout > 0:
            raise ValueError(f"header_timeout must be > 0 seconds, got {self.header_timeout}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {list(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in (*REASONING_PARSERS, "auto"):
            raise ValueError(f"reasoning_parser must be one of {[*REASONING_PARSERS, 'auto']} or None, "
                             f"got {self.reasoning_parser!r}")
        if self.batch_storage_quota is not None and self.batch_storage_quota < 1:
            raise ValueError(f"batch_storage_quota must be >= 1 byte, got {self.batch_storage_quota}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")
        self._check_multi_model()
        if self.api_key is not None and self.api_keys is not None:
            raise ValueError(f"--api-key (or {API_KEY_ENV}) and --api-keys do not go together: list the key in the "
                             "keys file under a tenant")

    def image_policy(self) -> ImagePolicy:
        return ImagePolicy(max_images=self.limit_mm_per_prompt.get("image", DEFAULT_IMAGES_PER_PROMPT),
                           allowed_domains=normalize_domains(self.allowed_media_domains))

    def _check_multi_model(self) -> None:
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be >= 1, got {self.max_loaded_models}")
        if not self.model_load_timeout > 0:
            raise ValueError(f"model_load_timeout must be > 0 seconds, got {self.model_load_timeout}")
        if not self.multi_model:
            if self.max_loaded_models is not None:
                raise ValueError("max_loaded_models needs several models (--model NAME=PATH, --models-dir or --models-config)")
            return
        clashes = {"model": self.engine.model, "served_model_name": self.served_model_name, "api_keys": self.api_keys}
        for name, value in clashes.items():
            if value is not None:
                raise ValueError(f"{name} does not go with several models (--model NAME=PATH or --models-dir): "
                                 "each model is served under its own name")

    def describe(self) -> dict:
        """The effective configuration, safe to print: the API key is never shown."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("engine", "api_key")}
        out["api_key"] = "<set>" if self.api_key else None
        out["engine"] = self.engine.describe()
        return out


def add_server_args(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; responses carry the first (default: the model's name)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (or set {API_KEY_ENV})")
    g.add_argument("--api-keys", metavar="FILE", default=None,
                   help="a YAML/JSON file of tenants (priority, rpm, tpm, max_concurrency) and their keys' sha256; "
                        "SIGHUP reloads it (docs/tenants.md)")
    g.add_argument("--allowed-origins", nargs="+", default=[], help="CORS origins to allow (default: CORS off)")
    g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="answer 429 once this many requests wait for the engine")
    g.add_argument("--max-n", type=int, default=d.max_n, help="largest n a request may ask for")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs, help="largest logprobs / top_logprobs")
    g.add_argument("--max-request-body-size", type=parse_memory, default=d.max_request_body_size,
                   help="bodies above this get 413 (default 4MiB)")
    g.add_argument("--max-header-size", type=parse_memory, default=d.max_header_size,
                   help="a request whose header block is above this gets 431, unread (default 64KiB)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help="seconds a connection gets to send a request's headers before 408 (default 15)")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    g.add_argument("--uvicorn-log-level", default=d.uvicorn_log_level,
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--tool-call-parser", default=d.tool_call_parser, choices=[*TOOL_PARSERS, "none"],
                   help="how models write tool calls, for tools / tool_choice (default hermes: <tool_call> JSON); "
                        "'none' refuses requests with tools")
    g.add_argument("--reasoning-parser", default=d.reasoning_parser, choices=[*REASONING_PARSERS, "auto", "none"],
                   help="how a reasoning model marks its thinking, split out of replies as reasoning_content "
                        "(default auto: deepseek_r1 or qwen3 when the chat template writes <think>, gpt_oss for "
                        "harmony channels, else none); 'none' leaves replies whole (docs/reasoning.md)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="do not log one line per HTTP request")
    g.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                   help="do not serve the live engine page at /dashboard")
    g.add_argument("--dashboard-show-prompts", action="store_true",
                   help="show the start of each request's prompt on /dashboard (off: ids and token counts only)")
    g.add_argument("--limit-mm-per-prompt", type=_mm_limits, default=d.limit_mm_per_prompt,
                   help=f"images one prompt may hold, as image=N or JSON {{\"image\": N}} (default "
                        f"{DEFAULT_IMAGES_PER_PROMPT}; docs/images.md)")
    g.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="hosts whose http(s) image URLs the server fetches (default: none, only data: URLs); a "
                        "name resolving to a private or loopback address is refused unless listed as that IP")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every GGUF file and model folder in DIR, each named by its file or folder stem "
                        "(docs/multi-model.md)")
    g.add_argument("--models-config", default=None, metavar="FILE",
                   help="a YAML file of models: each one's path, aliases and engine options (docs/multi-model.md)")
    g.add_argument("--max-loaded-models", type=int, default=None,
                   help="with several models: at most this many loaded, the least recently used idle one "
                        "unloaded to make room (default: no bound)")
    g.add_argument("--model-load-timeout", type=float, default=d.model_load_timeout,
                   help="with several models: seconds a request waits for its model to load before a 503 "
                        "with Retry-After")
    _add_batch_args(parser, d)
    EngineConfig.add_cli_args(parser)
    # EngineConfig's --model takes one path; NAME=PATH forms (repeatable) name the models of a multi-model server.
    next(a for a in parser._actions if a.dest == "model").__class__ = _ModelFlag
    parser.set_defaults(named_models=None)


class _ModelFlag(argparse.Action):
    """--model PATH (the one model), or --model NAME=PATH, repeatable (several models)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: object,
                 option_string: str | None = None) -> None:
        text = str(value)
        name, sep, path = text.partition("=")
        if sep and name and path and not Path(text).exists():
            namespace.named_models = [*(namespace.named_models or []), (name, path)]
        else:
            setattr(namespace, self.dest, value)


def named_models(pairs: list[tuple[str, str]] | None) -> dict[str, str]:
    """The --model NAME=PATH pairs as name -> path; ValueError for a name given twice."""
    models: dict[str, str] = {}
    for name, path in pairs or []:
        if name in models:
            raise ValueError(f"model name {name!r} is given twice (--model {name}=...)")
        models[name] = path
    return models


def _mm_limits(text: str) -> dict[str, int]:
    try:
        return parse_mm_limits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_batch_args(parser: argparse.ArgumentParser, d: ServerConfig) -> None:
    g = parser.add_argument_group("batch jobs (docs/batches.md)")
    g.add_argument("--data-dir", metavar="DIR", default=None,
                   help="keep uploaded files and batch jobs here (SQLite and the files' bodies); a restart with the "
                        "same DIR resumes unfinished batches. Without it /v1/files and the batch routes answer 400")
    g.add_argument("--max-batch-file-size", type=parse_memory, default=d.max_batch_file_size,
                   help="largest file /v1/files takes, enforced while it uploads (default 200MiB)")
    g.add_argument("--batch-storage-quota", type=parse_memory, default=None,
                   help="bytes of stored files (uploads and outputs) each tenant may keep; without --api-keys the "
                        "whole server's (default: unlimited)")
    g.add_argument("--batch-concurrency", type=int, default=d.batch_concurrency,
                   help="batch lines in flight at once, at the lowest priority and outside --max-queued-requests "
                        "(default 4)")


def server_reasoning_parser(name: str | None, chat_template: str | None) -> ReasoningFormat | None:
    """The reasoning format a server splits replies with: the one named, or for "auto"
    the one the model's chat template writes (None: replies are left whole)."""
    if name == "auto":
        return detect_reasoning_parser(chat_template)
    return None if name is None else REASONING_PARSERS[name]


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    # Every other field's flag has the field's name as its dest and takes its value as given.
    derived = {
        "engine": EngineConfig.from_cli_args(args),
        "api_key": args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
        "tool_call_parser": None if args.tool_call_parser == "none" else args.tool_call_parser,
        "reasoning_parser": None if args.reasoning_parser == "none" else args.reasoning_parser,
        "models": named_models(args.named_models),
    }
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if f.name not in derived}
    return ServerConfig(**given, **derived)
