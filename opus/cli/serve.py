"""``opus serve RUN_DIR|EXPORT_DIR``: the run's model behind an OpenAI-compatible HTTP server.

opus.cli.main only registers this; the server (FastAPI, uvicorn, torch) is imported when it runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from opus.errors import EXIT_OK, InputError, OpusError
from opus.serve.guard import DEFAULT_MAX_BODY_BYTES


def add_parsers(sub: Any) -> None:
    serve = sub.add_parser(
        "serve", help="serve a run's (or an export's) model: OpenAI-compatible API, continuous batching",
        description="Serves exactly what the run chose (its kernels, fused graph, KV cache choice and compiled "
                    "decode steps) at /v1/completions and /v1/chat/completions (stream: true for server-sent "
                    "events), /v1/models, /health and Prometheus /metrics. Ctrl-C or SIGTERM lets running requests "
                    "finish, then exits 0. The directory is only read.")
    serve.add_argument("path", type=Path, help="a run directory (its last export, else its final checkpoint) or an "
                                               "export directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch", type=int, default=32, help="requests decoded together (default 32)")
    serve.add_argument("--kv-budget-mb", type=float, help="memory for the KV block pool (default: the run's "
                                                          "kv_config budget)")
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    serve.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429 (default 256)")
    serve.add_argument("--prefill-chunk", type=int, default=512, help="most prompt tokens of one request a step "
                                                                        "computes (default 512)")
    serve.add_argument("--step-tokens", type=int, help="tokens one step computes: a token for each request being "
                                                       "decoded, the rest on prompt chunks (default: max(512, 2 × "
                                                       "max batch))")
    serve.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    serve.add_argument("--name", help="the model id clients use (default: the directory's name)")
    serve.add_argument("--chat-template", type=Path, help="a Jinja chat template, for a tokenizer without one")
    mode = serve.add_mutually_exclusive_group()
    mode.add_argument("--eager", action="store_true", help="run decode steps eagerly, whatever the run chose")
    mode.add_argument("--compile", action="store_true", help="compile decode steps, whatever the run chose")
    serve.add_argument("--no-prefix-cache", action="store_true", help="do not share blocks of common prompt prefixes")
    serve.add_argument("--api-key", default=os.environ.get("OPUS_API_KEY") or None,
                       help="every route but /health then needs 'Authorization: Bearer KEY' (default: $OPUS_API_KEY; "
                            "none: anyone who reaches the port may use the model)")
    serve.add_argument("--max-body-kb", type=int, default=DEFAULT_MAX_BODY_BYTES // 1024,
                       help=f"largest request body accepted (default {DEFAULT_MAX_BODY_BYTES // 1024}); "
                            "max_tokens is bounded by the model's context")
    serve.add_argument("--trust-code", action="store_true",
                       help="let the run or export name code to run (a model factory, a module that is not Opus's "
                            "own), from installed packages only; without it such a directory is refused")


def _settings(args: argparse.Namespace) -> Any:
    from opus.serve.loader import ServeSettings

    for name in ("max_batch", "block_size", "max_waiting", "prefill_chunk", "max_body_kb"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.step_tokens is not None and args.step_tokens <= args.max_batch:
        raise InputError(f"--step-tokens must exceed --max-batch ({args.max_batch}): a full batch's decode step "
                         f"would leave no token for a prompt, got {args.step_tokens}")
    if args.kv_budget_mb is not None and args.kv_budget_mb <= 0:
        raise InputError(f"--kv-budget-mb must be positive, got {args.kv_budget_mb}")
    return ServeSettings(max_batch=args.max_batch, kv_budget_mb=args.kv_budget_mb, block_size=args.block_size,
                         max_waiting=args.max_waiting, prefill_chunk=args.prefill_chunk,
                         step_tokens=args.step_tokens,
                         compile=True if args.compile else False if args.eager else None,
                         prefix_caching=not args.no_prefix_cache)


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_port(host: str, port: int) -> None:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise InputError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


def cmd_serve(args: argparse.Namespace) -> int:
    if not args.path.is_dir():
        raise InputError("no such directory", file=str(args.path))
    template = None
    if args.chat_template is not None:
        if not args.chat_template.is_file():
            raise InputError("no such chat template file", file=str(args.chat_template))
        template = args.chat_template.read_text()
    settings = _settings(args)
    _check_port(args.host, args.port)  # before minutes of loading and compiling, not after
    if not args.api_key and not _loopback(args.host):
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach port {args.port} can use "
              "the model (and its memory and cores); set --api-key or OPUS_API_KEY, or bind 127.0.0.1",
              file=sys.stderr, flush=True)
    import torch
    import uvicorn

    from opus.serve.app import create_app
    from opus.serve.guard import Guard
    from opus.serve.loader import load_served

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    served = load_served(args.path, settings, args.name, trust_code=args.trust_code)
    print(f"loaded {served.describe()}", flush=True)
    engine = served.engine
    if engine.steps.compiled:
        engine.steps.warm_up(settings.block_size, lambda i, b: print(
            f"compiling the decode step for batch {b} ({i + 1}/{len(engine.steps.buckets)})", flush=True))
        for note in engine.steps.notes:
            print(f"warning: {note}", file=sys.stderr, flush=True)
    engine.start(args.threads)
    print(f"serving {args.path} as {served.name!r} at http://{args.host}:{args.port}/v1 "
          f"(ready in {time.perf_counter() - started:.0f} s)", flush=True)
    # uvicorn takes SIGINT/SIGTERM while it runs (stop accepting, let running responses end) and re-raises
    # them when it is done: by then the shutdown is complete, so they must not turn into an error exit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    app = Guard(create_app(served, template), args.api_key, args.max_body_kb * 1024)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=None)
    server = uvicorn.Server(config)
    server.run()
    if engine.error is not None:
        raise OpusError(f"the engine failed: {engine.error!r}")
    if not server.started:
        raise OpusError(f"could not listen on {args.host}:{args.port}")
    print("stopped: every request answered", flush=True)
    return EXIT_OK


COMMANDS = {"serve": cmd_serve}
