"""Feature drafts (EAGLE-3 style, common/models/feature_draft.py): training, the protocol, both placements.

One module-scoped run trains a tiny feature draft for a tiny random target with the real CLI. Then:
training-time test computes exactly what the served draft computes; the checkpoint holds the draft's own
tensors; served as its own service (features on the Speculate stream as bf16) and inside the target
(features read in place, rounds chained to the verify), greedy output equals plain decoding with drafts
made and accepted; sampled verification with the feature draft keeps the target's distribution
(chi-square with a power check); a target that captures no features, an old protocol and malformed
features each get a clear answer; a draft service killed mid-request and started again drafts for the
running request again; training computes each sequence's target features once (the feature cache).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import pytest
import torch
from torch import Tensor

from common.config import ModelConfig
from common.distributed import Comm
from common.features import FeatureStore, from_wire, to_wire
from common.kv_cache import KVCache
from common.loader import load_model, load_tokenizer
from common.models.feature_draft import FeatureDraft
from common.training import prompts as builtin_prompts
from common.training.feature_cache import FeatureCache
from common.training.feature_train import feature_acceptance, target_features, unrolled_hidden
from common.training.train_draft import main as train_draft_main
from specsplit.launch import free_port
from specsplit.v1 import draft_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.service_util import (
    generate,
    generate_many,
    request,
    running,
    speculative_equals_plain,
    start_draft,
    start_target,
    wait_for,
)
from tests.test_services_lossless import assert_first_tokens_follow
from tests.tiny import make_tiny_model

LAYERS = "0,1,2"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(target, feature draft, log dir): a 3-layer random target and a feature draft trained for it."""
    root = tmp_path_factory.mktemp("feature_draft")
    target = make_tiny_model(root / "target", seed=0, num_layers=3, vocab_size=512, hidden_size=64)
    args = [
        "--kind", "feature", "--target", str(target), "--out", str(root / "run"), "--device", "cpu",
        "--seed", "3", "--markov-rank", "16", "--num-prompts", "32", "--max-new-tokens", "40",
        "--temperatures", "0", "--gen-batch-size", "32", "--steps", "40", "--batch-size", "16",
        "--warmup", "5", "--lr", "3e-3", "--markov-lr", "3e-2", "--log-every", "20",
        "--save-dtype", "float32", "--eval-prompts", "4", "--eval-max-new-tokens", "24", "--eval-k", "1,4",
        "--feature-cache-gb", "0.01",
    ]  # fmt: skip
    assert train_draft_main(args) == 0
    return target, root / "run" / "draft", root


def tiny_feature_draft(architecture: str) -> FeatureDraft:
    qk_norm = architecture == "Qwen3ForCausalLM"
    cfg = ModelConfig(architecture, 100, 32, 64, 1, 4, 2, 8, 1e-6, 10000.0, None, 512, True, False, qk_norm,
                      None, None, "float32", feature_layers=(0, 1, 2))  # fmt: skip
    model = FeatureDraft(cfg, Comm())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_training_time_test_computes_the_served_chain(architecture: str) -> None:
    """Unrolled step j at position p equals the served draft's j-th drafted position when its round starts
    at p - j: target features up to there, its own streams after (fp32; the served attention's scores
    round through fp32 as well)."""
    model = tiny_feature_draft(architecture)
    gen = torch.Generator().manual_seed(1)
    width, depth = 12, 4
    ids = torch.randint(0, 100, (1, width), generator=gen)
    feats = torch.randn(1, width, 96, generator=gen)
    with torch.no_grad():
        unrolled = unrolled_hidden(model, ids, feats, depth)
        for start in range(1, width - depth + 1):
            cache = KVCache.for_model(model, 1, 64)
            slot = torch.zeros(1, dtype=torch.int64)
            pos = torch.arange(start)[None]
            hidden, aux = model(ids[:, :start], pos, slot, cache, 64, model.fuse(feats[:, :start]))
            torch.testing.assert_close(hidden[0, -1], unrolled[0][0, start - 1], rtol=0, atol=2e-6)
            aux = aux[:, -1]
            for j in range(1, depth):
                p = start - 1 + j
                hidden, aux = model(ids[:, p : p + 1], torch.tensor([[p]]), slot, cache, 64, aux[:, None])
                torch.testing.assert_close(hidden[0, 0], unrolled[j][0, p], rtol=0, atol=2e-6)
                aux = aux[:, 0]


