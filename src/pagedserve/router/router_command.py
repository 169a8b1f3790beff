"""`pagedserve router --backend URL...`: the flags, and the app built from them."""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from ..engine_config import parse_memory
from ..http.bounds import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_HEADER_BYTES, limited_http_protocol
from ..http.middleware import API_KEY_ENV
from ..http.tool_parsers import TOOL_PARSERS
from .routing_policies import POLICIES, CacheAwareConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

BACKEND_API_KEY_ENV = "PAGEDSERVE_BACKEND_API_KEY"


def add_replica_router_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas")
    d = CacheAwareConfig()
    g.add_argument("--backend", nargs="+", default=[], metavar="URL", help="replica base URLs (http://host:port)")
    g.add_argument("--policy", choices=POLICIES, default="cache_aware")
    g.add_argument("--model", default=None,
                   help="the replicas' model (for its tokenizer and chat template; default: the embedded SmolLM2)")
    g.add_argument("--tool-call-parser", default="hermes", choices=[*TOOL_PARSERS, "none"],
                   help="as the replicas' --tool-call-parser (it picks the template tool conversations render with)")
    g.add_argument("--cache-load-weight", type=float, default=d.load_weight,
                   help="cache_aware: prompt tokens one in-flight request is worth")
    g.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs,
                   help="cache_aware: go by load when the busiest replica has more than this many requests "
                        "over the idlest ...")
    g.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel,
                   help="... and more than this times its load")
    g.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    g.add_argument("--backend-api-key", default=None, help=f"the replicas' API key (or set {BACKEND_API_KEY_ENV})")


def add_router_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("router server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help=f"require this key from clients (or set {API_KEY_ENV})")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--max-header-size", type=parse_memory, default=DEFAULT_MAX_HEADER_BYTES,
                   help="a request whose header block is above this gets 431, unread (default 64KiB)")
    g.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a connection gets to send a request's headers before 408 (default 15)")


def build_replica_router(args: argparse.Namespace) -> FastAPI:
    """The replica router's app from parsed flags (loads the tokenizer for cache_aware)."""
    from .proxy import RouterConfig, build_router_app
    from .prompt_keys import PromptKeyer

    config = RouterConfig(
        backends=args.backend, policy=args.policy,
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
        backend_api_key=args.backend_api_key if args.backend_api_key is not None
        else os.environ.get(BACKEND_API_KEY_ENV) or None,
        cache=CacheAwareConfig(args.cache_load_weight, args.balance_abs_threshold, args.balance_rel_threshold),
        health_interval_s=args.health_interval,
    )
    keyer = None
    if args.policy == "cache_aware":
        from ..model.sources import load_model_tokenizer

        parser = None if args.tool_call_parser == "none" else args.tool_call_parser
        keyer = PromptKeyer(load_model_tokenizer(args.model), parser)
    return build_router_app(config, keyer)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    if bool(args.backend) == bool(args.prefill or args.decode):
        raise ValueError("router: give either --backend URL... (replicas) or --prefill URL... --decode URL... "
                         "(disaggregated prefill/decode)")
    if args.backend:
        app = build_replica_router(args)
    else:
        from .disagg import disagg_app_from_args

        if args.api_key or args.backend_api_key:
            raise ValueError("api_key: the disaggregated router does not check or forward API keys yet")
        app = disagg_app_from_args(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                http=limited_http_protocol(args.max_header_size, args.header_timeout))
    return 0


def add_router_parser(sub) -> None:
    from .disagg import add_disagg_args

    p = sub.add_parser("router", help="route OpenAI requests across pagedserve replicas (--backend) or through "
                                      "prefill and decode instances (--prefill/--decode)")
    add_router_server_args(p)
    add_replica_router_args(p)
    add_disagg_args(p)
    p.set_defaults(func=cmd_router)
