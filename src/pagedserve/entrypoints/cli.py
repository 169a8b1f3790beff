"""`pagedserve generate` and `pagedserve chat`."""
from __future__ import annotations

import argparse
import json
import logging
import secrets
import sys

from ..engine_config import EngineConfig

DEFAULT_PROMPT = "The three most important ideas behind fast LLM serving are"


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (--seed seeds the engine)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)


def _sampling_params(args: argparse.Namespace):
    from ..sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from ..engine.llm import LLM

    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    config = EngineConfig.from_cli_args(args)
    llm = LLM(**config.describe())
    outputs = llm.generate(prompts, _sampling_params(args), use_tqdm=not args.json)
    for out in outputs:
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason}))
            else:
                print(f"{out.prompt}\033[1m{c.text}\033[0m  [{c.finish_reason}]")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from ..engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_cli_args(args))
    params = _sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Type a message; Ctrl-D or /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        rid = engine.add_request(engine.tokenizer.encode(prompt, add_special_tokens=False), params)
        reply = ""
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if delta.request_id == rid:
                    text = "".join(sample.text for sample in delta.samples)
                    reply += text
                    print(text, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .openai.args import server_config_from_args
    from .openai.server import run_server

    return run_server(server_config_from_args(args))


def cmd_keys(args: argparse.Namespace) -> int:
    """`keys hash`: each key on stdin (never argv, which process lists show) -> its sha256 for
    the keys file; `keys new`: a fresh key and its entry."""
    from ..http.tenant_keys import hash_key

    if args.action == "new":
        key = "sk-" + secrets.token_urlsafe(32)
        print(f"key (give it to the tenant; the file keeps only its hash): {key}")
        print(f'keys-file entry: - {{tenant: {args.tenant}, key_sha256: "{hash_key(key)}"}}')
        return 0
    for line in sys.stdin:
        if line.strip():
            print(hash_key(line.strip()))
    return 0


def cmd_serve_ray(args: argparse.Namespace) -> int:
    from .ray_serve.app import cmd_serve_ray  # here: ray is the `ray` extra's

    return cmd_serve_ray(args)


def cmd_worker(args: argparse.Namespace) -> int:
    from ..distributed.worker import run_node

    return run_node(EngineConfig.from_cli_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="An LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts (offline)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a built-in demo prompt")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--json", action="store_true", help="print one JSON object per completion")
    EngineConfig.add_cli_args(gen)
    _add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat interactively, streaming replies")
    chat.add_argument("--system", help="a system message")
    EngineConfig.add_cli_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)

    from .openai.args import add_server_args

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)

    from .openai.run_batch import add_run_batch_parser  # argparse only; the engine loads inside the command

    add_run_batch_parser(sub)

    keys = sub.add_parser("keys", help="API keys for --api-keys: 'hash' the keys on stdin, or make a 'new' one")
    keys.add_argument("action", choices=["hash", "new"])
    keys.add_argument("--tenant", default="TENANT", help="the tenant a new key's entry names")
    keys.set_defaults(func=cmd_keys)

    serve_ray = sub.add_parser("serve-ray", help="serve engine replicas on a Ray cluster with Ray Serve, behind one "
                                                 "ingress and the cache-aware router (docs/scale-out.md)")
    serve_ray.add_argument("config", help="the app's YAML file: engine, server, replicas, router and http sections "
                                          "(entrypoints/ray_serve/settings.py)")
    serve_ray.set_defaults(func=cmd_serve_ray)

    worker = sub.add_parser("worker", help="run this node's tensor-parallel ranks for an engine on node 0 "
                                           "(--nnodes, --node-rank, --distributed-init-method)")
    EngineConfig.add_cli_args(worker)
    worker.set_defaults(func=cmd_worker)

    from ..router.router_command import add_router_parser  # argparse only; the web stack loads inside the command

    add_router_parser(sub)

    from ..sim.sim_commands import add_doctor_parser, add_kv_parser, add_sim_parser  # pure Python, no torch
    from .ray_serve.sim_cli import add_ray_config_arg  # the app's YAML for `sim cluster`; never ray

    add_ray_config_arg(add_sim_parser(sub))
    add_kv_parser(sub)
    add_doctor_parser(sub)

    from ..bench.bench_commands import add_bench_parser  # argparse only; aiohttp / torch load inside the commands

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
