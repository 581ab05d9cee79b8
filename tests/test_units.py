"""Unit tests of service building blocks: stop-string streaming, flag/env parsing, draft-ahead policy,
the draft's rollback rule."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.settings import ServiceConfig, flag, parse_config
from common.tokenizer import load_tokenizer
from draft_service.state import DraftRequest, DraftState, Proposal, common_prefix
from target_service.detok import StreamDetokenizer
from tests.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(make_tiny_model(tmp_path_factory.mktemp("tok") / "m", num_layers=1))


def stream(tokenizer, ids, stops, step=1):
    detok = StreamDetokenizer(tokenizer, stops)
    texts, id_chunks, stopped = [], [], False
    for i in range(0, len(ids), step):
        delta = detok.push(ids[i : i + step])
        texts.append(delta.text)
        id_chunks += delta.token_ids
        if delta.stopped:
            stopped = True
            break
    if not stopped:
        rest = detok.flush()
        texts.append(rest.text)
        id_chunks += rest.token_ids
    return texts, id_chunks, stopped


@pytest.mark.parametrize("step", [1, 3])
def test_stop_string_is_never_streamed_even_in_part(tokenizer, step):
    text = "the draft service proposes tokens and the target service checks them"
    ids = tokenizer.encode(text)
    stop = "target service"
    texts, sent_ids, stopped = stream(tokenizer, ids, [stop], step)
    assert stopped
    assert "".join(texts) == text[: text.index(stop)]
    for i in range(1, len(texts) + 1):  # no prefix of what was streamed ends in a piece of the stop string
        so_far = "".join(texts[:i])
        assert not any(so_far.endswith(stop[:n]) for n in range(2, len(stop) + 1)), so_far
    assert tokenizer.decode(sent_ids).startswith(text[: text.index(stop)])


def test_without_a_stop_everything_is_streamed_and_ids_match_text(tokenizer):
    text = "speculative decoding keeps the output distribution"
    ids = tokenizer.encode(text)
    texts, sent_ids, stopped = stream(tokenizer, ids, ["zzz-never"], 2)
    assert not stopped and "".join(texts) == text and sent_ids == ids


@pytest.mark.parametrize("byte_level", [False, True])
def test_ids_without_text_are_released_at_once(tokenizer, byte_level):
    """Ids past the tokenizer's vocabulary (a model's padding rows; a random-weight model samples them)
    and special tokens have no text: each push releases its ids at once, never held for text to come."""
    tok = load_tokenizer("/nonexistent-dir-uses-byte-level") if byte_level else tokenizer
    specials = [] if byte_level else [i for i, t in tok._hf.get_added_tokens_decoder().items() if t.special]
    assert byte_level or specials  # the tiny tokenizer has <|endoftext|>
    detok = StreamDetokenizer(tok, [])
    for i in [tok.vocab_size, tok.vocab_size + 7, *specials, 10**6]:
        assert detok.push([i]).token_ids == [i]
    assert detok.push(tok.encode("ok")).text == "ok"


def test_incomplete_utf8_is_held_back():
    byte_level = load_tokenizer("/nonexistent-dir-uses-byte-level")
    ids = list("héllo".encode())  # 'é' is two bytes
    detok = StreamDetokenizer(byte_level, [])
    first = detok.push(ids[:2])  # 'h' and the first byte of 'é'
    assert first.text == "h" and first.token_ids == ids[:1]
    rest = detok.push(ids[2:])
    assert first.text + rest.text == "héllo" and first.token_ids + rest.token_ids == ids


@dataclass
class _Config(ServiceConfig):
    ratio: float = flag(0.5, "a ratio")
    fancy: bool = flag(False, "a switch")


def test_flags_beat_env_which_beats_defaults(monkeypatch):
    monkeypatch.setenv("SPECSPLIT_RATIO", "0.25")
    monkeypatch.setenv("SPECSPLIT_FANCY", "true")
    cfg = parse_config(_Config, ["--model", "m"], "prog")
    assert cfg.ratio == 0.25 and cfg.fancy is True and cfg.port == 50051
    cfg = parse_config(_Config, ["--model", "m", "--ratio", "0.75", "--no-fancy"], "prog")
    assert cfg.ratio == 0.75 and cfg.fancy is False


def test_bad_flags_and_env_name_the_flag(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse_config(_Config, [], "prog")
    assert "--model" in capsys.readouterr().err
    monkeypatch.setenv("SPECSPLIT_FANCY", "maybe")
    with pytest.raises(SystemExit):
        parse_config(_Config, ["--model", "m"], "prog")
    assert "SPECSPLIT_FANCY" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(_Config, ["--model", "m", "--device", "tpu"], "prog")


@pytest.mark.parametrize("window", ["200", "a,b", "5,0", "-1,10"])
def test_a_bad_profile_window_names_the_flag(window, capsys):
    from target_service.config import TargetConfig

    with pytest.raises(SystemExit):
        argv = ["--model", "m", "--profile-dir", "/tmp/p", "--profile-steps", window]
        parse_config(TargetConfig, argv, "t")
    assert "--profile-steps" in capsys.readouterr().err


class _NoRunner:
    max_len = 1000
    num_branch_slots = branch_slot_offset = 0  # no branches


def test_verdicts_roll_the_draft_kv_back_to_the_common_prefix():
    state = DraftState(_NoRunner(), slots=None)  # bookkeeping only: no model involved
    req = DraftRequest(1, 0, committed=[1, 2, 3], kv_tokens=[1, 2, 3, 9, 9], k=2, temperature=0.0, seed=0)
    state.apply_verdict(req, 3, [9, 7])  # first drafted token accepted, then a correction
    assert req.committed == [1, 2, 3, 9, 7] and req.kv_tokens == [1, 2, 3, 9]
    state.apply_verdict(req, 5, [4])
    assert req.kv_tokens == [1, 2, 3, 9] and req.committed[-1] == 4  # at least one token stays pending
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0


def test_draft_ahead_hit_and_miss():
    state = DraftState(_NoRunner(), slots=None)
    req = DraftRequest(1, 0, committed=[1, 2], kv_tokens=[1], k=2, temperature=0.0, seed=0)
    req.ahead_expect, req.ahead = [1, 2, 5, 6, 8], Proposal([10, 11])
    assert state.apply_verdict(req, 2, [5, 6, 8]) is True and req.ready.tokens == [10, 11]
    req.ahead_expect, req.ahead = [1, 2, 5, 6, 8, 10, 11, 3], Proposal([12, 13])
    assert state.apply_verdict(req, 5, [10, 4]) is False and req.ready is None
    assert (state.ahead_hits, state.ahead_misses) == (1, 1)


def test_draft_ahead_pauses_below_the_hit_rate_and_probes_again():
    state = DraftState(_NoRunner(), slots=None)
    state.ahead_hit_rate = 0.05
    decisions = [state.ahead_worthwhile(0.15) for _ in range(40)]
    assert decisions.count(True) == 2  # one probe every 17th round
    state.ahead_hit_rate = 0.5
    assert all(state.ahead_worthwhile(0.15) for _ in range(5))
    assert state.ahead_worthwhile(0.0)
    # 16 rows at a 0.5 hit rate: all 16 hit with chance 1.5e-5, so only the probe rounds draft ahead.
    decisions = [state.ahead_worthwhile(0.15, rows=16) for _ in range(34)]
    assert decisions.count(True) == 2
    state.ahead_hit_rate = 0.9  # 0.9^16 = 0.185: worth it
    assert all(state.ahead_worthwhile(0.15, rows=16) for _ in range(5))


def test_malformed_draft_proposals_are_dropped():
    from specsplit.v1 import draft_pb2
    from target_service.draft_session import Proposal, checked_proposal

    good = draft_pb2.Proposal(request_id=1, token_ids=[5, 6, 7], top_k=2, topk_ids=[5, 9, 6, 1, 7, 2],
                              topk_probs=[0.75, 0.25, 0.5, 0.5, 1.0, 0.0])  # fmt: skip
    assert checked_proposal(good, 2, 512) == Proposal([5, 6], [5, 9, 6, 1], [0.75, 0.25, 0.5, 0.5], 2)
    greedy = draft_pb2.Proposal(token_ids=[3, 4])  # one-hot q
    assert checked_proposal(greedy, 4, 512) == Proposal([3, 4])
    assert checked_proposal(None, 4, 512) == Proposal([])
    assert checked_proposal(good, 0, 512) == Proposal([])
    bad = [
        draft_pb2.Proposal(token_ids=[5], top_k=2, topk_ids=[5, 9], topk_probs=[1.0]),  # lengths differ
        draft_pb2.Proposal(token_ids=[5], top_k=2, topk_ids=[8, 9], topk_probs=[0.5, 0.5]),  # token not in q
        draft_pb2.Proposal(token_ids=[5], top_k=2, topk_ids=[5, 9], topk_probs=[0.9, 0.9]),  # sums to 1.8
        draft_pb2.Proposal(token_ids=[5], top_k=2, topk_ids=[5, 9], topk_probs=[float("nan"), 1.0]),
        draft_pb2.Proposal(token_ids=[5, 512]),  # a token outside the vocabulary (512)
        draft_pb2.Proposal(token_ids=[5], top_k=2, topk_ids=[5, 600], topk_probs=[0.5, 0.5]),  # q outside it
    ]
    for p in bad:
        assert checked_proposal(p, 4, 512) == Proposal([]), p


@pytest.mark.parametrize("byte_level", [False, True])
def test_windowed_decoding_streams_exactly_the_full_decode(tokenizer, byte_level):
    """Random ids, including bytes that split UTF-8 characters: the streamed text, flushed, equals one
    decode of the whole output, and the streamed ids are the output."""
    import random

    tok = load_tokenizer("/nonexistent-dir-uses-byte-level") if byte_level else tokenizer
    rng = random.Random(3)
    ids = [rng.randrange(256 if byte_level else tok.vocab_size) for _ in range(400)]
    detok = StreamDetokenizer(tok, ["zzzz"])
    texts, sent = [], []
    for i in range(0, len(ids), 5):
        delta = detok.push(ids[i : i + 5])
        texts.append(delta.text)
        sent += delta.token_ids
    rest = detok.flush()
    assert "".join(texts) + rest.text == tok.decode(ids)
    assert sent + rest.token_ids == ids
