"""Cutting a dataset into shards.

For now the plan keeps input order: each file is cut into contiguous row
ranges of at most `shard_size` rows (a shard never spans two files, so each
shard has one schema). Global prefix planning (group rows that share a
prompt prefix, order groups depth-first, cut shards along group boundaries)
is a later issue and will replace `plan_shards` behind the same interface.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.io import InputFile


@dataclass(frozen=True)
class Shard:
    """Rows [offset, offset + length) of one input file, written as `part-{index:05d}.parquet`.

    Attributes:
        index: shard number, 0-based, dense over the job.
        file: the input file's URL.
        offset: first row in the file.
        length: number of rows.
        first_row: index of the shard's first row in the whole dataset (used
            as the id when the input has no id column).
    """

    index: int
    file: str
    offset: int
    length: int
    first_row: int

    @property
    def name(self) -> str:
        return f"part-{self.index:05d}.parquet"


def plan_shards(files: list[InputFile], shard_size: int, limit: int | None = None) -> list[Shard]:
    """Cut `files` (in order) into shards of at most `shard_size` rows; stop after `limit` rows."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    shards: list[Shard] = []
    row = 0
    for f in files:
        offset = 0
        while offset < f.num_rows:
            if limit is not None and row >= limit:
                return shards
            length = min(shard_size, f.num_rows - offset)
            if limit is not None:
                length = min(length, limit - row)
            shards.append(Shard(len(shards), f.path, offset, length, row))
            offset += length
            row += length
    return shards
