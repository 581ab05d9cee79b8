"""Tensor parallelism on CPU: real multi-process gloo worlds (TP=2 and TP=4) against TP=1 in this process.

Multi-process: each test spawns one world and runs several scenarios in it (spawn start-up dominates).
Communication volumes are asserted exactly from the counters of `common.distributed`.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import load_file

from common.distributed import Comm, comm_stats, reset_comm_stats, run_local_world
from common.kv_cache import KVCache
from common.layers.logits import LogitsProcessor, top_tokens
from common.layers.vocab import ParallelLMHead, pad_vocab_size
from common.loader import load_model
from common.models.generate import forward_rows
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.slow  # multi-process

HIDDEN, MARKOV_RANK, DRAFT_VOCAB, N_ROWS, DRAFT_STEPS = 64, 8, 300, 5, 3


def forward_script(seed: int = 0, vocab: int = 500) -> list[tuple[list[int], list[int], list[list[int]]]]:
    """(slots, starts, rows) per step: ragged prefill, decode, k+1 verify, rollback + re-verify over stale
    KV, then a freed slot reused by a new prompt in the same batch as two decodes."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()
    return [
        ([0, 1, 2], [0, 0, 0], [rand(9), rand(3), rand(6)]),
        ([0, 1, 2], [9, 3, 6], [rand(1), rand(1), rand(1)]),
        ([0, 1, 2], [10, 4, 7], [rand(4), rand(4), rand(4)]),
        ([0, 1, 2], [11, 8, 7], [rand(3), rand(3), rand(3)]),  # after accepting 1, 4 and 0 of 4
        ([0, 1, 2], [14, 0, 10], [rand(1), rand(5), rand(1)]),
    ]


def run_script(comm: Comm, path, script, **load_kw) -> dict:
    model = load_model(path, comm, **load_kw)
    cache = KVCache.for_model(model, 3, 32)
    out = {"hidden": [], "logits": [], "top": [], "stats": []}
    for slots, starts, rows in script:
        reset_comm_stats()
        hidden = forward_rows(model, cache, slots, starts, rows)
        flat = hidden.reshape(-1, hidden.shape[-1])
        fwd_stats = comm_stats()
        reset_comm_stats()
        out["logits"].append(model.compute_logits(flat))
        logit_stats = comm_stats()
        reset_comm_stats()
        out["top"].append(model.get_top_tokens(flat))
        out["stats"].append((fwd_stats, logit_stats, comm_stats()))
        out["hidden"].append(hidden)
    return out


def markov_scenario(comm: Comm, path, mode: str) -> dict:
    """The draft's greedy step with a Markov head, both reductions, counters per draft position."""
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(N_ROWS, HIDDEN, generator=gen)
    prev = torch.randint(0, 500, (N_ROWS,), generator=gen)
    out = {}
    for use_local in (True, False):
        model = load_model(path, comm, markov_head_mode=mode, use_local_argmax_reduction=use_local)
        reset_comm_stats()
        ids = model.greedy_draft_tokens(hidden, prev)
        out[use_local] = (ids, comm_stats())
    reset_comm_stats()
    out["logits"] = model.compute_logits(hidden, prev)
    # k sequential draft positions of the whole draft (forward + greedy step), local argmax on
    model = load_model(path, comm, markov_head_mode=mode, use_local_argmax_reduction=True)
    cache = KVCache.for_model(model, N_ROWS, 16)
    tokens, drafted = prev.tolist(), []
    reset_comm_stats()
    for step in range(DRAFT_STEPS):
        h = forward_rows(model, cache, list(range(N_ROWS)), [step] * N_ROWS, [[t] for t in tokens])
        nxt = model.greedy_draft_tokens(h[:, 0], torch.tensor(tokens))
        tokens = nxt.tolist()
        drafted.append(tokens)
    out["draft_loop"] = (drafted, comm_stats())
    return out


def tie_scenario(comm: Comm, vocab: int) -> dict:
    """Integer weights: exact ties (across ranks too) and rows where every real logit is below padding's 0."""
    gen = torch.Generator().manual_seed(comm.world_size)
    full_w = torch.randint(0, 3, (vocab, 4), generator=gen).float() + 0.5
    full_w[vocab - 1] = full_w[1]  # same score at ids 1 and vocab-1: lowest must win, across ranks
    hidden = torch.randint(-1, 2, (64, 4), generator=gen).float()
    hidden[:8] = -1.0
    proc = LogitsProcessor(soft_cap=3.0, scale=2.0)
    head = ParallelLMHead(vocab, 4, comm)
    head.weight.zero_()
    rows = max(0, min(head.shard_size, vocab - head.shard_start))
    head.weight[:rows] = full_w[head.shard_start : head.shard_start + rows]
    reference = proc.process(hidden @ full_w.T).argmax(-1)  # full argmax on this rank, no TP
    reset_comm_stats()
    got = top_tokens(proc.local_scores(head, hidden), head)
    return {"got": got, "ref": reference, "stats": comm_stats(), "shard_valid": head.shard_valid}