def test_training_features_equal_what_the_served_target_hands_its_draft(tmp_path) -> None:
    """target_features (training: the layers past the last captured one skipped) gives at each position
    exactly the row the serving target's forward writes into its FeatureStore for the position before
    (fp32, every position of two sequences)."""
    target = load_model(make_tiny_model(tmp_path / "t", num_layers=4, seed=3), Comm())
    layers = (0, 2)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    trained = target_features(target, ids, layers)

    cache = KVCache.for_model(target, 2, 9)  # the training forward's context: the same sums, same bits
    target.feature_store = FeatureStore(layers, target.config.hidden_size, 2, 9, torch.float32, "cpu")
    slots, positions = torch.arange(2), torch.arange(9).expand(2, 9)
    with torch.no_grad():
        target(ids, positions, slots, cache, 9)
    served = target.feature_store.previous(slots, positions)
    assert trained.shape == served.shape == (2, 9, 2 * target.config.hidden_size)
    assert torch.equal(trained, served)
    assert served[:, 1:].abs().sum() > 0  # the streams themselves, not zeros on both sides


def _padded(seqs: list[Tensor], rows: list[int], max_len: int) -> Tensor:
    """get_batch's ids: the rows' sequences cut to max_len, right-padded with 0 to the longest."""
    width = min(max_len, max(len(seqs[r]) for r in rows))
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    for b, r in enumerate(rows):
        n = min(width, len(seqs[r]))
        ids[b, :n] = seqs[r][:n]
    return ids


@pytest.mark.parametrize("budget_rows", [None, 20])
def test_feature_cache_computes_each_sequence_once_and_reads_it_back(tmp_path, budget_rows) -> None:
    """The training feature cache: a batch of new sequences gets exactly target_features of that batch
    (inside each sequence; zeros past it); a held sequence is read back bit for bit in later batches,
    with no target forward for a batch it holds whole, and differs from a fresh forward over another
    batch only by that batch shape's float rounding. With a budget of 20 rows the sequences past it are
    computed in every batch that has them."""
    target = load_model(make_tiny_model(tmp_path / "t", num_layers=3, seed=1), Comm())
    layers = (0, 1, 2)
    lengths = [5, 9, 3, 12, 7, 30]  # the last two cut at max_len 10
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (n,), generator=gen) for n in lengths]
    row_bytes = 3 * target.config.hidden_size * 4  # fp32 target
    budget = 10**9 if budget_rows is None else budget_rows * row_bytes
    cache = FeatureCache(target, layers, torch.tensor(lengths), 10, budget)
    forwards = []
    real = target.forward_streams
    target.forward_streams = lambda ids, *a, **kw: forwards.append(ids.shape) or real(ids, *a, **kw)

    first: dict[int, Tensor] = {}
    for rows in ([0, 1, 2], [3, 4, 5], [5, 0, 2], [2, 3, 1, 0, 4, 5]):
        ids = _padded(seqs, rows, 10)
        held = set(cache.offset)
        before = len(forwards)
        got = cache.features(rows, ids)
        assert len(forwards) - before == (0 if held.issuperset(rows) else 1)
        fresh = target_features(target, ids, layers)
        for b, r in enumerate(rows):
            n = min(lengths[r], 10)
            assert torch.equal(got[b, n:], torch.zeros_like(got[b, n:]))  # padding
            if not held.intersection(rows):  # a batch of new sequences: its own forward, the same bits
                assert torch.equal(got[b, :n], fresh[b, :n])
            torch.testing.assert_close(got[b, :n], fresh[b, :n], rtol=1e-5, atol=1e-5)
            if r in held:
                assert torch.equal(got[b, :n], first[r])
            first.setdefault(r, got[b, :n].clone())
    stats = cache.stats()
    if budget_rows is None:
        assert stats["cached_sequences"] == 6 and stats["cached_tokens"] == 5 + 9 + 3 + 10 + 7 + 10
        assert (stats["misses"], stats["hits"]) == (6, 9)
        assert len(forwards) == 4 + 2  # the four fresh forwards, the cache's two
    else:  # sequences 0, 1, 2 fit (17 rows); 3, 4, 5 are computed in each of their three batches
        assert stats["cached_sequences"] == 3 and stats["cached_tokens"] == 17
        assert (stats["misses"], stats["hits"]) == (3 + 3 + 1 + 3, 2 + 3)
    cache.close()
    assert cache.stats()["cached_sequences"] == 0


