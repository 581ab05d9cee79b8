"""`specsplit bench-serve`: load-test a running target service (the counterpart of `vllm bench serve`).

Sends --num-prompts requests through the AsyncClient, either all at once limited by --max-concurrency,
or as Poisson arrivals at --request-rate. Prompts come from a JSONL file (one object per line:
`{"prompt": "text"}` or `{"prompt_ids": [1, 2]}`, optional `"max_new_tokens"`) or are random token ids
with lengths drawn uniformly from [len*(1-range), len*(1+range)].

Reports (printed, and as JSON with --result-json): requests/s, output tokens/s, TTFT / TPOT / ITL
(mean, p50, p90, p99 in ms), draft acceptance, and failed requests by gRPC status. With
--check-greedy, every greedy request is run again with speculation off (k = 0) after the timed run
and the token sequences must be equal (the lossless check; mismatches are counted and fail the exit
code). Each mismatch is probed where it first diverges, for the target's top-2 logprobs there: whether
the two outputs took the target's two best candidates at a near-tie (`greedy_check.divergences`,
`near_ties`). A prompt of token ids is probed teacher-forced (the prompt and the outputs' common prefix,
one token), which settles every mismatch; a text prompt is decoded alone up to the divergence (at most
MAX_ALONE_PROBES of them), which may take another path before it.

Needs only the client install (grpcio, protobuf).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from specsplit._channel import TLSConfig
from specsplit.aio import AsyncClient
from specsplit.client import TokenLogprob
from specsplit.errors import APIError, SpecSplitError

PERCENTILES = (50, 90, 99)


@dataclass
class Prompt:
    prompt: str | list[int]
    max_new_tokens: int


@dataclass
class Outcome:
    """One request as the client saw it (times in seconds from its own send)."""

    ok: bool = False
    error: str = ""  # the gRPC status name when not ok
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between token-carrying messages
    drafted: int = 0
    accepted: int = 0
    steps: int = 0


def ideal_speedup(mean_accepted: float, k: int, c: float) -> float:
    """Speculation's speedup with no overhead: 1 + E[a] tokens per step (E[a]: drafted tokens accepted per
    step) for a step costing 1 + k·c plain steps (c: one drafted position over one plain step)."""
    return (1 + mean_accepted) / (k * c + 1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy: the client install has none."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_ms(values: list[float]) -> dict[str, float]:
    out = {"mean": sum(values) / len(values) * 1e3 if values else float("nan")}
    out.update({f"p{q}": percentile(values, q) * 1e3 for q in PERCENTILES})
    return out


# -- workload ----------------------------------------------------------------------
def load_jsonl(path: str, default_output_len: int) -> list[Prompt]:
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--dataset: {path}:{n}: not JSON ({exc.msg})") from None
            if "prompt_ids" in obj:
                text: str | list[int] = [int(t) for t in obj["prompt_ids"]]
            elif "prompt" in obj:
                text = str(obj["prompt"])
            else:
                raise ValueError(f"--dataset: {path}:{n}: needs a 'prompt' or 'prompt_ids' key")
            prompts.append(Prompt(text, int(obj.get("max_new_tokens", default_output_len))))
    if not prompts:
        raise ValueError(f"--dataset: {path} holds no prompts")
    return prompts


def _length(rng: random.Random, mean: int, spread: float) -> int:
    lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return rng.randint(lo, hi)


def random_prompts(n: int, vocab: int, args: argparse.Namespace, rng: random.Random) -> list[Prompt]:
    return [
        Prompt(
            [rng.randrange(vocab) for _ in range(_length(rng, args.input_len, args.range_ratio))],
            _length(rng, args.output_len, args.range_ratio),
        )
        for _ in range(n)
    ]


def arrival_gaps(n: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each request: 0 for rate = inf, else exponential (a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.expovariate(rate) for _ in range(n)]


# -- the run -----------------------------------------------------------------------
class Progress:
    """A one-line progress bar on a terminal (stderr), nothing when not a TTY or disabled."""

    def __init__(self, total: int, stream: TextIO, enabled: bool):
        self.total, self.done, self.failed = total, 0, 0
        self.stream, self.enabled = stream, enabled
        self.start = time.perf_counter()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        rate = self.done / max(time.perf_counter() - self.start, 1e-9)
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"{rate:.1f} req/s, {self.failed} failed"
        )
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


async def one_request(client: AsyncClient, p: Prompt, options: dict[str, Any]) -> Outcome:
    o = Outcome()
    t0 = last = time.perf_counter()
    try:
        async with client.stream(p.prompt, max_new_tokens=p.max_new_tokens, **options) as stream:
            async for delta in stream:
                now = time.perf_counter()
                if delta.token_ids:
                    if not o.token_ids:
                        o.ttft = now - t0
                    else:
                        o.itl.append(now - last)
                    last = now
                    o.token_ids.extend(delta.token_ids)
                if delta.finish_reason is not None:
                    o.finish_reason = delta.finish_reason.value
                if delta.usage is not None:
                    o.drafted, o.accepted, o.steps = (
                        delta.usage.drafted_tokens,
                        delta.usage.accepted_tokens,
                        delta.usage.steps,
                    )
        o.latency = time.perf_counter() - t0
        o.ok = bool(o.finish_reason)
        if not o.ok:
            o.error = "NO_FINISH_REASON"
    except APIError as exc:
        o.error = exc.code.name
    except SpecSplitError as exc:
        o.error = type(exc).__name__
    return o


async def run_load(
    client: AsyncClient,
    prompts: list[Prompt],
    options: dict[str, Any],
    max_concurrency: int,
    rate: float,
    rng: random.Random,
    progress: Progress,
) -> tuple[list[Outcome], float]:
    """Sends every prompt (arrivals per `rate`, at most `max_concurrency` in flight); outcomes in
    prompt order and the wall time."""
    limit = asyncio.Semaphore(max_concurrency)
    outcomes: list[Outcome] = [Outcome() for _ in prompts]

    async def send(i: int) -> None:
        async with limit:
            outcomes[i] = await one_request(client, prompts[i], options)
        progress.update(outcomes[i].ok)

    start = time.perf_counter()
    tasks = []
    for i, gap in enumerate(arrival_gaps(len(prompts), rate, rng)):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(send(i)))
    await asyncio.gather(*tasks)
    return outcomes, time.perf_counter() - start


async def check_greedy(
    client: AsyncClient, prompts: list[Prompt], outcomes: list[Outcome], options: dict[str, Any], conc: int
) -> dict[str, Any]:
    """Runs each successful request again with k = 0: speculative output must equal plain decoding. Each
    mismatch is then probed where it first diverges (`divergence`; those of text prompts, at most
    MAX_ALONE_PROBES)."""
    plain_options = dict(options, num_speculative_tokens=0)
    limit = asyncio.Semaphore(conc)
    checked = [i for i, o in enumerate(outcomes) if o.ok]

    async def plain(i: int) -> Outcome:
        async with limit:
            return await one_request(client, prompts[i], plain_options)

    refs = await asyncio.gather(*(plain(i) for i in checked))
    bad = [(i, ref) for i, ref in zip(checked, refs) if not ref.ok or ref.token_ids != outcomes[i].token_ids]
    forced = [(i, ref) for i, ref in bad if ref.ok and isinstance(prompts[i].prompt, list)]
    alone = [(i, ref) for i, ref in bad if ref.ok and not isinstance(prompts[i].prompt, list)]

    async def probe(i: int, ref: Outcome) -> dict[str, Any]:
        async with limit:
            return await divergence(client, prompts[i], outcomes[i].token_ids, ref.token_ids, plain_options)

    probes = await asyncio.gather(*(probe(i, ref) for i, ref in forced + alone[:MAX_ALONE_PROBES]))
    return {
        "checked": len(checked),
        "mismatches": len(bad),
        "mismatched_requests": [i for i, _ in bad][:20],
        "probed": len(probes),
        "near_ties": sum(bool(d.get("near_tie")) for d in probes),
        "divergences": list(probes),
    }


# Mismatches of text prompts probed per check (each decodes the request alone up to its divergence), and
# the top-2 gap (nats) under which a divergence counts as a near-tie: a bf16 logit of magnitude 16-32 has
# an ulp of 0.125, so two kernels that sum in another order can swap candidates closer than about one ulp.
MAX_ALONE_PROBES, NEAR_TIE_NATS = 20, 0.1


async def divergence(
    client: AsyncClient, p: Prompt, spec: list[int], ref: list[int], plain_options: dict[str, Any]
) -> dict[str, Any]:
    """Where a speculative output first differs from the plain one, and how close the target's top two
    candidates were there, with k = 0 and top-2 logprobs: a prompt of token ids extended by the outputs'
    common prefix, one token (`probe`: "forced"); a text prompt decoded alone up to that position
    ("alone": it may take another path before it, and then settles nothing). `near_tie`: the two outputs'
    tokens there are the target's top two and their log-probabilities are within NEAR_TIE_NATS (a
    floating-point tie, not a verification error)."""
    at = next((j for j, (a, b) in enumerate(zip(spec, ref)) if a != b), min(len(spec), len(ref)))
    out: dict[str, Any] = {"position": at, "speculative": spec[at : at + 1], "plain": ref[at : at + 1]}
    if at >= min(len(spec), len(ref)):
        out["near_tie"] = False  # one output is a prefix of the other: a length difference, no token swap
        return out
    lps: list[TokenLogprob] = []
    ids: list[int] = []
    options = dict(plain_options, logprobs=2)
    forced = isinstance(p.prompt, list)
    out["probe"] = "forced" if forced else "alone"
    prompt, length = ([*p.prompt, *ref[:at]], 1) if forced else (p.prompt, at + 1)
    skip = 0 if forced else at  # the probe's index of the divergence's token
    try:
        async with client.stream(prompt, max_new_tokens=length, **options) as stream:
            async for delta in stream:
                ids.extend(delta.token_ids)
                lps.extend(delta.logprobs)
    except (APIError, SpecSplitError) as exc:
        out["error"] = type(exc).__name__
        out["near_tie"] = False
        return out
    if ids[:skip] != ref[:skip] or len(lps) <= skip or len(lps[skip].top) < 2:
        out["near_tie"] = False  # alone, the request took another path before the position
        out["alone"] = "diverged earlier"
        return out
    (id1, lp1), (id2, lp2) = lps[skip].top[:2]
    out.update(top2=[id1, id2], gap_nats=lp1 - lp2)
    out["near_tie"] = {spec[at], ref[at]} == {id1, id2} and lp1 - lp2 <= NEAR_TIE_NATS
    return out


def report(outcomes: list[Outcome], duration: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    out_tokens = sum(len(o.token_ids) for o in ok)
    drafted, accepted = sum(o.drafted for o in ok), sum(o.accepted for o in ok)
    steps = sum(o.steps for o in ok)
    tpot = [(o.latency - o.ttft) / (len(o.token_ids) - 1) for o in ok if len(o.token_ids) > 1]
    return {
        "target": args.target,
        "num_prompts": len(outcomes),
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "temperature": args.temperature,
        "num_speculative_tokens": args.num_speculative_tokens,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": dict(Counter(o.error for o in outcomes if not o.ok)),
        "finish_reasons": dict(Counter(o.finish_reason for o in ok)),
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "ttft_ms": summarize_ms([o.ttft for o in ok if o.token_ids]),
        "tpot_ms": summarize_ms(tpot),
        "itl_ms": summarize_ms([x for o in ok for x in o.itl]),
        "e2e_ms": summarize_ms([o.latency for o in ok]),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_step": out_tokens / steps if steps else None,
    }


def format_report(r: dict[str, Any]) -> str:
    lines = [
        "=" * 20 + " specsplit bench-serve " + "=" * 20,
        f"{'Successful requests:':<34}{r['completed']}",
        f"{'Failed requests:':<34}{r['failed']}  {r['errors'] or ''}",
        f"{'Benchmark duration (s):':<34}{r['duration_s']:.2f}",
        f"{'Total generated tokens:':<34}{r['output_tokens']}",
        f"{'Request throughput (req/s):':<34}{r['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<34}{r['output_throughput']:.2f}",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = r[f"{name}_ms"]
        lines.append(
            f"{name.upper() + ' ms (mean/p50/p90/p99):':<34}"
            + " / ".join(f"{s[k]:.2f}" for k in ("mean", "p50", "p90", "p99"))
        )
    acc = r["acceptance_rate"]
    lines.append(f"{'Draft acceptance:':<34}{'n/a' if acc is None else f'{acc:.3f}'}"
                 f"  ({r['accepted_tokens']}/{r['drafted_tokens']} tokens)")  # fmt: skip
    if "greedy_check" in r:
        g = r["greedy_check"]
        lines.append(f"{'Greedy == plain (k=0):':<34}{g['checked'] - g['mismatches']}/{g['checked']}")
        if g["mismatches"]:
            lines.append(f"{'  mismatches probed, near-ties:':<34}{g['probed']}, {g['near_ties']} "
                         f"(top-2 gap <= {NEAR_TIE_NATS} nats)")  # fmt: skip
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specsplit bench-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HOST:PORT of the target service")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--max-concurrency", type=int, default=64, help="most requests in flight at once")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (inf: all at once, max --max-concurrency)")  # fmt: skip
    p.add_argument("--dataset", help="JSONL prompts ({'prompt': ...} or {'prompt_ids': [...]})")
    p.add_argument("--input-len", type=int, default=32, help="random prompts: mean prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="mean max_new_tokens")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- ratio)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="k (default: the server's)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max_new_tokens (default on, as for load tests)")  # fmt: skip
    p.add_argument("--check-greedy", action="store_true",
                   help="after the run, re-run each request with k=0 and require equal tokens")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="deadline per request, seconds")
    p.add_argument("--result-json", help="write the report here as JSON")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")  # fmt: skip
    p.add_argument("--ca-cert", help="PEM CA certificate of the server (turns on TLS)")
    p.add_argument("--auth-token-file", help="bearer token file (or SPECSPLIT_AUTH_TOKEN)")
    return p


def validate(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "max_concurrency", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate: must be > 0")
    if not 0 <= args.range_ratio < 1:
        raise ValueError("--range-ratio: must be in [0, 1)")
    if args.check_greedy and args.temperature != 0:
        raise ValueError("--check-greedy: needs --temperature 0")


async def bench(args: argparse.Namespace, err: TextIO) -> dict[str, Any]:
    token = os.environ.get("SPECSPLIT_AUTH_TOKEN")
    if args.auth_token_file:
        with open(args.auth_token_file) as f:
            token = f.read().strip()
    tls = TLSConfig.from_files(args.ca_cert, None, None, None) if args.ca_cert else None
    rng = random.Random(args.seed)
    async with AsyncClient(args.target, timeout=args.timeout, tls=tls, auth_token=token) as client:
        if args.dataset:
            prompts = load_jsonl(args.dataset, args.output_len)
            prompts = [prompts[i % len(prompts)] for i in range(args.num_prompts)]
        else:
            info = await client.model_info()
            prompts = random_prompts(args.num_prompts, info.vocab_size, args, rng)
        options: dict[str, Any] = {
            "temperature": args.temperature,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "ignore_eos": args.ignore_eos,
            "num_speculative_tokens": args.num_speculative_tokens,
        }
        if args.temperature > 0:
            options["seed"] = args.seed
        progress = Progress(len(prompts), err, err.isatty() if args.progress is None else args.progress)
        outcomes, duration = await run_load(
            client, prompts, options, args.max_concurrency, args.request_rate, rng, progress
        )
        result = report(outcomes, duration, args)
        if args.check_greedy:
            result["greedy_check"] = await check_greedy(
                client, prompts, outcomes, options, args.max_concurrency
            )
    return result


def main(argv: list[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    args = build_parser().parse_args(argv)
    try:
        validate(args)
        result = asyncio.run(bench(args, err))
    except (ValueError, OSError) as exc:
        err.write(f"specsplit bench-serve: error: {exc}\n")
        return 2
    except SpecSplitError as exc:
        err.write(f"specsplit bench-serve: {exc}\n")
        return 1
    out.write(format_report(result) + "\n")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2, default=lambda x: asdict(x))
    bad = result["failed"] or result.get("greedy_check", {}).get("mismatches", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
