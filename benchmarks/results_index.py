"""The results index: tables regenerated from benchmarks/results/<host-id>/*.json, never typed.

    python -m benchmarks.results_index            # rewrite the two blocks
    python -m benchmarks.results_index --check    # exit 1 when either block is stale

Two blocks, each between the lines `<!-- results:begin -->` and `<!-- results:end -->`:
- docs/results.md: every result file, one row per host and benchmark variant (date, commit, the
  headline figure where the benchmark has one, the file);
- README.md: the headline table, tokenmill's output tok/s against the best peer per workload,
  from the newest `throughput.json` that has peers, with its host line.

Exit status: 0 written (or up to date with --check), 1 stale (--check), 2 a file lacks the
markers (said in one line). The output depends only on the result files, so two runs agree.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from benchmarks.record import RESULTS, ROOT

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
PEER_PREFIXES = ("vllm", "llamacpp", "hf")


@dataclass(frozen=True)
class Result:
    """One result file's record, as the index reads it."""

    host_id: str
    name: str  # "<benchmark>[-<variant>]"
    data: dict

    @property
    def path(self) -> str:
        return f"benchmarks/results/{self.host_id}/{self.name}.json"

    @property
    def benchmark(self) -> str:
        return self.data.get("benchmark") or self.name.split("-", 1)[0]

    @property
    def variant(self) -> str:
        return self.name.split("-", 1)[1] if "-" in self.name else ""

    @property
    def date(self) -> str:
        return str(self.data.get("date") or "")[:10]

    @property
    def commit(self) -> str:
        return self.data.get("commit") or ""

    def peer_rows(self) -> list[tuple[str, float, str, float]]:
        """(workload, tokenmill output tok/s, best peer, its output tok/s) per workload with both."""
        rows = []
        workloads = self.data.get("workloads")
        for wl, body in (workloads.items() if isinstance(workloads, dict) else []):
            res = body.get("results", {}) if isinstance(body, dict) else {}
            tm = res.get("tokenmill", {}).get("output_tok_s")
            peers = [(v.get("output_tok_s"), k) for k, v in res.items()
                     if k.startswith(PEER_PREFIXES) and isinstance(v, dict) and v.get("output_tok_s")]
            if tm and peers:
                best, peer = max(peers)
                rows.append((wl, float(tm), peer, float(best)))
        return rows

    def headline(self) -> str:
        """A short figure: tokenmill / best peer per workload for a comparison, else ""."""
        return ", ".join(f"{wl} {tm / best:.2f}x {peer}" for wl, tm, peer, best in self.peer_rows())


