"""Training a feature draft (common/models/feature_draft.py) with training-time test (EAGLE-3).

At serving time a feature draft's first position reads target features and each later one reads the
draft's own output stream from the position before. Training unrolls the same chain `depth` times over
whole sequences at once: step 0 reads fc(target features at p - 1) at every position p; step j reads
step j - 1's aux stream at p - 1. Step j's query at p sees what the served draft would see at the j-th
drafted position: step 0's keys at positions <= p - j (written from target features) and step i's key
at position p - j + i for i = 1..j (the drafted positions before it, and its own). Every step predicts
t_{p+1} against the target's top-K there; step j's loss weighs DECAY**j.

The token a drafted position reads is the true next token: a draft's later positions only count when the
earlier ones were accepted, i.e. equal to the target's tokens.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from common.distributed import Comm
from common.kernels.fused import apply_rotary_reference
from common.kv_cache import KVCache
from common.models.feature_draft import FeatureDraft
from common.models.transformer import Transformer
from common.training.measure import Acceptance, solve_alpha

DECAY = 0.8  # weight of unrolled step j's loss: DECAY**j (EAGLE-3's)


def build_feature_draft(
    target: Transformer,
    layers: tuple[int, ...],
    markov_rank: int,
    seed: int,
    device="cpu",
    intermediate_size: int | None = None,
    sample_ids: Tensor | None = None,
    vocab_ids: Tensor | None = None,
) -> FeatureDraft:
    """A float32 feature draft for `target`, reading the streams entering `layers`. Its layer starts as the
    target's last one reading only the fused stream, and fc as the pick of the highest captured stream:
    before training it continues the target from that layer on, with one layer. With `intermediate_size`
    below the target's, the MLP keeps that many of the last layer's channels, those contributing most
    (mlp_channels; on `sample_ids` when given). With `vocab_ids` [N] (sorted target ids, draft_vocab_ids)
    the LM head is the target's head restricted to those rows and d2t maps draft ids back."""
    num = target.config.num_hidden_layers
    if not layers or any(not 0 <= i < num for i in layers):
        raise ValueError(f"--feature-layers: {list(layers)} must be layers of the target (0..{num - 1})")
    full = target.config.intermediate_size
    inter = full if intermediate_size is None else intermediate_size
    if not 0 < inter <= full:
        raise ValueError(f"--draft-intermediate-size: {inter} must be in 1..{full} (the target's)")
    reduced = {}
    if vocab_ids is not None:
        if not 0 < len(vocab_ids) < target.config.vocab_size:
            raise ValueError(f"--draft-vocab: {len(vocab_ids)} must be below the target's vocab")
        # a separate head: the draft's head holds only the kept rows, its embedding the whole vocab
        reduced = dict(draft_vocab_size=len(vocab_ids), tie_word_embeddings=False)
    cfg = dataclasses.replace(
        target.config,
        num_hidden_layers=1,
        intermediate_size=inter,
        feature_layers=tuple(layers),
        markov_rank=markov_rank,
        name="draft",
        **reduced,
    )
    draft = FeatureDraft(cfg, Comm(), dtype=torch.float32, device=device)
    src = dict(target.named_parameters())
    channels = mlp_channels(target, inter, sample_ids) if inter < full else None
    hidden = cfg.hidden_size
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            last = name.replace("model.layers.0.", f"model.layers.{num - 1}.")
            if name == "model.layers.0.self_attn.qkv_proj.weight":
                param.zero_()
                param[:, hidden:] = src[last]
            elif name == "model.fc.weight":
                param.zero_()
                param[:, -hidden:] = torch.eye(hidden)
            elif name == "model.layers.0.hidden_norm.weight":
                param.copy_(src[f"model.layers.{num - 1}.input_layernorm.weight"])
            elif name.startswith("markov_head."):
                if "markov_w1" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) / markov_rank**0.5)
                else:
                    param.zero_()  # an untrained head adds nothing
            elif channels is not None and name.endswith("mlp.gate_up_proj.weight"):
                gate, up = src[last].split(full)
                param.copy_(torch.cat([gate[channels.to(gate.device)], up[channels.to(up.device)]]))
            elif channels is not None and name.endswith("mlp.down_proj.weight"):
                param.copy_(src[last][:, channels.to(src[last].device)])
            elif name == "d2t":
                param.copy_(vocab_ids - torch.arange(len(vocab_ids)))
            elif name == "lm_head.weight" and vocab_ids is not None:
                head = target.lm_head.weight  # the embedding of a tied target
                param.zero_()  # rows past the draft vocab pad it to a multiple of 64 (masked)
                param[: len(vocab_ids)] = head[vocab_ids.to(head.device)]
            elif last in src:
                param.copy_(src[last])
            else:
                param.copy_(src[name])
            if param.is_floating_point():
                param.requires_grad_(not name.startswith(("model.embed_tokens.", "lm_head.")))
    return draft


