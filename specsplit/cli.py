"""`specsplit` command line: generate / info / health against a running target service, and dispatch to
the tools that live in other packages (make-tiny-model, serve-draft, serve-target, demo)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from specsplit._channel import TLSConfig
from specsplit.client import Client, Delta, GenerateOptions, GenerateResult, ResultBuilder
from specsplit.errors import APIError, SpecSplitError, UnavailableError

# Subcommands owned by other packages: imported only when asked for (they pull in torch).
DISPATCH = {
    "make-tiny-model": ("common.tiny", "make a tiny random checkpoint for tests and demos"),
    "serve-draft": ("draft_service.__main__", "run the draft service"),
    "serve-target": ("target_service.__main__", "run the target service"),
    "train-draft": ("common.training.train_draft", "distil a draft (layers + Markov head) for a target"),
    "demo": ("specsplit.demo", "run both services on CPU with tiny models and stream a generation"),
}

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="HOST:PORT or dns:///NAME:PORT of the target service")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    parser.add_argument("--tls", action="store_true", help="use TLS (system roots unless --ca-cert)")
    parser.add_argument("--ca-cert", help="PEM CA certificate of the server (implies --tls)")
    parser.add_argument("--client-cert", help="PEM client certificate for mTLS (implies --tls)")
    parser.add_argument("--client-key", help="PEM key of --client-cert")
    parser.add_argument("--server-name", help="name to check the server certificate against")
    parser.add_argument(
        "--auth-token-file", help="file holding the bearer token (default: $SPECSPLIT_AUTH_TOKEN when set)"
    )


def _add_generate_flags(parser: argparse.ArgumentParser, prompt_flags: bool = True) -> None:
    if prompt_flags:
        prompt = parser.add_mutually_exclusive_group(required=True)
        prompt.add_argument("--prompt", help="prompt text (the target needs a tokenizer)")
        prompt.add_argument("--token-ids", help="prompt token ids, comma or space separated")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 is no top-k truncation")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus truncation in (0, 1]; default off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop-token-ids", default="", help="comma or space separated token ids")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="default: the server's")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--request-id", default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end, no stream")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specsplit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = sub.add_parser("generate", help="stream a generation to the terminal")
    _add_connection_flags(generate)
    _add_generate_flags(generate)
    chat = sub.add_parser(
        "chat",
        help="chat with the target model (its chat template); one turn per --message, else read stdin",
    )
    _add_connection_flags(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument(
        "-m", "--message", action="append", default=[], help="user message (repeatable: one turn each)"
    )
    _add_generate_flags(chat, prompt_flags=False)
    info = sub.add_parser("info", help="print the served models and limits")
    _add_connection_flags(info)
    info.add_argument("--json", action="store_true")
    health = sub.add_parser("health", help="grpc.health.v1 status; exit 0 only when SERVING")
    _add_connection_flags(health)
    health.add_argument("--service", default="specsplit.v1.TargetService", help='"" for the whole server')
    for name, (_, help_text) in DISPATCH.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


class UsageError(Exception):
    """A flag value argparse could not check; printed as one line, exit code 2."""


def parse_ids(flag: str, text: str) -> list[int]:
    try:
        return [int(tok) for tok in text.replace(",", " ").split()]
    except ValueError:
        raise UsageError(f"{flag}: expected integers separated by commas or spaces, got {text!r}") from None


def _client(args: argparse.Namespace) -> Client:
    tls: TLSConfig | None = None
    if args.tls or args.ca_cert or args.client_cert or args.client_key:
        tls = TLSConfig.from_files(args.ca_cert, args.client_cert, args.client_key, args.server_name)
    token = os.environ.get("SPECSPLIT_AUTH_TOKEN")
    if args.auth_token_file:
        with open(args.auth_token_file) as f:
            token = f.read().strip()
    return Client(args.target, timeout=args.timeout, tls=tls, auth_token=token)


def _generate_options(args: argparse.Namespace) -> GenerateOptions:
    return GenerateOptions(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=parse_ids("--stop-token-ids", args.stop_token_ids),
        stop_strings=args.stop,
        num_speculative_tokens=args.num_speculative_tokens,
        ignore_eos=args.ignore_eos,
        request_id=args.request_id,
    )


@dataclasses.dataclass
class StreamClock:
    """Client-side timings: TTFT from the request, TPOT over the tokens after the first message."""

    start: float = dataclasses.field(default_factory=time.perf_counter)
    first: float | None = None
    first_tokens: int = 0
    end: float | None = None

    def tick(self, delta: Delta) -> None:
        if self.first is None and delta.token_ids:
            self.first, self.first_tokens = time.perf_counter(), len(delta.token_ids)
        self.end = time.perf_counter()

    def stats(self, result: GenerateResult) -> dict[str, float | None]:
        end = self.end or time.perf_counter()
        later_tokens = result.usage.output_tokens - self.first_tokens
        return {
            "ttft_s": self.first - self.start if self.first is not None else None,
            "tpot_s": (end - self.first) / later_tokens
            if self.first is not None and later_tokens > 0
            else None,
            "e2e_s": end - self.start,
        }


def _stats_line(result: GenerateResult, timing: dict[str, float | None]) -> str:
    usage = result.usage
    rate = usage.acceptance_rate
    acceptance = f"{rate:.1%} ({usage.accepted_tokens}/{usage.drafted_tokens})" if rate is not None else "n/a"
    tpot = f"{timing['tpot_s'] * 1e3:.2f} ms" if timing["tpot_s"] is not None else "n/a"
    return (
        f"[{usage.output_tokens} tokens, finish {result.finish_reason}, acceptance {acceptance}, "
        f"TPOT {tpot}, e2e {timing['e2e_s'] or 0.0:.2f} s]"
    )


def cmd_generate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    prompt: str | list[int] = (
        args.prompt if args.prompt is not None else parse_ids("--token-ids", args.token_ids)
    )
    # Text prompts print text; id prompts print ids (the target may have no tokenizer).
    as_text = isinstance(prompt, str)
    options = _generate_options(args)
    with _client(args) as client, client.stream(prompt, **options) as stream:
        builder, clock = ResultBuilder(stream.request_id), StreamClock()
        for delta in stream:
            clock.tick(delta)
            builder.add(delta)
            if not args.json:
                out.write(delta.text if as_text else "".join(f"{t} " for t in delta.token_ids))
                out.flush()
        result = builder.build()
    timing = clock.stats(result)
    if args.json:
        payload = dataclasses.asdict(result) | {"acceptance_rate": result.usage.acceptance_rate} | timing
        out.write(json.dumps(payload) + "\n")
    else:
        out.write("\n")
        err.write(_stats_line(result, timing) + "\n")
    return 0


def cmd_chat(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Multi-turn: each user message (from --message, else one per stdin line) is sent with the history."""
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    options = _generate_options(args)
    options.pop("request_id")  # one id per turn, chosen by the SDK
    turns = args.message or (line.rstrip("\n") for line in sys.stdin)
    results = []
    with _client(args) as client:
        for text in turns:
            if not text.strip():
                continue
            history.append({"role": "user", "content": text})
            with client.chat_stream(history, **options) as stream:
                builder, clock = ResultBuilder(stream.request_id), StreamClock()
                for delta in stream:
                    clock.tick(delta)
                    builder.add(delta)
                    if not args.json:
                        out.write(delta.text)
                        out.flush()
                result = builder.build()
            history.append({"role": "assistant", "content": result.text})
            timing = clock.stats(result)
            if args.json:
                results.append(
                    dataclasses.asdict(result) | {"acceptance_rate": result.usage.acceptance_rate} | timing
                )
            else:
                out.write("\n")
                err.write(_stats_line(result, timing) + "\n")
    if args.json:
        out.write(json.dumps({"messages": history, "turns": results}) + "\n")
    return 0


