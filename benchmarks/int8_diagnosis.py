"""Where int8 weight-only quantization loses greedy agreement: `python -m benchmarks.int8_diagnosis`.

The setup of `benchmarks.quality` (50 prompts of 24 licence-text tokens, 32 fp32
greedy tokens each), scored teacher forced: every position is predicted from
the prompt plus fp32's own greedy tokens before it. Instead of one request per
position, each prompt + reference is prefilled once and the final hidden state
(after the final norm) of every predicting position is kept, so the body
(decoder layers) and the LM head can be quantized independently:

- head only / body only / each kind of body layer / each decoder layer alone;
- the int8 scale per output channel: absmax / 127 vs a clipped scale chosen per
  channel to minimise the weight MSE (search over clip ratios);
- near ties: fp32's top-1 minus top-2 logit at the positions int8 gets wrong.

Agreement here equals `benchmarks.quality.teacher_forced_agreement` up to float
noise (same positions, same prefill path, fp32's tokens as context).

    python -m benchmarks.int8_diagnosis [--per-layer] [--prompts 50] [--new-tokens 32]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

MODEL = "smollm2-135m-instruct"
BODY_KINDS = ("qkv", "o", "gate_up", "down")


class _Capture(nn.Module):
    """Stands in for the LM head: records its input (final hidden states) and returns it."""

    def __init__(self) -> None:
        super().__init__()
        self.h: list[torch.Tensor] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.h.append(h.float().clone())
        return h


def final_hidden(llm, seqs: list[list[int]], chunk_size: int = 1024) -> list[torch.Tensor]:
    """Per sequence, the final-norm hidden state of every position, [len, hidden] fp32.

    The prefill of `LLM.score` (same chunking, same attention backend), with the LM head
    replaced by a capture."""
    from engine.attention import AttentionMetadata

    model, bs, to = llm.model, llm.config.block_size, llm.runner._to
    head, cap = model.lm_head, _Capture()
    need = [-(-len(s) // bs) for s in seqs]
    tables = [llm.block_pool.allocate(n) for n in need]
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    model.lm_head = cap
    try:
        with torch.inference_mode():
            while any(d < len(s) for d, s in zip(done, seqs)):
                ids, pos, slots, starts, lens, slens, bts, chunks = [], [], [], [], [], [], [], []
                left = chunk_size
                for i, s in enumerate(seqs):
                    if done[i] >= len(s) or left == 0:
                        continue
                    p0, n = done[i], min(len(s) - done[i], left)
                    left -= n
                    rng, table = np.arange(p0, p0 + n), np.asarray(tables[i], dtype=np.int64)
                    starts.append(len(ids)), lens.append(n), slens.append(p0 + n), chunks.append((i, n))
                    ids.extend(s[p0 : p0 + n])
                    pos.extend(rng.tolist())
                    slots.extend((table[rng // bs] * bs + rng % bs).tolist())
                    bts.append(to(table))
                meta = AttentionMetadata(slot_mapping=to(slots), num_decode_tokens=0, decode_seq_lens=to([]),
                                         decode_block_tables=to(np.zeros((0, 1))), prefill_query_starts=starts,
                                         prefill_query_lens=lens, prefill_seq_lens=slens,
                                         prefill_block_tables=bts, block_size=bs)
                llm.backend.prepare(meta)
                cap.h.clear()
                model.forward(to(ids), to(pos), meta, llm.kv_cache.layers, llm.backend, to(np.arange(len(ids))))
                h = cap.h[0]
                for (i, n), st in zip(chunks, starts):
                    out[i].append(h[st : st + n])
                    done[i] += n
    finally:
        model.lm_head = head
        for t in tables:
            llm.block_pool.free(t)
    return [torch.cat(o) for o in out]


def predicting_states(llm, prompts, ref) -> torch.Tensor:
    """[positions, hidden]: the state that predicts ref[i] from prompt + ref[:i], for every i."""
    hs = final_hidden(llm, [p + r[:-1] for p, r in zip(prompts, ref)])
    return torch.cat([h[len(p) - 1 :] for h, p in zip(hs, prompts)])


def head_logits(head_w: torch.Tensor, h: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    return torch.cat([h[i : i + chunk] @ head_w.T for i in range(0, len(h), chunk)])


# ---------------------------------------------------------------- int8 per-channel scales

def int8_absmax(w: torch.Tensor) -> torch.Tensor:
    """Dequantized int8 per output channel, s = max|w_row| / 127 (what engine.quant does)."""
    s = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
    return torch.round(w / s).clamp(-127, 127) * s


def int8_mse_clip(w: torch.Tensor, ratios=None, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized int8 per output channel with s = r * max|w_row| / 127, r chosen per row
    among `ratios` to minimise sum((q s - w)^2). Returns (dequantized, chosen r per row)."""
    ratios = torch.linspace(0.70, 1.0, 31) if ratios is None else ratios
    out, best_r = torch.empty_like(w), torch.empty(w.shape[0])
    for r0 in range(0, w.shape[0], rows):
        x = w[r0 : r0 + rows]
        amax = x.abs().amax(1, keepdim=True).clamp_min(1e-12)
        best = torch.full((x.shape[0],), float("inf"))
        deq = torch.empty_like(x)
        for r in ratios.tolist():
            s = amax * r / 127
            d = torch.round(x / s).clamp(-127, 127) * s
            e = (d - x).pow(2).sum(1)
            better = e < best
            best = torch.where(better, e, best)
            deq[better] = d[better]
            best_r[r0 : r0 + rows][better] = r
        out[r0 : r0 + rows] = deq
    return out, best_r