@torch.no_grad()
def init_feature_draft(
    path, target: Transformer, vocab_ids: Tensor | None = None, device="cpu"
) -> FeatureDraft:
    """A float32 feature draft starting from the trained one at `path` (its layer, fc, norms and Markov
    head), to fine-tune or to re-export. With `vocab_ids` [N] (sorted target ids) its LM head keeps only
    those rows (the target's, as build_feature_draft) and the Markov head's W2 the same rows of its own;
    every kept id must be in the trained draft's vocab."""
    from common.loader import load_model  # the loader imports the models this module trains

    trained = load_model(path, Comm(), device=device, dtype=torch.float32)
    if not isinstance(trained, FeatureDraft):
        raise ValueError(f"--init-draft {path}: not a feature draft (its config has no feature_layers)")
    if trained.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"--init-draft {path}: vocab {trained.config.vocab_size}, the target's is "
                         f"{target.config.vocab_size}")  # fmt: skip
    cfg = trained.config
    if vocab_ids is not None:
        if not 0 < len(vocab_ids) < cfg.vocab_size:
            raise ValueError(f"--draft-vocab: {len(vocab_ids)} must be below the target's vocab")
        cfg = dataclasses.replace(cfg, draft_vocab_size=len(vocab_ids), tie_word_embeddings=False)
    draft = FeatureDraft(cfg, Comm(), dtype=torch.float32, device=device)
    src = dict(trained.named_parameters())
    # row r of the new head is target id vocab_ids[r]: its row in the trained draft's head (t2d)
    old_rows = None
    if vocab_ids is not None:
        old_ids = torch.arange(cfg.vocab_size) if trained.d2t is None else trained.map_to_target(
            torch.arange(len(trained.d2t), device=trained.d2t.device)).cpu()  # fmt: skip
        t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.int64)
        t2d[old_ids] = torch.arange(len(old_ids))
        old_rows = t2d[vocab_ids]
        if bool((old_rows < 0).any()):
            raise ValueError(f"--draft-vocab: {int((old_rows < 0).sum())} of the kept ids are outside "
                             f"--init-draft {path}'s vocab")  # fmt: skip
    for name, param in draft.named_parameters():
        if name == "d2t" and vocab_ids is not None:
            param.copy_(vocab_ids - torch.arange(len(vocab_ids)))
        elif name == "lm_head.weight" and vocab_ids is not None:
            head = target.lm_head.weight  # the embedding of a tied target
            param.zero_()  # rows past the draft vocab pad it to a multiple of 64 (masked)
            param[: len(vocab_ids)] = head[vocab_ids.to(head.device)]
        elif name == "markov_head.markov_w2.weight" and old_rows is not None:
            param.zero_()
            param[: len(vocab_ids)] = src[name][old_rows.to(src[name].device)]
        else:
            param.copy_(src[name])
        if param.is_floating_point():
            param.requires_grad_(not name.startswith(("model.embed_tokens.", "lm_head.")))
    return draft


