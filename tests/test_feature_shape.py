"""A feature draft narrower than its target (`train-draft --kind feature --draft-intermediate-size N`):
its MLP keeps the target's last-layer channels that contribute most, and the trained draft loads with
that shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.distributed import Comm
from common.kv_cache import KVCache
from common.loader import load_model
from common.training.feature_train import build_feature_draft, mlp_channels
from common.training.train_draft import main as train_draft_main
from tests.tiny import make_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_model(tmp_path_factory.mktemp("shape") / "target", seed=0, num_layers=3, vocab_size=512,
                           hidden_size=64, intermediate_size=128)  # fmt: skip
    return path, load_model(path, Comm())


def last_mlp_inputs(model, ids: torch.Tensor) -> torch.Tensor:
    seen = []
    hook = model.model.layers[-1].mlp.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    bsz, width = ids.shape
    cache = KVCache.for_model(model, bsz, width)
    with torch.no_grad():
        model(ids, torch.arange(width).expand(bsz, width), torch.arange(bsz), cache, width)
    hook.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])


def test_narrow_mlp_keeps_the_channels_that_contribute_most(target) -> None:
    """On a target whose last-layer channels differ in size (log-normal, as trained MLPs' do)."""
    model = load_model(target[0], Comm())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight.mul_(torch.randn(128, generator=gen).exp())
    calib = torch.randint(0, 512, (4, 24), generator=gen)
    draft = build_feature_draft(model, (0, 1, 2), 8, seed=0, intermediate_size=32, sample_ids=calib)
    assert draft.config.intermediate_size == 32
    mlp = model.model.layers[-1].mlp
    gate, up = mlp.gate_up_proj.weight.split(128)
    down = mlp.down_proj.weight
    x = last_mlp_inputs(model, calib)
    act = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)  # [N, 128]
    score = act.abs().mean(0) * down.norm(dim=0)
    chosen = mlp_channels(model, 32, calib)
    assert chosen.tolist() == sorted(score.topk(32).indices.tolist())
    # The narrow MLP is the full one restricted to those channels, exactly.
    with torch.no_grad():
        narrow = draft.model.layers[0].mlp(x)
    torch.testing.assert_close(narrow, act[:, chosen] @ down[:, chosen].T, rtol=1e-5, atol=1e-5)
    # On other text, the kept channels reproduce the full MLP better than any of 20 random picks.
    other = last_mlp_inputs(model, torch.randint(0, 512, (4, 24), generator=gen))
    act_o = torch.nn.functional.silu(other @ gate.T) * (other @ up.T)
    full = act_o @ down.T

    def error(idx: torch.Tensor) -> float:
        return float((full - act_o[:, idx] @ down[:, idx].T).norm())

    randoms = [error(torch.randperm(128, generator=gen)[:32]) for _ in range(20)]
    assert error(chosen) < min(randoms), (error(chosen), min(randoms))


def test_full_width_is_the_target_last_layer_and_bad_widths_are_refused(target) -> None:
    _, model = target
    draft = build_feature_draft(model, (0, 1, 2), 8, seed=0)
    last = model.model.layers[-1].mlp
    assert torch.equal(draft.model.layers[0].mlp.gate_up_proj.weight, last.gate_up_proj.weight)
    assert torch.equal(draft.model.layers[0].mlp.down_proj.weight, last.down_proj.weight)
    # Without samples the channels are ranked by weight norms alone.
    gate, up = last.gate_up_proj.weight.split(128)
    by_weights = gate.norm(dim=1) * up.norm(dim=1) * last.down_proj.weight.norm(dim=0)
    assert mlp_channels(model, 16).tolist() == sorted(by_weights.topk(16).indices.tolist())
    for bad in (0, 129):
        with pytest.raises(ValueError, match="--draft-intermediate-size"):
            build_feature_draft(model, (0, 1, 2), 8, seed=0, intermediate_size=bad)