def comm_primitives_scenario(comm: Comm) -> dict:
    reset_comm_stats()
    obj = {"op": "verify", "slots": [0, 3], "k": 4} if comm.rank == 0 else None
    got = comm.broadcast_object(obj, 0, "step_broadcast")
    t = torch.full((3,), float(comm.rank))
    comm.broadcast(t, 0, "step_broadcast")
    g = comm.all_gather(torch.full((2, 3), float(comm.rank)), "lm_head_argmax")
    r = comm.all_reduce(torch.ones(4, dtype=torch.float64), "attn_out")
    return {"obj": got, "bcast": t, "gather": g, "reduce": r, "stats": comm_stats()}


def world_two(comm: Comm, paths: dict, script) -> dict:
    return {
        "script": run_script(comm, paths["target"], script),
        "replicated_head": run_script(comm, paths["untied"], script, replicate_lm_head=True),
        "markov_replicated": markov_scenario(comm, paths["draft"], "replicated"),
        "markov_sharded": markov_scenario(comm, paths["draft"], "sharded"),
        "ties": tie_scenario(comm, 100),
        "prims": comm_primitives_scenario(comm),
    }


def world_four(comm: Comm, paths: dict, script) -> dict:
    return {"script": run_script(comm, paths["wide"], script), "ties": tie_scenario(comm, 150)}