def draft_vocab_ids(top1: Tensor, trained: Tensor, size: int, vocab_size: int) -> tuple[Tensor, float]:
    """top1 [N] (the target's top token at each data position), trained [N] bool -> the `size` ids the
    target predicts most often at trained positions (ties to the lower id), increasing, and the share of
    those predictions they cover. A draft that predicts only these loses the rest: the coverage bounds
    its per-token acceptance."""
    if not 0 < size < vocab_size:
        raise ValueError(f"--draft-vocab: {size} must be in 1..{vocab_size - 1} (below the target's vocab)")
    counts = torch.bincount(top1[trained], minlength=vocab_size).double()
    ids = torch.argsort(counts, descending=True, stable=True)[:size].sort().values
    coverage = float(counts[ids].sum() / counts.sum().clamp_min(1))
    return ids, coverage


def to_draft_vocab(draft: FeatureDraft, tk_ids: Tensor, tk_probs: Tensor) -> tuple[Tensor, Tensor]:
    """The target's top-K (target ids [..., K], probs) in the draft's vocab: ids outside it get
    probability 0 (the loss renormalises over the rest). Identity without a reduced vocab."""
    if draft.d2t is None:
        return tk_ids, tk_probs
    vocab = draft.config.vocab_size
    t2d = torch.full((vocab,), -1, dtype=torch.int64, device=tk_ids.device)
    ids = torch.arange(len(draft.d2t), device=tk_ids.device)
    t2d[ids + draft.d2t.to(tk_ids.device)] = ids
    mapped = t2d[tk_ids]
    return mapped.clamp_min(0), tk_probs * (mapped >= 0)


@torch.no_grad()
def mlp_channels(target: Transformer, keep: int, sample_ids: Tensor | None = None) -> Tensor:
    """The `keep` channels of the target's last MLP that contribute most to its output, in channel order.
    Channel j adds act_j * down[:, j] (act_j = silu(gate_j . x) * (up_j . x)); its score is
    mean |act_j| * |down[:, j]| over the last layer's MLP inputs x on `sample_ids` [B, L] (a full target
    forward), or without samples |gate_j| * |up_j| * |down[:, j]| (weight norms only)."""
    mlp = target.model.layers[-1].mlp
    full = target.config.intermediate_size
    gate, up = mlp.gate_up_proj.weight.float().split(full)
    down = mlp.down_proj.weight.float()
    if sample_ids is None:
        score = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
    else:
        seen: list[Tensor] = []
        hook = mlp.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach()))
        try:
            bsz, width = sample_ids.shape
            cache = KVCache.for_model(target, bsz, width)
            positions = torch.arange(width, device=sample_ids.device).expand(bsz, width)
            target(sample_ids, positions, torch.arange(bsz, device=sample_ids.device), cache, width)
        finally:
            hook.remove()
        x = seen[0].reshape(-1, seen[0].shape[-1]).float()
        act = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
        score = act.abs().mean(0) * down.norm(dim=0)
    return score.topk(keep).indices.sort().values.cpu()


@torch.no_grad()
def target_features(
    target: Transformer, ids: Tensor, layers: tuple[int, ...], dtype: torch.dtype | None = torch.float32
) -> Tensor:
    """ids [B, L] -> [B, L, F] in `dtype` (None: the target's own): at each position p the features of
    position p - 1 (zeros at 0), as the served draft reads them (FeatureStore.previous)."""
    bsz, width = ids.shape
    cache = KVCache.for_model(target, bsz, width)
    positions = torch.arange(width, device=ids.device).expand(bsz, width)
    _, streams = target.forward_streams(
        ids, positions, torch.arange(bsz, device=ids.device), cache, width, layers, streams_only=True
    )
    feats = torch.cat(streams, dim=-1)
    feats = feats if dtype is None else feats.to(dtype)
    return torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)