def test_features_round_trip_the_wire_and_store() -> None:
    rows = torch.randn(5, 12)
    back = from_wire(to_wire(rows), 12, "verdicts.features")
    assert torch.equal(back, rows.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"verdicts\.features: 10 bytes"):
        from_wire(b"\0" * 10, 12, "verdicts.features")
    store = FeatureStore((0, 2), 6, num_slots=3, max_len=8, dtype=torch.float32, device="cpu")
    slots, positions = torch.tensor([1]), torch.tensor([[0, 1, 2]])
    store.write_stream(slots, positions, 0, torch.ones(1, 3, 6), None)
    store.write_stream(slots, positions, 1, torch.ones(1, 3, 6), torch.ones(1, 3, 6))  # x + residual
    prev = store.previous(torch.tensor([1]), torch.tensor([[0, 1, 3]]))
    assert torch.equal(prev[0, 0], torch.zeros(12))  # position 0 has no predecessor
    assert torch.equal(prev[0, 1], torch.tensor([1.0] * 6 + [2.0] * 6))
    assert torch.equal(prev[0, 2], prev[0, 1])


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_messages_features_land_in_one_copy_as_each_write_would(device) -> None:
    """put_many (a draft service's features of one message: one copy to the device, through page-locked
    memory on the GPU) stores exactly what each write's rows stored in turn would, message after message."""
    many = FeatureStore((0, 2), 6, num_slots=3, max_len=16, dtype=torch.float32, device=device)
    each = FeatureStore((0, 2), 6, num_slots=3, max_len=16, dtype=torch.float32, device=device)
    torch.manual_seed(0)
    messages = [
        [(1, 0, torch.randn(5, 12)), (2, 3, torch.randn(2, 12)), (0, 7, torch.randn(0, 12))],
        [(1, 5, torch.randn(3, 12))],  # one write
        [(2, 5, torch.randn(9, 12)), (1, 8, torch.randn(1, 12))],  # more rows than the first message
    ]
    for writes in messages:
        wire = [(slot, start, from_wire(to_wire(rows), 12, "features")) for slot, start, rows in writes]
        many.put_many(wire)
        for slot, start, rows in wire:
            each.data[slot, start : start + len(rows)] = rows.to(device, torch.float32)
        assert torch.equal(many.data, each.data)
    assert many.data.abs().sum() > 0


def test_training_computed_each_sequences_features_once(pair) -> None:
    """The fixture's 40 steps of 16 sequences run 20 epochs over its 32 answers: with the cache the target
    computed each answer's features once, in the first epoch, and every later batch read them back."""
    log = [json.loads(line) for line in (pair[2] / "run" / "train.log").read_text().splitlines()]
    sized = next(e for e in log if e["event"] == "feature_cache")
    assert sized["capacity_tokens"] == sized["data_tokens"] > 0
    last = [e for e in log if e["event"] == "train"][-1]
    assert last["step"] == 40 and last["cached_sequences"] == 32
    assert (last["misses"], last["hits"]) == (32, 40 * 16 - 32)


def test_eval_draft_replays_the_held_out_answers_as_training_does(pair, tmp_path) -> None:
    """`specsplit eval-draft`: the target named by the draft's config answers the held-out prompts, and the
    table is feature_acceptance's over those answers; a second run reads the saved answers back and gives
    the same table. A directory without a config is refused naming --draft."""
    from common.training.eval_draft import main as eval_draft_main

    target_dir, draft_dir, _ = pair
    answers, out = tmp_path / "answers.json", tmp_path / "eval.json"
    args = ["--draft", str(draft_dir), "--prompts", "3", "--max-new-tokens", "12", "--k", "1,4",
            "--device", "cpu", "--answers", str(answers), "--out", str(out)]  # fmt: skip
    assert eval_draft_main(args) == 0
    table = json.loads(out.read_text())
    held = json.loads(answers.read_text())
    assert table["prompts"] == len(held["prompts"]) == 3 and table["target"] == str(target_dir.resolve())
    target, draft = load_model(target_dir, Comm()), load_model(draft_dir, Comm())
    for k in (1, 4):
        want = feature_acceptance(draft, target, held["prompts"], held["answers"], k).as_dict()
        assert table["drafts"]["feature"][f"k{k}"] == want
    assert table["drafts"]["feature"]["k4"]["mean_accepted"] > 0
    out.unlink()
    assert eval_draft_main(args) == 0 and json.loads(out.read_text()) == table
    with pytest.raises(SystemExit, match=r"--draft .*: no config\.json"):
        eval_draft_main(["--draft", str(tmp_path)])


