"""Communication per draft position at TP=2, measured from the comm counters (not computed).

Builds a draft with a V-token LM head and a Markov head, spawns a gloo TP world on CPU, runs k greedy
draft positions for a batch of rows in each configuration (local argmax on/off x Markov replicated /
sharded) and prints the bytes each rank moved per draft position per row, by site.

    python bench/comm_volume.py [--vocab 32000] [--tp 2] [--markov-rank 64] [--rows 4] [--steps 3] \\
        [--out comm.json]

The head's bytes do not depend on the trunk, so a one-layer draft of width --hidden shows them; the trunk
adds (1 + 2 * layers) all_reduces of hidden * 4 bytes per position per row in every configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from common.distributed import Comm, comm_stats, reset_comm_stats, run_local_world
from common.kv_cache import KVCache
from common.loader import load_model
from common.models.generate import forward_rows
from common.tiny import make_tiny_model

HEAD_SITES = ("lm_head_argmax", "logits_gather", "markov_head")
TRUNK_SITES = ("embed", "attn_out", "mlp_out")


def draft_positions(comm: Comm, path: str, rows: int, steps: int) -> dict:
    """(local_argmax, markov_mode) -> {(op, site): (calls, bytes)} over `steps` positions of `rows` rows."""
    out = {}
    for local in (True, False):
        for mode in ("replicated", "sharded"):
            model = load_model(path, comm, markov_head_mode=mode, use_local_argmax_reduction=local)
            cache = KVCache.for_model(model, rows, steps + 1)
            tokens = torch.arange(rows) * 7 + 1
            reset_comm_stats()
            with torch.inference_mode():
                for step in range(steps):
                    hidden = forward_rows(
                        model, cache, list(range(rows)), [step] * rows, [[t] for t in tokens.tolist()]
                    )
                    tokens = model.greedy_draft_tokens(hidden[:, 0], tokens)
            out[(local, mode)] = comm_stats()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000, help="the draft's LM head rows")
    ap.add_argument("--tp", type=int, default=2, help="gloo ranks")
    ap.add_argument("--markov-rank", type=int, default=64, help="the Markov head's rank")
    ap.add_argument("--hidden", type=int, default=64, help="the one-layer trunk's width")
    ap.add_argument("--rows", type=int, default=4, help="requests drafted at once")
    ap.add_argument("--steps", type=int, default=3, help="draft positions measured")
    ap.add_argument("--out", type=Path, default=None, help="the raw JSON: bytes per position per row by site")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(
            Path(tmp) / "draft",
            vocab_size=a.vocab,
            hidden_size=a.hidden,
            num_layers=1,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=2 * a.hidden,
            tie_word_embeddings=False,
            markov_rank=a.markov_rank,
        )
        stats = run_local_world(a.tp, draft_positions, str(path), a.rows, a.steps)[0]  # rank 0's counters
    per = a.rows * a.steps
    print(
        f"TP={a.tp}, V={a.vocab}, markov rank r={a.markov_rank}, hidden={a.hidden}; bytes moved by one rank"
    )
    print(f"per draft position per row (measured over {a.steps} positions x {a.rows} rows):\n")
    print(f"{'reduction':<14}{'markov head':<13}{'head total':>12}  by site (op: calls/position, bytes/row)")
    result: dict = {"argv": sys.argv if argv is None else argv, "configurations": []}
    for (local, mode), counts in stats.items():
        head = {k: v for k, v in counts.items() if k[1] in HEAD_SITES}
        total = sum(nbytes for _, nbytes in head.values()) / per
        detail = ", ".join(
            f"{site} {op}: {calls // a.steps}x {nbytes / per:g} B"
            for (op, site), (calls, nbytes) in sorted(head.items())
        )
        print(f"{'local argmax' if local else 'full gather':<14}{mode:<13}{total:>10g} B  {detail}")
        sites = {f"{site} {op}": nbytes / per for (op, site), (_, nbytes) in sorted(head.items())}
        result["configurations"].append(
            {
                "local_argmax": local,
                "markov_head": mode,
                "head_bytes_per_position_per_row": total,
                "sites": sites,
            }
        )
    trunk = {k: v for k, v in next(iter(stats.values())).items() if k[1] in TRUNK_SITES}
    trunk_bytes = sum(nbytes for _, nbytes in trunk.values()) / per
    print(
        f"\ntrunk (same in every configuration; 1 layer, hidden={a.hidden}): {trunk_bytes:g} B per position "
        "per row = (1 + 2 * layers) all_reduces of hidden * 4 B"
    )
    if a.out:
        result["trunk_bytes_per_position_per_row"] = trunk_bytes
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