def cmd_info(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    with _client(args) as client:
        info = dataclasses.asdict(client.model_info())
    if args.json:
        out.write(json.dumps(info) + "\n")
    else:
        width = max(map(len, info))
        out.writelines(f"{key:<{width}}  {value}\n" for key, value in info.items())
    return 0


def cmd_health(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    with _client(args) as client:
        status = client.health(args.service)
    out.write(status + "\n")
    return 0 if status == "SERVING" else EXIT_ERROR


COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO, TextIO], int]] = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "info": cmd_info,
    "health": cmd_health,
}


def _error_line(error: SpecSplitError, target: str) -> str:
    if isinstance(error, UnavailableError):
        return f"specsplit: unavailable: {target}: {error.details}"
    if isinstance(error, APIError):
        return f"specsplit: {error.code.name.lower()}: {error.details}"
    return f"specsplit: {error}"


def _dispatch(command: str, argv: list[str]) -> int:
    module = importlib.import_module(DISPATCH[command][0])
    entry: Callable[[list[str]], Any] = module.main
    return int(entry(argv) or 0)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out, err = out or sys.stdout, err or sys.stderr
    if argv and argv[0] in DISPATCH:
        return _dispatch(argv[0], argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        return COMMANDS[args.command](args, out, err)
    except SpecSplitError as error:
        err.write(_error_line(error, args.target) + "\n")
        return EXIT_ERROR
    except OSError as error:  # e.g. an unreadable --ca-cert or --auth-token-file
        err.write(f"specsplit: {error}\n")
        return EXIT_ERROR
    except UsageError as error:
        err.write(f"specsplit: error: {error}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