def test_checkpoint_holds_the_draft_layer_and_reads_the_rest_from_the_target(pair) -> None:
    target_dir, draft_dir, _ = pair
    draft = load_model(draft_dir, Comm())
    assert isinstance(draft, FeatureDraft)
    assert draft.config.feature_layers == (0, 1, 2) and draft.config.num_hidden_layers == 1
    target = load_model(target_dir, Comm())
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert draft.model.fc.weight.shape == (64, 3 * 64)
    assert draft.markov_head.markov_w2.weight.abs().sum() > 0  # trained (it starts at zero)


def prompts_for(target_dir: Path, n: int) -> list[list[int]]:
    tok = load_tokenizer(target_dir)
    return [tok.encode(t) for t in builtin_prompts.held_out_prompts()[:n]]


@pytest.mark.slow
def test_feature_draft_service_is_lossless_with_features_on_the_wire(pair) -> None:
    target_dir, draft_dir, log_dir = pair
    with running(start_draft(draft_dir, log_dir).wait_ready()) as (draft,):
        target = start_target(target_dir, log_dir, draft, "--draft-feature-layers", LAYERS).wait_ready()
        with running(target):
            spec, _ = speculative_equals_plain(target.address, prompts_for(target_dir, 4), 2, k=4,
                                               max_new_tokens=32)  # fmt: skip
            feature_bytes = target.metric("specsplit_grpc_payload_bytes_total", kind="target_features")
    assert sum(r.usage.drafted_tokens for r in spec) > 0
    assert sum(r.usage.accepted_tokens for r in spec) > 0
    # bf16: 2 bytes x 3 layers x 64 per committed token at least once
    assert feature_bytes >= 2 * 3 * 64 * sum(len(p) for p in prompts_for(target_dir, 4))


