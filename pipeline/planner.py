"""The global prefix planner: group rows that share a prompt prefix, order them depth-first, cut shards.

    rows --(chat template, batch tokenise)--> token ids --> PrefixTree (full blocks)
         --> depth-first order (rows sharing a prefix are adjacent) --> shards cut along group boundaries

An offline job knows every prompt before it starts, so instead of hoping an
LRU cache keeps a prefix alive (what an online engine does), the planner puts
every row sharing a prefix next to each other: the engine admits requests in
the order it is given (FIFO), so a group's shared blocks are computed once and
stay referenced by running rows until the group's last row is admitted
(BatchLLM, Zheng et al. 2024, arXiv 2412.03594, "global prefix sharing").

The tree is at KV-block granularity (the engine caches only full blocks of
`block_size` tokens), keyed by the engine's chained block hash
(`engine.kv_cache.block_hashes`), the hash its prefix cache keeps a block under. A *group* is the
set of rows under one child of the root: rows sharing at least one block.

Order: a depth-first walk; at every node, rows that end there and child
subtrees come in order of first appearance in the input, so a dataset with no
shared prefix keeps its input order and the plan is a deterministic function
of the input. Option `decode_heavy_first` puts items with the most output per
prompt token first at every node (BatchLLM's ordering); it is off by default:
replayed on the engine's scheduler (`benchmarks/planner_bench.py`, 256 rows, two
instructions with 4/48, 16/64 and 1/128 output tokens) it changed the modelled
time by 0.0-0.2%, because the seat limit (max_num_seqs), not the order, bounds
the decode steps there.

Shards: a shard never spans two files (one schema per part file). Within a
file run, a shard takes whole groups while they fit; a group larger than a
shard is cut at the shallowest sub-group boundary in the second half of the
window (so rows sharing deeper prefixes stay together too).

Ideal hit rate: 1 - distinct / total prompt tokens, where distinct counts each
distinct full block of the tree once plus every row's partial last block (the
engine never caches a partial block).

`plan_input_order` keeps the old plan: contiguous row ranges in input order.
"""
from __future__ import annotations

import time
from array import array
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

from engine.kv_cache import block_hashes
from pipeline.io import InputFile

DEFAULT_BLOCK_SIZE = 16


# ---------------------------------------------------------------- shards

@dataclass(frozen=True)
class Shard:
    """Some rows of one input file, written as `part-{index:05d}.parquet` in `rows` order.

    Attributes:
        index: shard number, 0-based, dense over the job (also the engine order of shards).
        file: the input file's URL.
        rows: row numbers within the file, in planned order (the engine's admission order).
        file_start: dataset index of the file's row 0 (ids and seeds of a row use
            `file_start + row`, so they do not depend on the plan).
        continues_group: its first row shares a prefix block with the previous shard's last
            row; the job keeps such shards in one engine call when it can.
    """

    index: int
    file: str
    rows: tuple[int, ...]
    file_start: int
    continues_group: bool = False

    @property
    def name(self) -> str:
        return f"part-{self.index:05d}.parquet"

    @property
    def length(self) -> int:
        return len(self.rows)

    def dataset_rows(self) -> list[int]:
        """Dataset-wide indexes of the shard's rows, in shard order."""
        return [self.file_start + r for r in self.rows]

    def runs(self) -> list[tuple[int, int]]:
        """The rows as (offset, length) runs of consecutive ascending row numbers, in shard order."""
        out: list[list[int]] = []
        for r in self.rows:
            if out and out[-1][0] + out[-1][1] == r:
                out[-1][1] += 1
            else:
                out.append([r, 1])
        return [(o, n) for o, n in out]

    def to_json(self) -> dict:
        """Compact JSON form for the manifest (rows as runs)."""
        return {"index": self.index, "file": self.file, "file_start": self.file_start,
                "runs": [list(r) for r in self.runs()], "continues_group": self.continues_group}

    @classmethod
    def from_json(cls, d: dict) -> "Shard":
        rows = tuple(r for o, n in d["runs"] for r in range(o, o + n))
        return cls(d["index"], d["file"], rows, d["file_start"], bool(d.get("continues_group", False)))