def _shift(x: Tensor, n: int) -> Tensor:
    """x [B, L, ...] moved n positions later along L (zeros first)."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :n]), x[:, :-n]], dim=1)


def _attention(draft: FeatureDraft, x: Tensor, cos: Tensor, sin: Tensor, keys: list, values: list) -> Tensor:
    """The draft layer's attention for unrolled step j = len(keys) (see the module docstring); appends this
    step's keys and values. x [B, L, 2H] -> [B, L, H]."""
    attn = draft.model.layers[0].self_attn
    bsz, width, _ = x.shape
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.qkv_proj(x).view(bsz, width, nh + 2 * nkv, hd).split((nh, nkv, nkv), dim=2)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)
    keys.append(k)
    values.append(v)
    j = len(keys) - 1
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 scores (float64 in the exactness test)
    q = q.to(acc).view(bsz, width, nkv, nh // nkv, hd)  # GQA: the query heads of one KV head grouped
    # Step 0's keys, causal and j positions back: [B, nkv, group, L, L].
    scores = torch.einsum("blngd,bmnd->bnglm", q, keys[0].to(acc)) * attn.scale
    pos = torch.arange(width, device=x.device)
    scores = scores.masked_fill(pos[None, :] > pos[:, None] - j, float("-inf"))
    # One key from each later step i, at p - j + i: [B, nkv, group, L, j].
    shifted_k = [_shift(keys[i], j - i).to(acc) for i in range(1, j + 1)]
    shifted_v = [_shift(values[i], j - i).to(acc) for i in range(1, j + 1)]
    if shifted_k:
        diag = torch.stack([torch.einsum("blngd,blnd->bngl", q, kk) for kk in shifted_k], -1) * attn.scale
        valid = torch.stack([pos >= j - i for i in range(1, j + 1)], -1)  # [L, j]
        scores = torch.cat([scores, diag.masked_fill(~valid, float("-inf"))], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bnglm,bmnd->blngd", probs[..., :width], values[0].to(acc))
    for i, vv in enumerate(shifted_v):
        out = out + probs[..., width + i, None].permute(0, 3, 1, 2, 4) * vv[:, :, :, None]
    return attn.o_proj(out.reshape(bsz, width, nh * hd).to(x.dtype))


def unrolled_hidden(draft: FeatureDraft, ids: Tensor, feats: Tensor, depth: int) -> list[Tensor]:
    """ids [B, L], feats [B, L, F] (target features at p - 1) -> per unrolled step j < depth the hidden
    states [B, L, H] after the final norm, whose head predicts t_{p+1}."""
    layer = draft.model.layers[0]
    width = ids.shape[1]
    cos, sin = draft.rotary.table(width)
    cos, sin = cos[:width][None, :, None], sin[:width][None, :, None]
    embeds = layer.input_layernorm(draft.model.embed_tokens(ids))
    fused, keys, values, out = draft.fuse(feats), [], [], []
    for _ in range(depth):
        x = torch.cat([embeds, layer.hidden_norm(fused)], dim=-1)
        h = _attention(draft, x, cos, sin, keys, values)
        h, residual = layer.post_attention_layernorm(h, fused)
        hidden, aux = draft.model.norm(layer.mlp(h), residual)
        out.append(hidden)
        fused = _shift(aux, 1)
    return out


def ttt_loss(draft: FeatureDraft, feats, ids, tk_ids, tk_probs, mask, depth: int, use_markov: bool = True):
    """(weighted soft cross-entropy, step 0's KL) against the target's renormalised top-K, over `mask`
    (with a reduced draft vocab: its part of the top-K, at positions where that part is not empty)."""
    tk_ids, tk_probs = to_draft_vocab(draft, tk_ids, tk_probs)
    mask = mask & (tk_probs.sum(-1) > 0)
    p = tk_probs / tk_probs.sum(-1, keepdim=True).clamp_min(1e-9)
    entropy = -(p * p.clamp_min(1e-9).log()).sum(-1)
    total, weight, kl0 = 0.0, 0.0, None
    pos = torch.arange(ids.shape[1], device=ids.device)
    for j, hidden in enumerate(unrolled_hidden(draft, ids, feats, depth)):
        m = mask & (pos >= j)[None]
        logits = draft.compute_logits(hidden[m], ids[m] if use_markov else None)
        logq = torch.log_softmax(logits, -1).gather(-1, tk_ids[m])
        ce = -(p[m] * logq).sum(-1).mean()
        total, weight = total + DECAY**j * ce, weight + DECAY**j
        if j == 0:
            kl0 = ce - entropy[m].mean()
    return total / weight, kl0


@torch.inference_mode()
def feature_acceptance(
    draft: FeatureDraft, target: Transformer, prompts: list[list[int]], answers: list[list[int]], k: int
) -> Acceptance:
    """Greedy speculative rounds replayed as served: each round drafts k tokens through the chain (target
    features up to the committed tokens, then the draft's own), the target's answer accepts a prefix and
    adds one token. Accepted per round -> mean, per-token alpha; and at each round's first drafted
    position, how often the target's token is the draft's first or second choice, and how often the
    draft's vocabulary lacks it (Acceptance.first_top2, first_out_of_vocab)."""
    device = draft.model.embed_tokens.weight.device
    accepted_all, agree, total = [], 0, 0
    top2 = out_of_vocab = 0  # rounds whose first target token is the draft's top 2 / outside its vocab
    proposable = torch.zeros(target.config.vocab_size, dtype=torch.bool, device=device)
    head_rows = draft.config.draft_vocab_size or draft.config.vocab_size
    proposable[draft.map_to_target(torch.arange(head_rows, device=device))] = True
    for prompt, answer in zip(prompts, answers):
        seq = torch.tensor([prompt + answer], device=device)
        feats = target_features(target, seq, tuple(draft.config.feature_layers)).to(device)
        cache = KVCache.for_model(draft, 1, seq.shape[1] + k + 1)
        slot = torch.zeros(1, dtype=torch.int64, device=device)
        done = 0  # draft KV holds positions < done, all from target features
        p = len(prompt)  # committed tokens; the next round drafts t_p..
        while p < seq.shape[1]:
            pos = torch.arange(done, p, device=device)[None]
            hidden, aux = draft(seq[:, done:p], pos, slot, cache, cache.max_len, draft.fuse(feats[:, done:p]))
            done = p
            hidden, aux, prev = hidden[:, -1], aux[:, -1], seq[:, p - 1]
            drafted = []
            for j in range(k):
                logits = draft.compute_logits(hidden, prev)
                token = draft.map_to_target(logits.argmax(-1))
                if j == 0:
                    first = int(seq[0, p])
                    top2 += first in draft.map_to_target(logits[0].topk(2).indices).tolist()
                    out_of_vocab += not bool(proposable[first])
                drafted.append(int(token))
                if j == k - 1:
                    break
                at = torch.tensor([[p + j]], device=device)
                hidden, aux = draft(token[:, None], at, slot, cache, cache.max_len, aux[:, None])
                hidden, aux, prev = hidden[:, 0], aux[:, 0], token
            truth = seq[0, p : p + k].tolist()
            a = 0
            while a < len(truth) and drafted[a] == truth[a]:
                a += 1
            accepted_all.append(a)
            agree += a
            total += len(truth[:k])
            p += a + 1
    mean = sum(accepted_all) / max(1, len(accepted_all))
    rounds = max(1, len(accepted_all))
    return Acceptance(k, mean, solve_alpha(mean, k), len(accepted_all), agree / max(1, total), top2 / rounds,
                      out_of_vocab / rounds)  # fmt: skip


def feature_table(draft: FeatureDraft, target: Transformer, heldout, ks) -> dict:
    """{"k<k>": Acceptance.as_dict()} of feature_acceptance on (prompts, answers) at each k of `ks`."""
    return {f"k{k}": feature_acceptance(draft, target, *heldout, k).as_dict() for k in ks}