@pytest.mark.slow
def test_feature_draft_killed_mid_request_then_back_drafts_for_it_again(pair) -> None:
    """The draft service dies while a long greedy request runs: the target decodes on plainly, and when a
    new draft comes up on the same address the request is started on it again with the features of every
    token it has committed (the new stream's start), then drafted for and accepted until it ends. Its
    output equals plain decoding."""
    target_dir, draft_dir, log_dir = pair
    port = free_port()
    draft = start_draft(draft_dir, log_dir, port=port).wait_ready()
    flags = ("--draft-feature-layers", LAYERS, "--draft-backoff-max", "0.3", "--max-context-length", "2048")
    target = start_target(target_dir, log_dir, draft, *flags, name="target-restart").wait_ready()
    ids = prompts_for(target_dir, 1)[0]
    n = 2048 - len(ids) - 8
    with running(target), grpc.insecure_channel(target.address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        want = generate(stub, request(ids, max_new_tokens=n, k=0)).ids
        box: dict = {}
        thread = threading.Thread(target=lambda: box.update(r=generate(stub, request(ids, max_new_tokens=n))))
        thread.start()
        try:
            wait_for(
                lambda: target.metric("specsplit_spec_accepted_tokens_total") > 10, 60, "accepted drafts"
            )
            draft.popen.kill()
            wait_for(lambda: target.metric("specsplit_draft_connected") == 0, 30, "the target to see it gone")
            with running(start_draft(draft_dir, log_dir, port=port).wait_ready()):
                wait_for(
                    lambda: target.metric("specsplit_draft_connected") == 1, 30, "the target to reconnect"
                )
                assert thread.is_alive(), "the request ended before the draft was back: lengthen it"
                drafted, accepted, sent = (
                    target.metric("specsplit_spec_draft_tokens_total"),
                    target.metric("specsplit_spec_accepted_tokens_total"),
                    target.metric("specsplit_grpc_payload_bytes_total", kind="target_features"),
                )
                thread.join(300)
                assert target.metric("specsplit_draft_reconnects_total") >= 1
                assert target.metric("specsplit_spec_draft_tokens_total") > drafted
                assert target.metric("specsplit_spec_accepted_tokens_total") > accepted
                # The start on the new stream carried a feature row for every committed token but the last
                # (bf16, 3 layers x 64): far more than the running request's verdicts would.
                resent = target.metric("specsplit_grpc_payload_bytes_total", kind="target_features") - sent
                assert resent >= 2 * 3 * 64 * (len(ids) + 50), resent
        finally:
            thread.join(300)
    assert box["r"].ids == want


@pytest.mark.slow
def test_feature_draft_at_tp2_keeps_local_argmax_and_the_replicated_markov_head(pair) -> None:
    """The draft on two gloo ranks: features reach both, the LM head reduces locally (its argmax site
    moves bytes, no logits are gathered), and the drafts are those of one rank: the same acceptance."""
    target_dir, draft_dir, log_dir = pair
    ps = prompts_for(target_dir, 4)
    counts = []
    for tp in ("1", "2"):
        with running(start_draft(draft_dir, log_dir, "--tp-size", tp).wait_ready()) as (draft,):
            target = start_target(target_dir, log_dir, draft, "--draft-feature-layers", LAYERS,
                                  name=f"target-tp{tp}").wait_ready()  # fmt: skip
            with running(target):
                spec, _ = speculative_equals_plain(target.address, ps, 2, k=4, max_new_tokens=32)
            head_bytes = {site: draft.metric("specsplit_tp_comm_bytes_total", site=site)
                          for site in ("lm_head_argmax", "logits_gather", "markov_head")}  # fmt: skip
        counts.append((sum(r.usage.drafted_tokens for r in spec), sum(r.usage.accepted_tokens for r in spec)))
    assert counts[0] == counts[1] and counts[1][1] > 0, counts
    # Two ranks: one (value, index) pair per rank and row at each position; no logits gathered, and the
    # replicated Markov head moves nothing.
    assert head_bytes["lm_head_argmax"] > 0 and head_bytes["logits_gather"] == head_bytes["markov_head"] == 0


@pytest.mark.slow
def test_feature_draft_in_the_target_is_lossless_and_chained(pair) -> None:
    target_dir, draft_dir, log_dir = pair
    profile = log_dir / "profile"
    target = start_target(target_dir, log_dir, None, "--draft-local", f"--model {draft_dir} --metrics-port 0",
                          "--speculation-policy", "fixed", "--profile-dir", str(profile), "--profile-steps",
                          "3,5", name="target-local").wait_ready()  # fmt: skip
    with running(target):
        spec, _ = speculative_equals_plain(
            target.address, prompts_for(target_dir, 4), 2, k=4, max_new_tokens=32
        )
        log = target.log_text()
    assert sum(r.usage.drafted_tokens for r in spec) > 0
    assert sum(r.usage.accepted_tokens for r in spec) > 0
    assert "feature draft: no branches and no draft-ahead" in log
    # --profile-dir: steps 3..7 of the serving loop, profiled (the verify's ops are the scheduler thread's).
    assert json.loads((profile / "summary.json").read_text())["steps"] == 5
    assert "aten::" in (profile / "kernels.txt").read_text()
    assert json.loads((profile / "trace.json").read_text())["traceEvents"]


@pytest.mark.slow
def test_a_new_request_is_drafted_for_from_the_round_chained_to_its_first_verify(pair) -> None:
    """In the target, a new request is started on the draft without a round of its own: its prompt is
    caught up while its first step verifies (no drafts: width 1 at one stream), and the round chained to
    that verify drafts its second step (width k + 1). Output equals plain decoding, drafts accepted."""
    target_dir, draft_dir, log_dir = pair
    trace = log_dir / "warm-steps.jsonl"
    target = start_target(target_dir, log_dir, None, "--draft-local", f"--model {draft_dir} --metrics-port 0",
                          "--speculation-policy", "fixed", "--step-trace", str(trace),
                          name="target-warm").wait_ready()  # fmt: skip
    with running(target):
        spec, _ = speculative_equals_plain(target.address, prompts_for(target_dir, 3), 1, k=4,
                                           max_new_tokens=24)  # fmt: skip
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    firsts = [i for i, s in enumerate(steps) if s["new"]]
    assert len(firsts) == 6, steps  # the plain requests' (k = 0) first steps, then the speculative ones'
    firsts = firsts[3:]
    for i in firsts:
        assert steps[i]["w"] == 1 and steps[i]["B"] == 1, steps[i]
        assert steps[i + 1]["w"] == 5 and not steps[i + 1]["new"], steps[i + 1]
    assert sum(r.usage.drafted_tokens for r in spec) > 0
    assert sum(r.usage.accepted_tokens for r in spec) > 0


@pytest.mark.slow
def test_target_without_features_decodes_plainly_and_says_why(pair) -> None:
    target_dir, draft_dir, log_dir = pair
    with running(start_draft(draft_dir, log_dir).wait_ready()) as (draft,):
        target = start_target(target_dir, log_dir, draft, name="target-nofeat").wait_ready()
        with running(target):
            spec, _ = speculative_equals_plain(target.address, prompts_for(target_dir, 2), 2, k=4,
                                               max_new_tokens=16)  # fmt: skip
            log = target.log_text()
    assert sum(r.usage.drafted_tokens for r in spec) == 0
    assert f"start it with --draft-feature-layers {LAYERS}" in log


@pytest.mark.slow
def test_old_protocol_and_bad_features_get_a_status_naming_the_field(pair) -> None:
    _, draft_dir, log_dir = pair
    start = draft_pb2.DraftRequestStart(request_id=1, token_ids=[1, 2, 3], num_speculative_tokens=2)
    cases = [
        (draft_pb2.SpeculateRequest(step=1, starts=[start], propose=[1]), grpc.StatusCode.FAILED_PRECONDITION,
         "protocol_version"),
        (draft_pb2.SpeculateRequest(step=1, starts=[start], propose=[1], protocol_version=2),
         grpc.StatusCode.INVALID_ARGUMENT, "starts.features: 0 rows"),
    ]  # fmt: skip
    with running(start_draft(draft_dir, log_dir).wait_ready()) as (draft,):
        with grpc.insecure_channel(draft.address) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            info = stub.GetDraftInfo(draft_pb2.GetDraftInfoRequest())
            assert list(info.feature_layers) == [0, 1, 2] and info.feature_size == 3 * 64
            for msg, code, field in cases:
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Speculate(iter([msg]), timeout=30))
                assert err.value.code() == code and field in err.value.details(), err.value.details()
            # The draft serves on: a well-formed stream after the refused ones is answered.
            good = draft_pb2.DraftRequestStart(request_id=1, token_ids=[1, 2, 3], num_speculative_tokens=2,
                                               features=to_wire(torch.zeros(2, 3 * 64)))  # fmt: skip
            msg = draft_pb2.SpeculateRequest(step=1, starts=[good], propose=[1], protocol_version=2)
            (answer,) = list(stub.Speculate(iter([msg]), timeout=30))
            assert len(answer.proposals[0].token_ids) == 2