def rel_err(d: torch.Tensor, w: torch.Tensor) -> float:
    return ((d - w).norm() / w.norm()).item()


# ---------------------------------------------------------------- the experiment

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--per-layer", action="store_true", help="also quantize each decoder layer alone (30 runs)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from benchmarks.quality import corpus_text, greedy
    from engine import LLM
    from engine.models.llama import Linear
    from engine.quant import QuantLinear, _swap, quantize_int8

    t0 = time.perf_counter()
    llm = LLM(MODEL)
    ids = llm.tokenizer.encode(corpus_text())[: args.tokens]
    stride = len(ids) // args.prompts
    prompts = [ids[i * stride : i * stride + 24] for i in range(args.prompts)]
    ref = greedy(llm, prompts, args.new_tokens)
    want = torch.tensor([t for r in ref for t in r])
    model = llm.model
    head_w = model.lm_head.weight.data  # the tied embedding, fp32 (from the GGUF's Q8_0 table)
    print(f"{args.prompts} prompts x {args.new_tokens} tokens = {len(want)} positions, teacher forced "
          f"(fp32 greedy tokens as context); LM head {tuple(head_w.shape)}", flush=True)

    def body_states(quantized: set[str]) -> torch.Tensor:
        """Final hidden states with the named body layers swapped for int8 (absmax) ones."""
        orig = {}
        for name, lin in model.linear_layers():
            if name in quantized:
                orig[name] = lin
                _swap(model, name, quantize_int8(lin.weight.data, lin.bias, model.dtype))
        try:
            return predicting_states(llm, prompts, ref)
        finally:
            for name, lin in orig.items():
                _swap(model, name, lin)

    def agree(logits: torch.Tensor) -> float:
        return (logits.argmax(-1) == want).float().mean().item()

    body_names = [n for n, _ in model.linear_layers() if n != "lm_head"]
    h32 = body_states(set())
    h8 = body_states(set(body_names))
    heads = {"fp32": head_w, "int8 absmax": int8_absmax(head_w)}
    heads["int8 mse-clip"], r_head = int8_mse_clip(head_w)
    l32 = head_logits(head_w, h32)
    print(f"\nfp32 body + fp32 head: {100 * agree(l32):.1f}% (sanity: fp32 against its own greedy tokens)")
    print(f"LM head weight error ||dW||/||W||: absmax {rel_err(heads['int8 absmax'], head_w):.4f}, "
          f"mse-clip {rel_err(heads['int8 mse-clip'], head_w):.4f} (clip ratio: mean {r_head.mean():.3f}, "
          f"{(r_head < 1).float().mean() * 100:.0f}% of rows clipped)")
    print(f"\n{'body':<10} {'head':<14} {'tf agr%':>8}")
    res = {}
    for bname, h in (("fp32", h32), ("int8", h8)):
        for hname, w in heads.items():
            lg = l32 if (bname, hname) == ("fp32", "fp32") else head_logits(w, h)
            res[bname, hname] = lg
            print(f"{bname:<10} {hname:<14} {100 * agree(lg):>8.1f}", flush=True)

    # near ties: fp32's top-1 minus top-2 logit where the all-int8 model disagrees
    top2 = l32.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    print("\nfp32 top-1 minus top-2 logit margin (all positions: median "
          f"{margin.median():.2f}); positions each scheme gets wrong, by fp32 margin:")
    edges = [0.1, 0.25, 0.5, 1.0]
    print(f"{'body/head':<24} {'wrong':>5} " + " ".join(f"{'<' + str(e):>6}" for e in edges) + f" {'>=1':>6}")
    print(f"{'(all positions)':<24} {len(margin):>5} " + " ".join(f"{int((margin < e).sum()):>6}" for e in edges)
          + f" {int((margin >= 1).sum()):>6}")
    for key in (("int8", "int8 absmax"), ("fp32", "int8 absmax"), ("int8", "fp32"), ("int8", "int8 mse-clip")):
        wrong = res[key].argmax(-1) != want
        m = margin[wrong]
        print(f"{key[0] + ' / ' + key[1]:<24} {int(wrong.sum()):>5} "
              + " ".join(f"{int((m < e).sum()):>6}" for e in edges) + f" {int((m >= 1).sum()):>6}")
    d8 = (res["int8", "int8 absmax"] - l32)
    print(f"logit error |int8 - fp32| (all int8): mean {d8.abs().mean():.3f}, at fp32's top-1 token "
          f"{d8.gather(1, l32.argmax(-1, keepdim=True)).abs().mean():.3f}; "
          f"head-only: mean {(res['fp32', 'int8 absmax'] - l32).abs().mean():.3f}; "
          f"body-only: mean {(res['int8', 'fp32'] - l32).abs().mean():.3f}")

    # each kind of body layer alone (all 30 layers of that kind), fp32 head
    print(f"\n{'int8 only':<14} {'tf agr%':>8} {'||dW||/||W||':>13}")
    for kind in BODY_KINDS:
        names = {n for n in body_names if n.endswith("." + kind)}
        errs = [rel_err(int8_absmax(lin.weight.data), lin.weight.data)
                for n, lin in model.linear_layers() if n in names]
        print(f"{kind:<14} {100 * agree(head_logits(head_w, body_states(names))):>8.1f} {np.mean(errs):>13.4f}",
              flush=True)

    # the body with mse-clip scales (fp32 head)
    orig = {}
    for name, lin in model.linear_layers():
        if name in body_names:
            orig[name] = lin
            d, _ = int8_mse_clip(lin.weight.data)
            _swap(model, name, Linear(d, lin.bias))
    try:
        hc = predicting_states(llm, prompts, ref)
    finally:
        for name, lin in orig.items():
            _swap(model, name, lin)
    print(f"{'body mse-clip':<14} {100 * agree(head_logits(head_w, hc)):>8.1f}  (fp32 head; "
          f"with mse-clip head {100 * agree(head_logits(heads['int8 mse-clip'], hc)):.1f})")

    if args.per_layer:
        print(f"\n{'layer':<6} {'tf agr%':>8}   (that decoder layer's 4 linears int8, all else fp32)")
        for i in range(model.cfg.num_layers):
            names = {f"layers.{i}.{k}" for k in BODY_KINDS}
            print(f"{i:<6} {100 * agree(head_logits(head_w, body_states(names))):>8.1f}", flush=True)
    assert not any(isinstance(l, QuantLinear) for _, l in model.linear_layers())
    print(f"\n({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