def load_results(root: Path = RESULTS) -> list[Result]:
    """Every `root/<host-id>/*.json`, sorted by host and name; ValueError for a file that does not parse."""
    out = []
    for path in sorted(root.glob("*/*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        out.append(Result(path.parent.name, path.stem, data))
    return out


def _host_line(r: Result) -> str:
    host = r.data.get("host") if isinstance(r.data.get("host"), dict) else {}
    cpu = host.get("cpu")
    fm = f" (family {host['family']} model {host['model']})" if host.get("family") is not None else ""
    isa = f", ISA {host['isa'].replace(',', ' ')}" if host.get("isa") else ""
    cpus = f", {host['cpus']} CPUs" if host.get("cpus") else ""
    what = f"{cpu}{fm}{cpus}{isa}" if cpu else r.host_id
    commit = f", commit {r.commit}" if r.commit else ""
    return f"Host: {what} (`{r.host_id}`); {r.date}{commit}; `{r.path}`."


def headline_result(results: list[Result]) -> Optional[Result]:
    """The newest default `throughput` result with peer rows (ties: host name)."""
    cands = [r for r in results if r.name == "throughput" and r.peer_rows()]
    return max(cands, key=lambda r: (r.date, r.host_id)) if cands else None


# the README's headline columns: (title, engine names that fill it; the best of them is shown)
HEADLINE_COLUMNS = (("tokenmill", ("tokenmill",)), ("tokenmill W8A8", ("tokenmill-w8a8",)),
                    ("vLLM-CPU", ("vllm",)), ("llama.cpp best", ("llamacpp",)), ("transformers best", ("hf",)))


def _best(results: dict, prefixes: tuple) -> Optional[tuple[float, str]]:
    """(output tok/s, engine) of the fastest engine named exactly a prefix or starting with it + "-"."""
    rows = [(float(v["output_tok_s"]), k) for k, v in results.items()
            if isinstance(v, dict) and v.get("output_tok_s")
            and any(k == p or (k.startswith(p + "-") and p != "tokenmill") for p in prefixes)]
    return max(rows) if rows else None


def readme_block(results: list[Result]) -> str:
    """The README's headline table (output tok/s per engine, each peer's best configuration of
    the run, and tokenmill's default over the best peer) and its host line (markdown, no markers)."""
    r = headline_result(results)
    if r is None:
        return "No throughput result with peers yet (`python -m benchmarks.throughput --record`)."
    head = [t for t, _ in HEADLINE_COLUMNS]
    lines = ["Output tokens/s; each peer in its best configuration of the run.", "",
             "| workload | " + " | ".join(head) + " | tokenmill / best peer |",
             "|---" * (len(head) + 2) + "|"]
    for wl, tm, peer, best in r.peer_rows():
        res = r.data["workloads"][wl]["results"]
        cells = []
        for _, prefixes in HEADLINE_COLUMNS:
            got = _best(res, prefixes)
            cells.append("-" if got is None else (f"{got[0]:.1f}" if got[1] in prefixes else f"{got[0]:.1f} ({got[1]})"))
        lines.append(f"| {wl} | " + " | ".join(cells) + f" | **{tm / best:.2f}x** ({peer}) |")
    cmd = f"\n\n`{r.data['command']}`" if r.data.get("command") else ""
    return "\n".join(lines) + "\n\n" + _host_line(r) + cmd


def doc_block(results: list[Result]) -> str:
    """docs/results.md's table: the current result per benchmark, variant and host."""
    lines = ["| host | benchmark | variant | date | commit | tokenmill / best peer | file |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r.benchmark, r.variant, r.host_id)):
        legacy = " (legacy)" if r.data.get("legacy") else ""
        lines.append(f"| {r.host_id} | {r.benchmark} | {r.variant or '-'} | {r.date}{legacy} | {r.commit or '-'} | "
                     f"{r.headline() or '-'} | `{r.path}` |")
    return "\n".join(lines)


class MissingMarkers(Exception):
    """A file has no `<!-- results:begin -->` ... `<!-- results:end -->` block."""


def replace_block(text: str, block: str, where: str = "") -> str:
    """`text` with the lines between the markers replaced by `block`; MissingMarkers if absent."""
    b, e = text.find(BEGIN), text.find(END)
    if b < 0 or e < 0 or e < b:
        raise MissingMarkers(f"{where or 'file'}: no {BEGIN} ... {END} block")
    return text[:b + len(BEGIN)] + "\n" + block.rstrip("\n") + "\n" + text[e:]


def run(readme: Path, doc: Path, root: Path = RESULTS, check: bool = False) -> int:
    """Regenerate (or with `check`, compare) both blocks; returns the exit status (see the module doc)."""
    results = load_results(root)
    stale = []
    try:
        for path, block in ((readme, readme_block(results)), (doc, doc_block(results))):
            old = path.read_text() if path.exists() else ""
            new = replace_block(old, block, str(path))
            if new != old:
                stale.append(path)
                if not check:
                    path.write_text(new)
    except MissingMarkers as exc:
        print(f"results_index: {exc}", file=sys.stderr)
        return 2
    if check and stale:
        print("results_index: stale: " + ", ".join(str(p) for p in stale) + " (run make results)", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a block is stale, write nothing")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "results.md")
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    return run(args.readme, args.doc, args.results, args.check)


if __name__ == "__main__":
    sys.exit(main())
