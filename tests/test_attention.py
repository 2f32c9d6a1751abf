"""The PyTorch attention backends' decode paths on decode batches whose sequences share leading KV blocks
(the prefix cache's layout for a job's instruction), against dense attention per sequence."""
from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, TorchAttentionBackend
from engine.attention.torch_quant_kv import TorchQuantKVAttentionBackend

BS = 16


def _dense(q, k, v, scale):
    """q [Hq, D] of the last position over k/v [L, Hkv, D] (float64)."""
    hq, hkv = q.shape[0], k.shape[1]
    kk = k.double().repeat_interleave(hq // hkv, 1)
    vv = v.double().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("hd,lhd->hl", q.double(), kk) * scale
    return torch.einsum("hl,lhd->hd", s.softmax(-1), vv)


def _decode_batch(backend, lens, shared_blocks, consecutive, hkv=3, gqa=3, d=64, seed=0):
    """Decode step of len(lens) sequences whose first `shared_blocks` blocks are the same
    physical blocks; returns (backend output [B, Hq, D], dense reference [B, Hq, D])."""
    g = torch.Generator().manual_seed(seed)
    hq = hkv * gqa
    num_blocks = 4 + shared_blocks + sum(-(-n // BS) for n in lens)
    ids = list(range(num_blocks))[::-1] if consecutive else torch.randperm(num_blocks, generator=g).tolist()
    shared = [ids.pop() for _ in range(shared_blocks)]
    kc = torch.zeros(backend.cache_shape(num_blocks, BS, hkv, d), dtype=torch.int8
                     if isinstance(backend, TorchQuantKVAttentionBackend) else torch.float32)
    vc = torch.zeros_like(kc)
    pk = torch.randn(shared_blocks * BS, hkv, d, generator=g)
    pv = torch.randn(shared_blocks * BS, hkv, d, generator=g)
    tables, keys, vals, slots_new = [], [], [], []
    for n in lens:
        own = n - shared_blocks * BS
        table = shared + [ids.pop() for _ in range(-(-own // BS))]
        tables.append(table)
        keys.append(torch.cat([pk, torch.randn(own, hkv, d, generator=g)]))
        vals.append(torch.cat([pv, torch.randn(own, hkv, d, generator=g)]))
    # write every cached position (all but each sequence's last) through the backend's own encoding
    written = set()
    for table, k, v in zip(tables, keys, vals):
        for i in range(len(k) - 1):
            slot = table[i // BS] * BS + i % BS
            if slot in written:
                continue
            written.add(slot)
            enc = backend.encode if isinstance(backend, TorchQuantKVAttentionBackend) else (
                lambda x: x.transpose(0, 1))
            kc[:, slot:slot + 1] = enc(k[i:i + 1])
            vc[:, slot:slot + 1] = enc(v[i:i + 1])
        slots_new.append(table[(len(k) - 1) // BS] * BS + (len(k) - 1) % BS)
    q = torch.randn(len(lens), hq, d, generator=g)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots_new), num_decode_tokens=len(lens),
        decode_seq_lens=torch.tensor(lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        prefill_query_starts=[], prefill_query_lens=[], prefill_seq_lens=[], prefill_block_tables=[],
        block_size=BS,
    )
    backend.prepare(meta)
    new_k = torch.stack([k[-1] for k in keys])
    new_v = torch.stack([v[-1] for v in vals])
    scale = d ** -0.5
    out = backend.forward(q, new_k, new_v, kc, vc, meta, scale)
    if isinstance(backend, TorchQuantKVAttentionBackend):  # the reference reads what the cache holds
        keys = [backend.decode(backend.encode(k), torch.float32).transpose(0, 1) for k in keys]
        vals = [backend.decode(backend.encode(v), torch.float32).transpose(0, 1) for v in vals]
    ref = torch.stack([_dense(q[i], keys[i], vals[i], scale) for i in range(len(lens))])
    return out, ref, meta


# 20 sequences (4 length buckets), 5 (2 buckets), 2 (one bucket); exact block ends and odd lengths
LENS = {20: [3 * BS + 1 + 7 * i for i in range(20)], 5: [3 * BS + 1, 4 * BS, 4 * BS + 1, 90, 200], 2: [49, 64]}


@pytest.mark.parametrize("n", [20, 5, 2])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, TorchQuantKVAttentionBackend])
def test_decode_with_shared_leading_blocks_matches_dense(n, consecutive, backend_cls):
    # the PyTorch decode path (the C kernel is tested in test_cpu_kernel.py)
    backend = backend_cls()
    backend.use_cpu_kernel = False
    out, ref, meta = _decode_batch(backend, LENS[n], shared_blocks=3, consecutive=consecutive, seed=n)
    shared = meta.cache["decode_shared"]
    assert shared is not None  # the path under test was taken
    assert (shared.stop - shared.start if isinstance(shared, slice) else len(shared)) == 3
    assert isinstance(shared, slice) == consecutive
    assert (out.double() - ref).abs().max().item() < 1e-4


def test_decode_without_shared_blocks_matches_dense():
    backend = TorchAttentionBackend(cpu_kernel=False)
    out, ref, meta = _decode_batch(backend, LENS[20], shared_blocks=0, consecutive=False, seed=7)
    assert meta.cache["decode_shared"] is None
    assert (out.double() - ref).abs().max().item() < 1e-4


def test_shared_blocks_stop_before_the_block_of_a_last_position():
    # the shortest sequence's last token sits in the third shared block: only two are attended as shared
    backend = TorchAttentionBackend(cpu_kernel=False)
    out, ref, meta = _decode_batch(backend, [3 * BS, 5 * BS], shared_blocks=3, consecutive=True, seed=3)
    shared = meta.cache["decode_shared"]
    assert shared.stop - shared.start == 2
    assert (out.double() - ref).abs().max().item() < 1e-4