def test_trained_narrow_draft_loads_with_its_shape(target, tmp_path: Path) -> None:
    path, _ = target
    args = [
        "--kind", "feature", "--target", str(path), "--out", str(tmp_path / "run"), "--device", "cpu",
        "--seed", "1", "--markov-rank", "8", "--num-prompts", "16", "--max-new-tokens", "24",
        "--temperatures", "0", "--gen-batch-size", "16", "--steps", "6", "--batch-size", "8", "--warmup", "2",
        "--save-dtype", "float32", "--eval-prompts", "2", "--eval-max-new-tokens", "12", "--eval-k", "2",
        "--prompt-set", "coding", "--draft-intermediate-size", "48",
    ]  # fmt: skip
    assert train_draft_main(args) == 0
    draft_dir = tmp_path / "run" / "draft"
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["intermediate_size"] == 48
    assert config["draft_training"]["prompt_set"] == "coding"
    draft = load_model(draft_dir, Comm())
    assert draft.model.layers[0].mlp.down_proj.weight.shape == (64, 48)
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["prompts"] == 2


@pytest.mark.parametrize("tied", [True, False], ids=["tied-target", "own-head-target"])
def test_reduced_vocab_draft_keeps_the_target_head_rows_and_serves_losslessly(
    tied: bool, tmp_path: Path
) -> None:
    """`--draft-vocab N`: the head covers the N tokens the target predicts most in the training data; the
    checkpoint stores d2t and no head, the loader gathers the target's head rows (its embedding when
    tied), and the draft inside the target drafts target ids: greedy output equals plain, with drafts
    made and accepted."""
    from safetensors import safe_open

    from common.training.data import Sequences
    from common.training.feature_train import draft_vocab_ids
    from tests.service_util import running, speculative_equals_plain, start_target
    from tests.test_feature_draft import prompts_for

    target_dir = make_tiny_model(tmp_path / "target", seed=0, num_layers=3, vocab_size=512, hidden_size=64,
                                 tie_word_embeddings=tied)  # fmt: skip
    run = tmp_path / "run"
    args = [
        "--kind", "feature", "--target", str(target_dir), "--out", str(run), "--device", "cpu",
        "--seed", "3", "--markov-rank", "16", "--num-prompts", "32", "--max-new-tokens", "40",
        "--temperatures", "0", "--gen-batch-size", "32", "--steps", "40", "--batch-size", "16",
        "--warmup", "5", "--lr", "3e-3", "--markov-lr", "3e-2", "--log-every", "20",
        "--save-dtype", "float32", "--eval-prompts", "4", "--eval-max-new-tokens", "24", "--eval-k", "1,4",
        "--draft-vocab", "192",
    ]  # fmt: skip
    assert train_draft_main(args) == 0
    draft_dir = run / "draft"
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["draft_vocab_size"] == 192 and config["tie_word_embeddings"] is False
    assert config["shared_weights"]["lm_head_rows"] == "d2t"
    with safe_open(str(draft_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" not in f.keys()
        d2t = f.get_tensor("d2t")
    # The kept ids are the 192 the target predicted most often at trained positions.
    data = Sequences.concat([Sequences.load(p) for p in sorted((run / "data").glob("part-*.safetensors"))])
    ids, coverage = draft_vocab_ids(data.topk_ids[:, 0], data.trained, 192, 512)
    assert torch.equal(torch.arange(192) + d2t, ids) and 0.5 < coverage <= 1.0
    counts = torch.bincount(data.topk_ids[:, 0][data.trained], minlength=512)
    assert counts[ids].min() >= counts[torch.ones(512, dtype=torch.bool).index_fill_(0, ids, False)].max()
    target = load_model(target_dir, Comm())
    draft = load_model(draft_dir, Comm())
    head = target.lm_head.weight
    assert torch.equal(draft.lm_head.weight[:192], head[ids])
    assert draft.map_to_target(torch.arange(192)).tolist() == ids.tolist()

    local = f"--model {draft_dir} --metrics-port 0"
    served = start_target(target_dir, tmp_path, None, "--draft-local", local, "--speculation-policy", "fixed",
                          name="target-reduced").wait_ready()  # fmt: skip
    with running(served):
        spec, _ = speculative_equals_plain(
            served.address, prompts_for(target_dir, 4), 2, k=4, max_new_tokens=32
        )
    assert sum(r.usage.drafted_tokens for r in spec) > 0
    assert sum(r.usage.accepted_tokens for r in spec) > 0


def test_shipped_qwen_coder_draft_is_a_reduced_vocab_feature_draft_of_its_target() -> None:
    """drafts/qwen2.5-coder-1.5b-instruct-feature without its 1.1 GB target: the config and the stored
    tensors agree (one layer reading three target layers, a narrow MLP, a 32768-token head whose rows the
    loader reads from the target through d2t), and d2t maps onto distinct target ids in increasing order."""
    from safetensors import safe_open

    from common.config import ModelConfig

    draft_dir = Path(__file__).resolve().parents[1] / "drafts" / "qwen2.5-coder-1.5b-instruct-feature"
    raw = json.loads((draft_dir / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    assert cfg.feature_layers == (2, 14, 25) and cfg.num_hidden_layers == 1
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.intermediate_size) == (151936, 32768, 1792)
    assert raw["shared_weights"] == {"path": "qwen2.5-coder-1.5b-instruct", "lm_head_rows": "d2t",
                                     "tensors": ["lm_head.weight", "model.embed_tokens.weight"]}  # fmt: skip
    assert (draft_dir / "model.safetensors").stat().st_size <= 64 * 10**6
    with safe_open(str(draft_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        d2t = f.get_tensor("d2t")
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    assert not names & {"lm_head.weight", "model.embed_tokens.weight"}
    ids = torch.arange(32768) + d2t
    assert bool((ids[1:] > ids[:-1]).all()) and 0 <= int(ids[0]) and int(ids[-1]) < 151936
    assert shapes["model.fc.weight"] == (1536, 3 * 1536)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (1536, 1792)
    eval_k4 = json.loads((draft_dir / "eval.json").read_text())["drafts"]["feature"]["k4"]
    assert eval_k4["alpha"] > 0.6 and eval_k4["rounds"] > 500


def test_init_draft_reduces_a_trained_drafts_vocab_keeping_its_logits(target, tmp_path: Path) -> None:
    """`--init-draft DIR --draft-vocab N --steps 0`: a trained full-vocab feature draft re-exported with a
    reduced head. Its layer, fc and Markov W1 are the trained ones, its head and Markov W2 keep the rows of
    the N most predicted ids, so its logits over those ids are the trained draft's."""
    from common.training.data import Sequences
    from common.training.feature_train import draft_vocab_ids

    path, model = target
    common = [
        "--kind", "feature", "--target", str(path), "--device", "cpu", "--seed", "2", "--num-prompts", "16",
        "--max-new-tokens", "24", "--temperatures", "0", "--gen-batch-size", "16", "--batch-size", "8",
        "--warmup", "2", "--save-dtype", "float32", "--eval-prompts", "2", "--eval-max-new-tokens", "12",
        "--eval-k", "2", "--data-dir", str(tmp_path / "data"),
    ]  # fmt: skip
    full_run = [*common, "--out", str(tmp_path / "full"), "--markov-rank", "8", "--steps", "4"]
    assert train_draft_main(full_run) == 0
    full_dir = tmp_path / "full" / "draft"
    reduce = [*common, "--out", str(tmp_path / "reduced"), "--existing-data-only", "--steps", "0",
              "--init-draft", str(full_dir), "--draft-vocab", "160"]  # fmt: skip
    assert train_draft_main(reduce) == 0
    config = json.loads((tmp_path / "reduced" / "draft" / "config.json").read_text())
    assert config["draft_vocab_size"] == 160 and config["shared_weights"]["lm_head_rows"] == "d2t"
    assert config["markov_rank"] == 8 and config["draft_training"]["init_draft"] == str(full_dir)
    trained = json.loads((full_dir / "config.json").read_text())["draft_training"]
    assert config["draft_training"]["init_draft_training"] == trained and trained["steps"] == 4
    table = json.loads((tmp_path / "reduced" / "eval.json").read_text())["drafts"]["feature"]
    assert table["k2"]["rounds"] > 0

    full, reduced = load_model(full_dir, Comm()), load_model(tmp_path / "reduced" / "draft", Comm())
    parts = sorted((tmp_path / "data").glob("part-*.safetensors"))
    data = Sequences.concat([Sequences.load(p) for p in parts])
    ids, _ = draft_vocab_ids(data.topk_ids[:, 0], data.trained, 160, model.config.vocab_size)
    assert reduced.map_to_target(torch.arange(160)).tolist() == ids.tolist()
    for name, param in full.named_parameters():
        if not name.startswith(("lm_head.", "markov_head.markov_w2.", "model.embed_tokens.")):
            assert torch.equal(dict(reduced.named_parameters())[name], param), name
    hidden = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    prev = torch.tensor([1, 5, 9, 40, 77, 300])
    with torch.no_grad():
        want = full.compute_logits(hidden, prev)[:, ids]
        got = reduced.compute_logits(hidden, prev)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert bool(full.markov_head.markov_w2.weight.any())  # a trained Markov head: its rows were compared


def test_init_draft_is_refused_for_a_layer_draft_and_a_non_feature_checkpoint(target, tmp_path: Path) -> None:
    path, _ = target
    with pytest.raises(SystemExit) as e:
        train_draft_main(["--target", str(path), "--out", str(tmp_path / "x"), "--init-draft", str(path)])
    assert e.value.code == 2  # argparse: --init-draft needs --kind feature
    args = [
        "--kind", "feature", "--target", str(path), "--out", str(tmp_path / "y"), "--device", "cpu",
        "--num-prompts", "4", "--max-new-tokens", "8", "--temperatures", "0", "--steps", "0",
        "--init-draft", str(path), "--eval-prompts", "1",
    ]  # fmt: skip
    with pytest.raises(SystemExit, match=r"--init-draft .*not a feature draft"):
        train_draft_main(args)


def test_held_out_table_counts_second_choices_and_tokens_outside_the_draft_vocab(target) -> None:
    """feature_acceptance's first-position figures: a full-vocab draft can propose every token (none out of
    vocab), and its first or second choice covers at least what its first choice accepts (at k = 1 the
    agreement); a draft whose reduced vocab holds none of the answers' tokens has every round's first
    target token out of vocab, none in its top two, and accepts nothing."""
    from common.training.feature_train import feature_acceptance
    from common.training.measure import target_texts

    _, model = target
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (6,), generator=gen).tolist() for _ in range(3)]
    answers = target_texts(model, prompts, 20, eos=set())  # the target's greedy continuations
    full = build_feature_draft(model, (0, 1, 2), 8, seed=0)
    one = feature_acceptance(full, model, prompts, answers, 1)
    assert one.first_out_of_vocab == 0 and one.rounds > 0
    # An untrained draft that starts as the target's last layer agrees now and then, not always.
    assert 0 < one.agreement < one.first_top2 < 1, one
    assert one.as_dict()["first_top2"] == round(one.first_top2, 4)
    # A vocab of the ids no answer holds: no answer token can be proposed.
    seen = {t for a in answers for t in a}
    unseen = torch.tensor(sorted(set(range(512)) - seen))
    outside = build_feature_draft(model, (0, 1, 2), 8, seed=0, vocab_ids=unseen)
    none = feature_acceptance(outside, model, prompts, answers, 4)
    assert (none.first_out_of_vocab, none.first_top2, none.mean_accepted) == (1.0, 0.0, 0.0)
    assert none.rounds == sum(len(a) for a in answers)  # each round commits only the target's token
