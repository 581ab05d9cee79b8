"""Single-process tests of the core engine: model numerics vs an independent reference, KV cache
semantics, shape invariance, checkpoint loading and its errors, tokenizer, tiny-model writer."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from common.config import ModelConfig
from common.distributed import Comm, comm_stats, reset_comm_stats
from common.kv_cache import KVCache, SlotTable
from common.layers.logits import LogitsProcessor, top_tokens
from common.layers.vocab import ParallelLMHead, pad_vocab_size
from common.loader import check_local_argmax, load_model, load_tokenizer
from common.models.generate import forward_rows, greedy_generate
from common.tiny import main as tiny_main
from tests.tiny import make_tiny_model

ATOL = 1e-5


# ---------------------------------------------------------------- independent reference (no cache, per head)
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_ref(x, pos, inv_freq):
    # x [T, heads, hd]; rotate-half layout
    ang = pos[:, None].double() * inv_freq.double()[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x.double() * cos + rot.double() * sin).float()


def reference_hidden(ckpt: dict, cfg: ModelConfig, ids: list[int], inv_freq: torch.Tensor) -> torch.Tensor:
    """Full-sequence recompute from raw checkpoint tensors: [T, hidden] after the final norm."""
    t = lambda name: ckpt[name].float()
    T, hd, eps = len(ids), cfg.head_dim, cfg.rms_norm_eps
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    x = t("model.embed_tokens.weight")[torch.tensor(ids)]
    pos = torch.arange(T)
    causal = torch.ones(T, T).tril().bool()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, t(p + "input_layernorm.weight"), eps)
        proj = {}
        for name in ("q", "k", "v"):
            y = h @ t(p + f"self_attn.{name}_proj.weight").T
            if cfg.attention_bias:
                y = y + t(p + f"self_attn.{name}_proj.bias")
            proj[name] = y.view(T, -1, hd)
        q, k, v = proj["q"], proj["k"], proj["v"]
        if cfg.qk_norm:
            q, k = (
                _rms(q, t(p + "self_attn.q_norm.weight"), eps),
                _rms(k, t(p + "self_attn.k_norm.weight"), eps),
            )
        q, k = _rope_ref(q, pos, inv_freq), _rope_ref(k, pos, inv_freq)
        heads = []
        for head in range(cfg.num_attention_heads):
            s = q[:, head] @ k[:, head // group].T / math.sqrt(hd)
            heads.append(s.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, head // group])
        x = x + torch.cat(heads, -1) @ t(p + "self_attn.o_proj.weight").T
        h = _rms(x, t(p + "post_attention_layernorm.weight"), eps)
        gate, up = h @ t(p + "mlp.gate_proj.weight").T, h @ t(p + "mlp.up_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ t(p + "mlp.down_proj.weight").T
    return _rms(x, t("model.norm.weight"), eps)


def _inv_freq_default(cfg):
    return 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).double() / cfg.head_dim)


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), seed=1)


# ---------------------------------------------------------------- numerics
@pytest.mark.parametrize(
    "arch,kw",
    [
        ("Qwen3ForCausalLM", {}),
        ("Qwen2ForCausalLM", {"tie_word_embeddings": False, "num_kv_heads": 1}),
        ("LlamaForCausalLM", {"tie_word_embeddings": False, "num_kv_heads": 4}),
    ],
)
def test_prefill_matches_reference(tmp_path, arch, kw):
    path = make_tiny_model(tmp_path, seed=3, architecture=arch, **kw)
    model = load_model(path, Comm())
    ckpt = load_file(path / "model.safetensors")
    ids = [5, 77, 300, 2, 9, 411, 128, 64, 1, 0, 33]
    cache = KVCache.for_model(model, 2, 32)
    hidden = forward_rows(model, cache, [1], [0], [ids])[0]
    ref = reference_hidden(ckpt, model.config, ids, _inv_freq_default(model.config))
    torch.testing.assert_close(hidden, ref, atol=ATOL, rtol=0)


def test_llama3_rope_scaling_inv_freq():
    from common.layers.rotary import rope_inv_freq

    base = 1.0 / 10000.0 ** (torch.arange(0, 64, 2).double() / 64)
    scaled = rope_inv_freq(64, 10000.0, LLAMA3_SCALING).double()
    wavelen = 2 * math.pi / base
    high = wavelen < 64 / 4  # short wavelengths: untouched
    low = wavelen > 64 / 1  # long wavelengths: slowed by `factor`
    assert high.any() and low.any() and (~high & ~low).any()
    torch.testing.assert_close(scaled[high], base[high], rtol=1e-6, atol=0)
    torch.testing.assert_close(scaled[low], base[low] / 8.0, rtol=1e-6, atol=0)
    mid = ~high & ~low  # interpolated: strictly between the two
    assert ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8.0)).all()


def test_llama3_scaled_model_uses_scaled_rope(tmp_path):
    path = make_tiny_model(
        tmp_path, architecture="LlamaForCausalLM", rope_scaling=LLAMA3_SCALING, head_dim=32
    )
    model = load_model(path, Comm())
    from common.layers.rotary import rope_inv_freq

    ids = list(range(40, 90))
    hidden = forward_rows(model, KVCache.for_model(model, 1, 64), [0], [0], [ids])[0]
    ref = reference_hidden(
        load_file(path / "model.safetensors"), model.config, ids, rope_inv_freq(32, 10000.0, LLAMA3_SCALING)
    )
    torch.testing.assert_close(hidden, ref, atol=ATOL, rtol=0)


def test_kv_cache_prefill_decode_verify_rollback_and_slot_reuse(qwen3):
    """Every step's outputs equal a from-scratch recompute of that row's whole committed sequence."""
    model = load_model(qwen3, Comm())
    ckpt = load_file(qwen3 / "model.safetensors")
    inv = _inv_freq_default(model.config)
    cache, table = KVCache.for_model(model, 4, 64), SlotTable(4)
    gen = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, 512, (n,), generator=gen).tolist()
    seqs = {table.alloc(): rand(n) for n in (9, 3, 6)}

    def step(rows: dict[int, list[int]]):
        slots = list(rows)
        starts = [table.lengths[s] for s in slots]
        hidden = forward_rows(model, cache, slots, starts, [rows[s] for s in slots])
        for b, s in enumerate(slots):
            table.lengths[s] += len(rows[s])
            full = seqs[s][: table.lengths[s]]
            ref = reference_hidden(ckpt, model.config, full, inv)[starts[b] :]
            torch.testing.assert_close(hidden[b, : len(rows[s])], ref, atol=ATOL, rtol=0)

    step({s: seqs[s] for s in seqs})  # ragged prefill
    for s in seqs:
        seqs[s] += rand(1)
    step({s: seqs[s][-1:] for s in seqs})  # decode
    for s in seqs:
        seqs[s] += rand(4)
    step({s: seqs[s][-4:] for s in seqs})  # verify k+1 = 4
    for s, keep in zip(list(seqs), (1, 4, 0)):  # roll back: accepted `keep` of the 4
        table.lengths[s] -= 4 - keep
        seqs[s] = seqs[s][: table.lengths[s]] + rand(3)
    step({s: seqs[s][table.lengths[s] :] for s in seqs})  # re-verify over stale KV
    table.free(1)  # slot 1 leaves; a new request reuses it alongside decodes of the others
    assert table.alloc() == 1
    seqs[1] = rand(5)
    for s in (0, 2):
        seqs[s] += rand(1)
    step({0: seqs[0][-1:], 1: seqs[1], 2: seqs[2][-1:]})


def test_shape_and_batch_invariance(qwen3, capsys):
    """The hidden of a token is the same computed by L=1 decode, inside an L=5 verify, at B=1 or B=7."""
    model = load_model(qwen3, Comm())
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (12, 5, 17, 8, 3, 11, 9)]
    nxt = [torch.randint(0, 512, (5,), generator=gen).tolist() for _ in prompts]

    def run(batch: list[int], one_by_one: bool) -> torch.Tensor:
        cache = KVCache.for_model(model, 7, 64)
        forward_rows(model, cache, batch, [0] * len(batch), [prompts[i] for i in batch])
        if not one_by_one:
            return forward_rows(
                model, cache, batch, [len(prompts[i]) for i in batch], [nxt[i] for i in batch]
            )
        outs = []
        for j in range(5):
            starts = [len(prompts[i]) + j for i in batch]
            outs.append(forward_rows(model, cache, batch, starts, [[nxt[i][j]] for i in batch]))
        return torch.cat(outs, 1)

    verify_b7, decode_b7 = run(list(range(7)), False), run(list(range(7)), True)
    verify_b1 = torch.cat([run([i], False) for i in range(7)])
    decode_b1 = torch.cat([run([i], True) for i in range(7)])
    diffs = {
        "L=5 vs L=1 (B=7)": (verify_b7 - decode_b7).abs().max().item(),
        "B=7 vs B=1 (L=5)": (verify_b7 - verify_b1).abs().max().item(),
        "B=7 vs B=1 (L=1)": (decode_b7 - decode_b1).abs().max().item(),
    }
    with capsys.disabled():
        print(f"\nshape invariance, max |diff| of fp32 hidden: {diffs}")
    assert max(diffs.values()) <= ATOL, diffs


def test_greedy_generate_batched_equals_single(qwen3):
    model = load_model(qwen3, Comm())
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9], [100, 200, 300]]
    batched = greedy_generate(model, prompts, 24)
    assert batched == [greedy_generate(model, [p], 24)[0] for p in prompts]
    assert all(len(set(out)) > 4 for out in batched), "tiny model should not collapse to one token"


# ---------------------------------------------------------------- logits, local argmax, Markov, d2t
def test_logits_processor_soft_cap_then_scale(tmp_path):
    path = make_tiny_model(tmp_path, vocab_size=300, final_logit_softcapping=2.0, logit_scale=0.5)
    model = load_model(path, Comm())
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    raw = hidden @ load_file(path / "model.safetensors")["model.embed_tokens.weight"].T
    expected = torch.tanh(raw / 2.0) * 2.0 * 0.5
    logits = model.compute_logits(hidden)
    assert logits.shape == (6, 300) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)


def test_logits_stay_in_the_model_dtype_only_where_that_is_exact(tmp_path):
    """upcast=False (the target's step): a bf16 model's logits stay bf16, the same values as the fp32
    logits (an exact upcast); with a soft-cap or scale they are processed in fp32 as before."""
    plain = load_model(make_tiny_model(tmp_path / "plain", vocab_size=300), Comm(), dtype=torch.bfloat16)
    capped = load_model(
        make_tiny_model(tmp_path / "capped", vocab_size=300, final_logit_softcapping=2.0, logit_scale=0.5),
        Comm(),
        dtype=torch.bfloat16,
    )
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    raw, full = plain.compute_logits(hidden, upcast=False), plain.compute_logits(hidden)
    assert raw.dtype == torch.bfloat16 and full.dtype == torch.float32 and raw.shape == full.shape == (6, 300)
    assert torch.equal(raw.float(), full)
    processed = capped.compute_logits(hidden, upcast=False)
    assert processed.dtype == torch.float32 and torch.equal(processed, capped.compute_logits(hidden))


def test_top_tokens_ties_and_padding_single_rank():
    """Integer weights force exact ties (lowest id must win) and all-negative rows (padding must not win)."""
    gen = torch.Generator().manual_seed(0)
    vocab, dim = 100, 4  # padded to 128: 28 zero rows that would score 0
    head = ParallelLMHead(vocab, dim, Comm())
    head.weight.zero_()
    head.weight[:vocab] = torch.randint(0, 3, (vocab, dim), generator=gen).float() + 0.5
    hidden = torch.randint(-1, 2, (64, dim), generator=gen).float()
    hidden[:8] = -1.0  # every real logit < 0 = padding's score: only masking keeps padding out
    proc = LogitsProcessor(soft_cap=3.0, scale=2.0)
    full = proc(head, hidden)
    ref = full.argmax(-1)
    assert (full.max(-1, keepdim=True).values == full).sum(-1).gt(1).sum() > 30, "test needs ties"
    assert (full[:8] < 0).all()
    got = top_tokens(proc.local_scores(head, hidden), head)
    assert torch.equal(got, ref)
    assert (got < vocab).all()


def test_draft_with_markov_and_d2t_greedy_step(tmp_path):
    base = make_tiny_model(tmp_path / "base", seed=2, vocab_size=500)
    draft = make_tiny_model(
        tmp_path / "draft",
        seed=3,
        base=base,
        share_layers=1,
        num_layers=1,
        markov_rank=8,
        draft_vocab_size=300,
    )
    model = load_model(draft, Comm())
    ckpt = load_file(draft / "model.safetensors")
    assert model.config.draft_vocab_size == 300 and model.d2t is not None
    draft_ids = torch.tensor([0, 5, 299])
    assert torch.equal(model.map_to_target(draft_ids), draft_ids + ckpt["d2t"][draft_ids])
    hidden = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
    prev = torch.tensor([3, 499, 0, 17, 256, 3, 42, 7, 100, 400])
    bias = ckpt["markov_head.markov_w1.weight"][prev] @ ckpt["markov_head.markov_w2.weight"].T
    lm = hidden @ ckpt["lm_head.weight"].T
    torch.testing.assert_close(model.compute_logits(hidden, prev), lm + bias, atol=1e-5, rtol=0)
    for use_local in (False, True):
        model.use_local_argmax_reduction = use_local
        for p in (None, prev):
            expected = model.map_to_target(model.compute_logits(hidden, p).argmax(-1))
            assert torch.equal(model.greedy_draft_tokens(hidden, p), expected)
    assert not torch.equal(
        model.compute_logits(hidden, prev).argmax(-1), model.compute_logits(hidden).argmax(-1)
    )
    assert comm_stats() == {} or all(calls == 0 for calls, _ in comm_stats().values())


def test_local_argmax_switch_validation(qwen3):
    with pytest.raises(ValueError, match=r"use_local_argmax_reduction.*draft_sampling='sampled'"):
        load_model(qwen3, Comm(), use_local_argmax_reduction=True, draft_sampling="sampled")
    with pytest.raises(ValueError, match="draft_sampling='top_k'"):
        load_model(qwen3, Comm(), draft_sampling="top_k")
    with pytest.raises(ValueError, match="has no get_top_tokens"):
        check_local_argmax(torch.nn.Linear(2, 2), True, "greedy")
    check_local_argmax(torch.nn.Linear(2, 2), False, "sampled")  # switch off: anything goes
    model = load_model(qwen3, Comm(), use_local_argmax_reduction=True)
    assert model.use_local_argmax_reduction


# ---------------------------------------------------------------- checkpoints
def test_tiny_model_deterministic_and_sharded_round_trip(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=7, markov_rank=4)
    b = make_tiny_model(tmp_path / "b", seed=7, markov_rank=4, num_shards=3)
    c = make_tiny_model(tmp_path / "c", seed=8, markov_rank=4)
    assert (a / "model.safetensors").read_bytes() == make_tiny_model(
        tmp_path / "a2", seed=7, markov_rank=4
    ).joinpath("model.safetensors").read_bytes()
    index = json.loads((b / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    ma, mb, mc = (load_model(p, Comm()) for p in (a, b, c))
    for (name, pa), (_, pb), (_, pc) in zip(
        ma.named_parameters(), mb.named_parameters(), mc.named_parameters()
    ):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name


def test_rank_loads_only_its_slice(tmp_path):
    """Rank 1 of 2 holds exactly its rows/columns of each sharded tensor, vocab padding zeroed."""
    path = make_tiny_model(tmp_path, vocab_size=500, tie_word_embeddings=False)
    full = load_file(path / "model.safetensors")
    model = load_model(path, Comm(rank=1, world_size=2))  # no collective is needed to build and load
    padded = pad_vocab_size(500, 2)
    assert padded == 512
    emb = model.model.embed_tokens.weight
    assert emb.shape == (256, 64)
    assert torch.equal(emb[: 500 - 256], full["model.embed_tokens.weight"][256:]) and not emb[244:].any()
    attn = model.model.layers[0].self_attn
    # Merged qkv: this rank's [q rows 32:64 | k rows 16:32 | v rows 16:32], each from its own tensor.
    q, k, v = attn.qkv_proj.weight.split([32, 16, 16])
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"][32:])
    assert torch.equal(k, full["model.layers.0.self_attn.k_proj.weight"][16:])
    assert torch.equal(v, full["model.layers.0.self_attn.v_proj.weight"][16:])
    gate, up = model.model.layers[1].mlp.gate_up_proj.weight.split([64, 64])
    assert torch.equal(gate, full["model.layers.1.mlp.gate_proj.weight"][64:])
    assert torch.equal(up, full["model.layers.1.mlp.up_proj.weight"][64:])
    assert torch.equal(attn.o_proj.weight, full["model.layers.0.self_attn.o_proj.weight"][:, 32:])
    assert torch.equal(
        model.model.layers[1].mlp.down_proj.weight, full["model.layers.1.mlp.down_proj.weight"][:, 64:]
    )
    assert torch.equal(attn.q_norm.weight, full["model.layers.0.self_attn.q_norm.weight"])


def _rewrite(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_loading_errors_name_the_problem(tmp_path):
    path = make_tiny_model(tmp_path / "m", tie_word_embeddings=False)
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(path, Comm())

    path = make_tiny_model(tmp_path / "s")
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}))
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(64, 64\), expected \(32, 64\)",
    ):
        load_model(path, Comm())

    path = make_tiny_model(tmp_path / "arch")
    cfg = json.loads((path / "config.json").read_text())
    for edit, pattern in (
        ({"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM.*unsupported architecture"),
        ({"head_dim": None, "hidden_size": 66}, "hidden_size=66 is not divisible by num_attention_heads=4"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not divisible by num_key_value_heads=3"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
        ({"intermediate_size": None}, None),
    ):
        bad = dict(cfg, **edit)
        if pattern is None:
            del bad["intermediate_size"]
            pattern = "missing required field 'intermediate_size'"
        (path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=pattern):
            load_model(path, Comm())
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp_size=4"):
        load_model(path, Comm(rank=0, world_size=4))
    with pytest.raises(ValueError, match="intermediate_size=128 is not divisible by tp_size=3"):
        make_tiny_model(tmp_path / "t3", num_heads=6, num_kv_heads=3, head_dim=16)
        load_model(tmp_path / "t3", Comm(rank=0, world_size=3))
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        load_model(path, Comm())


def test_draft_from_base_shares_weights(tmp_path):
    base = make_tiny_model(tmp_path / "base", seed=0, num_layers=3)
    assert (
        tiny_main([str(tmp_path / "draft"), "--base", str(base), "--share-layers", "1", "--num-layers", "2"])
        == 0
    )
    with (
        safe_open(str(base / "model.safetensors"), "pt") as fb,
        safe_open(str(tmp_path / "draft/model.safetensors"), "pt") as fd,
    ):
        assert torch.equal(
            fb.get_tensor("model.layers.0.mlp.up_proj.weight"),
            fd.get_tensor("model.layers.0.mlp.up_proj.weight"),
        )
        assert not torch.equal(
            fb.get_tensor("model.layers.1.mlp.up_proj.weight"),
            fd.get_tensor("model.layers.1.mlp.up_proj.weight"),
        )
        assert torch.equal(
            fb.get_tensor("model.embed_tokens.weight"), fd.get_tensor("model.embed_tokens.weight")
        )


# ---------------------------------------------------------------- tokenizer, slots, comm
def test_tokenizers(tmp_path, qwen3):
    # Tiny models ship a BPE tokenizer.json trained on a fixed paragraph.
    tok = load_tokenizer(qwen3)
    assert not tok.is_byte_level and 256 < tok.vocab_size <= 512 and tok.eos_token_id is None
    assert tok.decode(tok.encode("the draft service")) == "the draft service"
    bare = make_tiny_model(tmp_path / "bare", tokenizer=False)
    tok = load_tokenizer(bare)
    assert tok.is_byte_level and tok.vocab_size == 256 and tok.eos_token_id is None
    text = "héllo, wörld"
    assert tok.decode(tok.encode(text)) == text
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("hello world zzz") == [1, 2, 0] and tok.eos_token_id == 3 and tok.vocab_size == 4
    assert tok.decode([1, 2]) == "hello world"


def test_slot_table():
    table = SlotTable(2)
    assert [table.alloc(), table.alloc()] == [0, 1] and table.num_free == 0 and table.num_used == 2
    with pytest.raises(RuntimeError, match="all 2 slots are in use"):
        table.alloc()
    table.lengths[1] = 17
    table.free(1)
    with pytest.raises(ValueError, match="slot 1 is not allocated"):
        table.free(1)
    assert table.alloc() == 1 and table.lengths[1] == 0


def test_single_rank_comm_counts_nothing():
    reset_comm_stats()
    comm = Comm()
    t = torch.ones(4)
    assert comm.all_reduce(t, "attn_out") is t and comm.all_gather(t, "lm_head_argmax") is t
    assert comm.broadcast_object({"a": 1}, 0, "step_broadcast") == {"a": 1}
    assert comm_stats() == {}