def plan_input_order(files: list[InputFile], shard_size: int, limit: int | None = None) -> list[Shard]:
    """Cut `files` (in order) into contiguous shards of at most `shard_size` rows; stop after `limit` rows."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    shards: list[Shard] = []
    start = 0
    for f in files:
        n = f.num_rows if limit is None else max(0, min(f.num_rows, limit - start))
        for offset in range(0, n, shard_size):
            shards.append(Shard(len(shards), f.path, tuple(range(offset, min(offset + shard_size, n))), start))
        start += f.num_rows
    return shards


# ---------------------------------------------------------------- the prefix tree

@dataclass
class PlanStats:
    """What the planner found; stored in the manifest and reported.

    Attributes:
        order: "prefix" (depth-first), "prefix+decode_heavy_first" or "input".
        rows: rows planned (with or without tokens).
        groups: root children of the tree (sets of >= 2 rows sharing >= 1 block).
        grouped_rows: rows in some group.
        prompt_tokens: tokens of all prompts (after the chat template).
        distinct_tokens: distinct full-block tokens of the tree + every row's partial last block.
        ideal_hit_rate: 1 - distinct_tokens / prompt_tokens.
        block_size: the KV block size the tree was built with.
        tokenize_s / plan_s: wall seconds of templating+tokenising and of tree+order+cut.
    """

    order: str = "input"
    rows: int = 0
    groups: int = 0
    grouped_rows: int = 0
    prompt_tokens: int = 0
    distinct_tokens: int = 0
    ideal_hit_rate: Optional[float] = None
    block_size: int = DEFAULT_BLOCK_SIZE
    tokenize_s: float = 0.0
    plan_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


class PrefixTree:
    """The block-level prefix tree of a dataset's prompts.

    Add rows in input order with `add`, then `order()`. Memory: one 8-byte hash
    per full block per row (token ids are not kept), plus a node per block that
    at least two rows share.

    A block's key is the engine's chained block hash (`engine.kv_cache.block_hashes`,
    the hash under which the prefix cache keeps the block), computed for a batch of
    rows at once; two rows share k blocks when their k-th keys are equal.

    Args:
        block_size: tokens per KV block (the engine's `block_size`).
    """

    BATCH_ROWS = 4096

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._pending: list[Sequence[int]] = []
        self._hashes: list[np.ndarray] = []  # uint64 chained keys, batch by batch
        self._nblocks = array("q")  # full blocks per row
        self._lens = array("q")
        self._max_tokens = array("q")
        self._parts = array("q")
        self._built = False

    def __len__(self) -> int:
        return len(self._lens)

    def add(self, token_ids: Optional[Sequence[int]], max_tokens: int = 0, part: int = 0) -> int:
        """Add a row; returns its index.

        Args:
            token_ids: the prompt's tokens (None or [] for a row without tokens, e.g. an error row).
            max_tokens: the row's output budget (for `decode_heavy_first`).
            part: the row's input file; within a group, `order` keeps a file's rows together.
        """
        ids = token_ids or ()
        self._pending.append(ids)
        self._lens.append(len(ids))
        self._nblocks.append(len(ids) // self.block_size)
        self._max_tokens.append(int(max_tokens or 0))
        self._parts.append(part)
        self._built = False
        if len(self._pending) >= self.BATCH_ROWS:
            self._flush()
        return len(self._lens) - 1

    def _flush(self) -> None:
        """Hash the full blocks of the pending rows, all at once (`engine.kv_cache.block_hashes`)."""
        rows = [ids for ids in self._pending if len(ids) >= self.block_size]
        self._pending = []
        if rows:
            self._hashes.append(np.concatenate(block_hashes(rows, self.block_size)))

    # -- build
    def _build(self) -> None:
        """Count distinct blocks; make nodes for blocks shared by >= 2 rows, in first-appearance order."""
        self._flush()
        nb = np.frombuffer(self._nblocks, dtype=np.int64) if len(self._nblocks) else np.zeros(0, np.int64)
        allh = np.concatenate(self._hashes) if self._hashes else np.zeros(0, np.uint64)
        self._allh = allh
        off = np.cumsum(nb) - nb
        self._off = off
        if len(allh):
            uniq, inv, counts = np.unique(allh, return_inverse=True, return_counts=True)
            self.distinct_blocks = int(len(uniq))
            cs = np.concatenate([[0], np.cumsum(counts[inv] >= 2)])
            shared_depth = cs[off + nb] - cs[off]  # shared blocks form a prefix of a row's chain
        else:
            self.distinct_blocks = 0
            shared_depth = np.zeros(len(nb), np.int64)
        leaf_key = np.where(shared_depth > 0, allh[np.maximum(off + shared_depth - 1, 0)] if len(allh) else 0, 0)
        node_of: dict[int, int] = {}
        depth, parent = [0], [0]
        items: list[list[int]] = [[]]  # per node: row r as r, child node n as ~n, in first-appearance order
        leaf = [0] * len(nb)
        for r, (d, key) in enumerate(zip(shared_depth.tolist(), leaf_key.tolist())):
            if d == 0:
                items[0].append(r)
                continue
            node = node_of.get(key)
            if node is None:
                chain = allh[off[r]:off[r] + d].tolist()
                j = d - 1
                while j > 0 and chain[j - 1] not in node_of:
                    j -= 1
                up = node_of[chain[j - 1]] if j > 0 else 0
                for k in range(j, d):
                    nid = len(depth)
                    node_of[chain[k]] = nid
                    depth.append(k + 1)
                    parent.append(up)
                    items.append([])
                    items[up].append(~nid)
                    up = nid
                node = up
            items[node].append(r)
            leaf[r] = node
        self._depth, self._parent, self._items, self._leaf = depth, parent, items, leaf
        self._built = True

    def _ensure(self) -> None:
        if not self._built:
            self._build()

    # -- statistics
    @property
    def prompt_tokens(self) -> int:
        return int(sum(self._lens))

    @property
    def distinct_tokens(self) -> int:
        """Distinct full-block tokens of the tree plus every row's partial last block."""
        self._ensure()
        bs = self.block_size
        return self.distinct_blocks * bs + int(sum(n % bs for n in self._lens))

    @property
    def ideal_hit_rate(self) -> float:
        """1 - distinct / total prompt tokens: the best prefix-cache hit rate any order can reach."""
        total = self.prompt_tokens
        return 1.0 - self.distinct_tokens / total if total else 0.0

    @property
    def num_nodes(self) -> int:
        """Shared blocks (tree nodes below the root)."""
        self._ensure()
        return len(self._depth) - 1

    def groups(self) -> list[list[int]]:
        """Rows of each group (a root child: rows sharing >= 1 block), in depth-first order."""
        self._ensure()
        return [self._subtree_rows(~x) for x in self._items[0] if x < 0]

    def _subtree_rows(self, node: int, key: Optional[Any] = None) -> list[int]:
        """Rows under `node`, depth-first; at every node items are sorted by `key` (stable) when given."""
        out: list[int] = []
        arrange = (lambda xs: sorted(xs, key=key)) if key is not None else (lambda xs: xs)  # noqa: E731
        stack = [iter(arrange(self._items[node]))]
        while stack:
            x = next(stack[-1], None)
            if x is None:
                stack.pop()
            elif x >= 0:
                out.append(x)
            else:
                stack.append(iter(arrange(self._items[~x])))
        return out

    def _decode_ratio_key(self) -> Any:
        """Sort key of an item: minus (output tokens / prompt tokens) of its rows (max_tokens as output)."""
        n = len(self._depth)
        out_sum, in_sum = [0] * n, [0] * n
        for r, leaf in enumerate(self._leaf):
            out_sum[leaf] += self._max_tokens[r]
            in_sum[leaf] += self._lens[r]
        node_out, node_in = out_sum[:], in_sum[:]
        for m in range(n - 1, 0, -1):  # children are created after their parents
            node_out[self._parent[m]] += node_out[m]
            node_in[self._parent[m]] += node_in[m]

        def key(x: int) -> float:
            if x >= 0:
                return -self._max_tokens[x] / max(self._lens[x], 1)
            return -node_out[~x] / max(node_in[~x], 1)
        return key

    def shared_blocks(self, a: int, b: int) -> int:
        """Full blocks rows `a` and `b` share (the depth of their leaves' common ancestor)."""
        self._ensure()
        u, v = self._leaf[a], self._leaf[b]
        depth, parent = self._depth, self._parent
        while u != v:
            if depth[u] >= depth[v]:
                u = parent[u]
            else:
                v = parent[v]
        return depth[u]

    # -- order
    def order(self, decode_heavy_first: bool = False) -> tuple[list[int], list[int]]:
        """Rows in depth-first order, and for each position the number of blocks its row shares
        with the previous row (0 at a group boundary and at position 0).

        Within a group, rows of one part (input file) are kept together, in depth-first
        order (a subsequence of a depth-first order is one of the part's own subtree), so
        that shards, which never span files, can hold whole groups.

        Args:
            decode_heavy_first: at every node, put the items (sub-groups and rows) with the
                highest ratio of output tokens (max_tokens) to prompt tokens first (stable).
        """
        self._ensure()
        key = self._decode_ratio_key() if decode_heavy_first else None
        top = sorted(self._items[0], key=key) if key is not None else list(self._items[0])
        order: list[int] = []
        parts = self._parts
        for x in top:
            if x >= 0:
                order.append(x)
                continue
            rows = self._subtree_rows(~x, key)
            if len(set(parts[r] for r in rows)) > 1:
                rank: dict[int, int] = {}
                for r in rows:
                    rank.setdefault(parts[r], len(rank))
                rows.sort(key=lambda r: rank[parts[r]])  # stable: depth-first within each part
            order.extend(rows)
        lcp = [0] + [self.shared_blocks(order[i - 1], order[i]) for i in range(1, len(order))]
        return order, lcp


# ---------------------------------------------------------------- shard cuts

def cut_shards(files: Sequence[int], lcp: Sequence[int], shard_size: int) -> list[tuple[int, int]]:
    """Cut an ordered row sequence into shards [start, end) of at most `shard_size` rows.

    Args:
        files: per position, the row's file (a shard never spans two files).
        lcp: per position, blocks shared with the previous row (0: a group boundary).
        shard_size: most rows per shard.

    Rule: if the rest of the file run fits, take it; else cut at the last group boundary
    within the window; a window inside one group (a group larger than a shard) is cut at
    the shallowest boundary in its second half, the latest one on ties.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    n = len(files)
    cuts: list[tuple[int, int]] = []
    s = 0
    while s < n:
        hi = min(s + shard_size, n)
        change = next((i for i in range(s + 1, hi + (hi < n)) if files[i] != files[s]), None)
        if change is not None and change <= hi:
            e = change
        elif hi == n:
            e = n
        else:
            zero = [b for b in range(s + 1, hi + 1) if lcp[b] == 0]
            if zero:
                e = zero[-1]
            else:
                lo = s + (shard_size + 1) // 2
                e = min(range(lo, hi + 1), key=lambda b: (lcp[b], -b))
        cuts.append((s, e))
        s = e
    return cuts


def plan_prefix(
    rows: Iterable[tuple[Optional[Sequence[int]], int]],
    files: list[InputFile],
    shard_size: int,
    limit: int | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    decode_heavy_first: bool = False,
) -> tuple[list[Shard], PlanStats]:
    """The prefix plan of a dataset.

    Args:
        rows: per dataset row in file order (the first `limit` rows of `files`):
            (prompt token ids, or None for a row that will be an error row; max_tokens).
        files: the input files, in order.
        shard_size: most rows per shard.
        block_size: the engine's KV block size.
        decode_heavy_first: see `PrefixTree.order`.

    Returns:
        (shards in engine order, statistics).
    """
    t0 = time.perf_counter()
    starts, file_of = [], []
    start = 0
    for i, f in enumerate(files):
        n = f.num_rows if limit is None else max(0, min(f.num_rows, limit - start))
        starts.append(start)
        file_of.extend([i] * n)
        start += f.num_rows
    tree = PrefixTree(block_size)
    for ids, max_tokens in rows:
        i = len(tree)
        tree.add(ids, max_tokens, part=file_of[i] if i < len(file_of) else -1)
    tokenize_s = float(getattr(rows, "seconds", 0.0))
    if len(file_of) != len(tree):
        raise ValueError(f"planner got {len(tree)} rows, the files hold {len(file_of)}")
    order, lcp = tree.order(decode_heavy_first)
    ofiles = [file_of[r] for r in order]
    shards = []
    for s, e in cut_shards(ofiles, lcp, shard_size):
        fi = ofiles[s]
        rows_in_file = tuple(order[k] - starts[fi] for k in range(s, e))
        shards.append(Shard(len(shards), files[fi].path, rows_in_file, starts[fi], continues_group=lcp[s] > 0))
    groups = tree.groups()
    stats = PlanStats(
        order="prefix+decode_heavy_first" if decode_heavy_first else "prefix",
        rows=len(tree), groups=len(groups), grouped_rows=sum(len(g) for g in groups),
        prompt_tokens=tree.prompt_tokens, distinct_tokens=tree.distinct_tokens,
        ideal_hit_rate=tree.ideal_hit_rate, block_size=block_size,
        tokenize_s=tokenize_s, plan_s=time.perf_counter() - t0 - tokenize_s,
    )
    return shards, stats


# ---------------------------------------------------------------- tokenising the dataset

class _TextRecorder:
    """Wraps a tokenizer for `schema.build_request`: templates as usual, but `encode` records the
    text and returns a placeholder, so that the texts of many rows can be encoded in one batch."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.text: Optional[str] = None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        self.text = text
        return [0]


class TokenizedRows:
    """Iterates (prompt token ids or None, max_tokens) over the first `limit` rows of `files`.

    Reads only the prompt columns (prompt, messages, overrides), a batch of rows at
    a time; applies the row rules of `schema.build_request` (chat template, system
    prompt, overrides, null id); encodes each batch with one `encode_batch` call. A row that
    `build_request` rejects, or that breaks the context-length rule (`schema.length_rule`), yields None:
    it becomes an error row when it runs, so its prompt counts in no statistic
    (`ideal_hit_rate`). `seconds` holds the wall time spent once iterated.
    """

    def __init__(self, files: list[InputFile], tokenizer: Any, defaults: Any, *, id_column: str = "id",
                 system_prompt: Optional[str] = None, use_chat_template: bool = True,
                 limit: Optional[int] = None, storage_options: Optional[dict] = None,
                 batch_rows: int = 4096, max_model_len: Optional[int] = None, truncate: bool = False) -> None:
        self.files, self.tokenizer, self.defaults = files, tokenizer, defaults
        self.id_column, self.system_prompt, self.use_chat_template = id_column, system_prompt, use_chat_template
        self.limit, self.storage_options, self.batch_rows = limit, storage_options, batch_rows
        self.max_model_len, self.truncate = max_model_len, truncate
        self.seconds = 0.0

    def __iter__(self) -> Iterator[tuple[Optional[list[int]], int]]:
        from pipeline import io
        from pipeline.schema import (
            MESSAGES_COLUMN, OVERRIDE_COLUMNS, PROMPT_COLUMN, InputLayout, build_request, length_rule,
        )

        left = self.limit
        rec = _TextRecorder(self.tokenizer)
        encode_batch = getattr(self.tokenizer, "encode_batch", None)
        vocab_size, max_len = getattr(self.tokenizer, "vocab_size", None), self.max_model_len
        for f in self.files:
            if left is not None and left <= 0:
                return
            layout = InputLayout.from_schema(f.columns, self.id_column)
            cols = [c for c in (self.id_column, PROMPT_COLUMN, MESSAGES_COLUMN, *OVERRIDE_COLUMNS)
                    if c in f.columns]
            for df in io.iter_batches(f.path, cols, self.batch_rows, self.storage_options):
                t0 = time.perf_counter()
                if left is not None:
                    df = df.head(left)
                    left -= df.height
                texts: list[Optional[str]] = []
                given: list[Optional[list[int]]] = []  # rows whose prompt is token ids (no text to encode)
                max_tokens: list[int] = []
                for row in df.iter_rows(named=True):
                    rec.text = None
                    req = build_request(row, layout, rec, self.defaults, system_prompt=self.system_prompt,
                                        use_chat_template=self.use_chat_template, vocab_size=vocab_size)
                    texts.append(rec.text if req.error is None else None)
                    given.append(req.prompt_token_ids if req.error is None and rec.text is None else None)
                    max_tokens.append(req.params.max_tokens if req.params is not None else 0)
                good = [t for t in texts if t is not None]
                if encode_batch is not None:
                    enc = iter(encode_batch(good)) if good else iter(())
                else:
                    enc = iter([self.tokenizer.encode(t) for t in good])
                out = [(g if g is not None else list(next(enc)) if t is not None else None, m)
                       for t, g, m in zip(texts, given, max_tokens)]
                if max_len is not None:  # build_request's length rule, on the real token counts
                    checked = []
                    for ids, m in out:
                        problem, m = length_rule(len(ids), m, max_len, self.truncate) if ids is not None else ("", m)
                        checked.append((None if problem is not None else ids, m or 0))
                    out = checked
                self.seconds += time.perf_counter() - t0
                yield from out
                if left is not None and left <= 0:
                    return
