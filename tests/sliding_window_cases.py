"""Mixed decode + chunked-prefill steps over a paged KV cache, and dense float64 sliding-window
attention over the same keys and values: the cases `test_sliding_window.py` runs every attention
backend on."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.attention import AttentionMetadata

BS = 16
# (tokens cached before the step, new tokens): seven decodes (lengths 1, 5, 16, 17, 33, 70, 93),
# then prefill chunks from position 0 and starting mid-sequence over a cached prefix (mid-block,
# at a block end, and a chunk longer than a block after an odd prefix)
DECODES = [(0, 1), (4, 1), (15, 1), (16, 1), (32, 1), (69, 1), (92, 1)]
PREFILLS = [(0, 23), (21, 11), (32, 16), (45, 30)]


@dataclass
class Step:
    """One step's inputs and what the cache holds: q [T, Hq, D]; k, v [T, Hkv, D] (the new rows);
    caches in the backend's layout; per sequence its keys and values [n, Hkv, D] as the cache
    holds them (float32) and its block table; each row's sequence and absolute position."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list
    vals: list
    tables: list
    row_seq: list
    row_pos: list
    scale: float
    placeholder: int  # the block that stands in for the freed ones (NaN with poison_window)


def _token_major(backend) -> bool:
    """Whether the backend's cache is [slots, Hkv, D] (Triton) rather than [Hkv, slots, D]."""
    return backend.cache_shape(2, 4, 3, 8)[0] == 8


def _store(backend, k_cache, v_cache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Rows k, v [n, Hkv, D] into the cache at `slots`, encoded as the backend encodes them."""
    if _token_major(backend):
        k_cache[slots] = k.to(k_cache.dtype)
        v_cache[slots] = v.to(v_cache.dtype)
    elif hasattr(backend, "encode"):
        k_cache.index_copy_(1, slots, backend.encode(k))
        v_cache.index_copy_(1, slots, backend.encode(v))
    else:
        k_cache.index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))


def _held(backend, x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [n, Hkv, D] float32 as the cache gives it back."""
    if hasattr(backend, "encode"):
        return backend.decode(backend.encode(x), torch.float32).transpose(0, 1)
    return x.to(cache_dtype).float()


def _poison(backend, cache: torch.Tensor, block: int, bs: int, is_v: bool) -> None:
    """Fill one block of the cache with NaN. 1-byte rows: V rows all 0xFF bytes (a NaN scale, and
    NaN fp8 codes); K rows codes and scale 0, a finite score of 0 that takes a share of any softmax
    that reads it (the C kernel's integer arithmetic may drop a NaN score)."""
    rows = cache[block * bs:(block + 1) * bs] if _token_major(backend) else cache[:, block * bs:(block + 1) * bs]
    if cache.dtype != torch.int8:
        rows.fill_(float("nan"))
    elif is_v:
        rows.fill_(-1)
    else:
        rows.fill_(0)


def first_needed_block(prefix: int, window: int, bs: int = BS) -> int:
    """The first block a sequence's step reads under `window` (0: block 0): that of the earliest
    key its first query (at position `prefix`) attends."""
    return max(0, prefix - window + 1) // bs if window else 0


def make_step(backend, seed: int, hq: int = 4, hkv: int = 2, d: int = 64, cache_dtype=torch.float32,
              decodes=DECODES, prefills=PREFILLS, bs: int = BS, poison_window: int = 0) -> Step:
    """A mixed step for `backend`: its cached prefixes written, its metadata prepared.

    With `poison_window` > 0 every block wholly before the window of a sequence's first query
    (`first_needed_block`) is filled with NaN (`_poison`), and its block-table entry points at a
    placeholder block, also NaN: a kernel that reads any of them returns NaN or far wrong values.
    """
    g = torch.Generator().manual_seed(seed)
    specs = list(decodes) + list(prefills)
    nblk = [-(-(pre + new) // bs) for pre, new in specs]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    placeholder = perm.pop()
    shape = backend.cache_shape(num_blocks, bs, hkv, d)
    k_cache = torch.zeros(shape, dtype=cache_dtype)
    v_cache = torch.zeros(shape, dtype=cache_dtype)
    tables, keys, vals, new_k, new_v, slots, row_seq, row_pos = [], [], [], [], [], [], [], []
    for s, ((pre, new), nb) in enumerate(zip(specs, nblk)):
        table = [perm.pop() for _ in range(nb)]
        n = pre + new
        k = torch.randn(n, hkv, d, generator=g)
        v = torch.randn(n, hkv, d, generator=g)
        sl = torch.tensor([table[i // bs] * bs + i % bs for i in range(n)], dtype=torch.int64)
        if pre:
            _store(backend, k_cache, v_cache, sl[:pre], k[:pre], v[:pre])
        keys.append(_held(backend, k, cache_dtype))
        vals.append(_held(backend, v, cache_dtype))
        new_k.append(k[pre:])
        new_v.append(v[pre:])
        slots.append(sl[pre:])
        row_seq += [s] * new
        row_pos += list(range(pre, n))
        if poison_window:
            for b in range(first_needed_block(pre, poison_window, bs)):
                _poison(backend, k_cache, table[b], bs, False)
                _poison(backend, v_cache, table[b], bs, True)
                table[b] = placeholder
        tables.append(table)
    if poison_window:
        _poison(backend, k_cache, placeholder, bs, False)
        _poison(backend, v_cache, placeholder, bs, True)
    nd = len(decodes)
    width = max(len(t) for t in tables[:nd]) if nd else 1
    starts, off = [], nd
    for _, new in prefills:
        starts.append(off)
        off += new
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decode_tokens=nd,
        decode_seq_lens=torch.tensor([pre + new for pre, new in decodes], dtype=torch.int64),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[:nd]], dtype=torch.int32)
        if nd else torch.zeros(0, 1, dtype=torch.int32),
        prefill_query_starts=starts,
        prefill_query_lens=[new for _, new in prefills],
        prefill_seq_lens=[pre + new for pre, new in prefills],
        prefill_block_tables=[torch.tensor(t, dtype=torch.int64) for t in tables[nd:]],
        block_size=bs,
    )
    backend.prepare(meta)
    q = torch.randn(len(row_seq), hq, d, generator=g)
    return Step(q, torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, meta, keys, vals, tables, row_seq,
                row_pos, d ** -0.5, placeholder)


def dense_reference(step: Step, window: int) -> torch.Tensor:
    """[T, Hq, D] float64: each row attends the keys j of its sequence with p - window < j <= p
    (window 0: j <= p), softmax(scale q k) v, GQA heads h -> h // (Hq / Hkv)."""
    hq = step.q.shape[1]
    out = torch.empty(step.q.shape, dtype=torch.float64)
    for r, (s, p) in enumerate(zip(step.row_seq, step.row_pos)):
        lo = max(0, p - window + 1) if window else 0
        k = step.keys[s][lo:p + 1].double()
        v = step.vals[s][lo:p + 1].double()
        rep = hq // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        w = (torch.einsum("hd,lhd->hl", step.q[r].double(), k) * step.scale).softmax(-1)
        out[r] = torch.einsum("hl,lhd->hd", w, v)
    return out


def run(backend, step: Step, window: Optional[int] = 0) -> torch.Tensor:
    """The backend's write + attention for the step (window None: the call without the argument)."""
    if window is None:
        return backend.forward(step.q, step.k, step.v, step.k_cache, step.v_cache, step.meta, step.scale)
    return backend.forward(step.q, step.k, step.v, step.k_cache, step.v_cache, step.meta, step.scale,
                           window=window)