# 1000 one-token requests, each drafted with the feature draft's sampled top-K: a minute or two on 2 cores.
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.xdist_group("chi_square_feature")
def test_sampled_feature_drafting_keeps_the_target_distribution(pair) -> None:
    """The first generated token over 1000 seeds follows the target's softmax at the prompt (chi-square,
    bins with expected count >= 5 merged, threshold df + 10 * sqrt(2 * df)), with the draft in the target
    sampling from its own top-K (q travels with each proposal)."""
    from common.models.generate import forward_rows

    target_dir, draft_dir, log_dir = pair
    prompt = prompts_for(target_dir, 1)[0]
    model = load_model(target_dir, Comm())
    with torch.inference_mode():
        hidden = forward_rows(model, KVCache.for_model(model, 1, len(prompt) + 1), [0], [0], [prompt])
        p = torch.softmax(model.compute_logits(hidden[0, -1:])[0].double(), -1)
    flags = f"--model {draft_dir} --metrics-port 0 --draft-sampling sampled --no-use-local-argmax-reduction"
    target = start_target(target_dir, log_dir, None, "--draft-local", flags, "--speculation-policy", "fixed",
                          name="target-sampled").wait_ready()  # fmt: skip
    with running(target):
        reqs = [request(prompt, max_new_tokens=1, temperature=1.0, seed=s) for s in range(1000)]
        results = generate_many(target.address, reqs, 16)
    assert sum(r.usage.drafted_tokens for r in results) > 0
    assert_first_tokens_follow([r.ids[0] for r in results], p)