def world_three(comm: Comm, paths: dict, script) -> dict:
    return {"script": run_script(comm, paths["odd"], script), "ties": tie_scenario(comm, 150)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    target = make_tiny_model(root / "target", seed=1, vocab_size=500, num_shards=2)
    return {
        "target": target,
        "untied": make_tiny_model(root / "untied", seed=2, vocab_size=500, tie_word_embeddings=False),
        "draft": make_tiny_model(
            root / "draft",
            base=target,
            share_layers=1,
            num_layers=1,
            markov_rank=MARKOV_RANK,
            draft_vocab_size=DRAFT_VOCAB,
        ),
        "wide": make_tiny_model(
            root / "wide",
            seed=4,
            vocab_size=1000,
            num_kv_heads=4,
            architecture="LlamaForCausalLM",
            tie_word_embeddings=False,
            final_logit_softcapping=5.0,
            logit_scale=0.7,
        ),
        "odd": make_tiny_model(
            root / "odd",
            seed=5,
            vocab_size=500,
            num_heads=6,
            num_kv_heads=3,
            head_dim=16,
            intermediate_size=96,
            architecture="Qwen2ForCausalLM",
        ),
    }


def expected_forward_stats(rows, layers: int = 2) -> dict:
    batch, width = len(rows), max(len(r) for r in rows)
    act = batch * width * HIDDEN * 4
    return {
        ("all_reduce", "embed"): (1, act),
        ("all_reduce", "attn_out"): (layers, layers * act),
        ("all_reduce", "mlp_out"): (layers, layers * act),
    }


def assert_script_matches(tp_out: dict, ref: dict, script, tp: int, padded_vocab: int, gathered=True):
    for step, (_, _, rows) in enumerate(script):
        torch.testing.assert_close(tp_out["hidden"][step], ref["hidden"][step], atol=2e-5, rtol=0)
        torch.testing.assert_close(tp_out["logits"][step], ref["logits"][step], atol=2e-5, rtol=0)
        assert torch.equal(tp_out["top"][step], ref["top"][step])
        # within one TP world, the local-argmax ids are exactly the argmax of the gathered logits
        assert torch.equal(tp_out["top"][step], tp_out["logits"][step].argmax(-1))
        fwd, logit_stats, top_stats = tp_out["stats"][step]
        assert fwd == expected_forward_stats(rows)
        n = len(rows) * max(len(r) for r in rows)
        if gathered:
            assert logit_stats == {("all_gather", "logits_gather"): (1, n * padded_vocab * 4)}
            assert top_stats == {("all_gather", "lm_head_argmax"): (1, n * 2 * tp * 4)}
        else:  # replicated LM head: nothing to gather or reduce
            assert logit_stats == {} and top_stats == {}


def test_tp2_forward_heads_markov_and_counters(paths):
    script = forward_script()
    results = run_local_world(2, world_two, paths, script)
    ref = run_script(Comm(), paths["target"], script)
    for rank_out in results:
        assert_script_matches(rank_out["script"], ref, script, 2, pad_vocab_size(500, 2))

    ref_untied = run_script(Comm(), paths["untied"], script)
    for rank_out in results:
        assert_script_matches(rank_out["replicated_head"], ref_untied, script, 2, 0, gathered=False)

    ckpt = load_file(paths["draft"] / "model.safetensors")
    gen = torch.Generator().manual_seed(11)
    hidden, prev = torch.randn(N_ROWS, HIDDEN, generator=gen), torch.randint(0, 500, (N_ROWS,), generator=gen)
    unsharded = hidden @ ckpt["lm_head.weight"].T
    unsharded += ckpt["markov_head.markov_w1.weight"][prev] @ ckpt["markov_head.markov_w2.weight"].T
    expected_ids = unsharded.argmax(-1) + ckpt["d2t"][unsharded.argmax(-1)]
    padded_draft = pad_vocab_size(DRAFT_VOCAB, 2)
    head_bytes = {"argmax": N_ROWS * 2 * 2 * 4, "gather": N_ROWS * padded_draft * 4}
    markov_sharded = {
        ("all_reduce", "markov_head"): (1, N_ROWS * MARKOV_RANK * 4),
        ("all_gather", "markov_head"): (1, N_ROWS * padded_draft * 4),
    }
    ref_draft = {mode: markov_scenario(Comm(), paths["draft"], mode) for mode in ("replicated", "sharded")}
    for rank_out in results:
        for mode in ("replicated", "sharded"):
            out = rank_out[f"markov_{mode}"]
            torch.testing.assert_close(out["logits"], unsharded, atol=2e-5, rtol=0)
            extra = {} if mode == "replicated" else markov_sharded
            ids, stats = out[True]
            assert torch.equal(ids, expected_ids)
            assert stats == {("all_gather", "lm_head_argmax"): (1, head_bytes["argmax"]), **extra}
            ids, stats = out[False]
            assert torch.equal(ids, expected_ids)
            assert stats == {("all_gather", "logits_gather"): (1, head_bytes["gather"]), **extra}
            drafted, loop_stats = out["draft_loop"]
            assert drafted == ref_draft[mode]["draft_loop"][0]
            head_sites = {k: v for k, v in loop_stats.items() if k[1] in ("lm_head_argmax", "markov_head")}
            per_pos = {k: (calls * DRAFT_STEPS, nbytes * DRAFT_STEPS) for k, (calls, nbytes) in extra.items()}
            assert head_sites == {
                ("all_gather", "lm_head_argmax"): (DRAFT_STEPS, DRAFT_STEPS * head_bytes["argmax"]),
                **per_pos,
            }

    for rank_out in results:
        ties = rank_out["ties"]
        assert torch.equal(ties["got"], ties["ref"]) and (ties["got"] < 100).all()
        assert ties["stats"] == {("all_gather", "lm_head_argmax"): (1, 64 * 2 * 2 * 4)}
        prims = rank_out["prims"]
        assert prims["obj"] == {"op": "verify", "slots": [0, 3], "k": 4}
        assert torch.equal(prims["bcast"], torch.zeros(3))
        assert torch.equal(prims["gather"], torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))
        assert torch.equal(prims["reduce"], torch.full((4,), 2.0, dtype=torch.float64))
        pickled = len(pickle.dumps({"op": "verify", "slots": [0, 3], "k": 4}))
        assert prims["stats"] == {
            ("broadcast", "step_broadcast"): (2, pickled + 12),
            ("all_gather", "lm_head_argmax"): (1, 4 * 3 * 4),
            ("all_reduce", "attn_out"): (1, 4 * 8),
        }


def test_tp4_forward_and_ties(paths):
    script = forward_script(seed=1, vocab=1000)
    results = run_local_world(4, world_four, paths, script)
    ref = run_script(Comm(), paths["wide"], script)
    for rank, rank_out in enumerate(results):
        assert_script_matches(rank_out["script"], ref, script, 4, pad_vocab_size(1000, 4))
        ties = rank_out["ties"]
        assert torch.equal(ties["got"], ties["ref"]) and (ties["got"] < 150).all()
        assert ties["shard_valid"] == [64, 64, 22, 0][rank]  # 150 over 4 x 64: the last shard is all padding
        assert ties["stats"] == {("all_gather", "lm_head_argmax"): (1, 64 * 2 * 4 * 4)}


def test_tp3_forward_and_ties(paths):
    """A split that is not a power of two: 6 heads / 3 KV heads, vocab padded to 3 x 192."""
    script = forward_script(seed=2)
    results = run_local_world(3, world_three, paths, script)
    ref = run_script(Comm(), paths["odd"], script)
    for rank, rank_out in enumerate(results):
        assert_script_matches(rank_out["script"], ref, script, 3, pad_vocab_size(500, 3))
        ties = rank_out["ties"]
        assert torch.equal(ties["got"], ties["ref"]) and (ties["got"] < 150).all()
        assert ties["shard_valid"] == [64, 64, 22][rank]
