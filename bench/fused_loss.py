"""Peak memory per token of the last stage's head and loss: transformers' path against the fused loss.

    python -m bench.fused_loss [--hidden 960] [--vocab 49152]

Forward and backward of the head (fp32 weight, fp32 hidden states) and the loss under bf16 autocast on the CPU, one
thread. The peak is read from the allocator: the running sum of ``torch.profiler``'s memory events (every
allocation and free, in order), counting only what the step allocates; it is measured at two token counts and
fitted as a + b * tokens, b being the bytes per token. transformers' path is measured at 1,024 and 2,048 tokens:
below about 600 its weight-sized terms (the weight's bf16 cast, its gradient) set the peak, not the logits. The
fused loss at 256 and 512 tokens with 64-token chunks (a chunk's logits are in a, whatever the chunk size).
"""
from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_asyncpp.model.fused_loss import fused_linear_cross_entropy


def peak_live_bytes(fn) -> int:
    """Peak bytes live during ``fn()`` from the allocator's events, counting only what ``fn`` allocates."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def head_and_loss_bytes_per_token(fused: bool, tokens: tuple[int, int], hidden: int = 960, vocab: int = 49152,
                                  chunk: int = 64) -> float:
    """b of peak = a + b * tokens for the head and loss's forward and backward (bf16 autocast, fp32 weight and hidden
    states; smollm2-360m's head by default)."""
    torch.manual_seed(0)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
    peaks = []
    for n in tokens:
        h = torch.randn(1, n, hidden, requires_grad=True)
        y = torch.randint(0, vocab, (1, n))

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if fused:
                    loss = fused_linear_cross_entropy(h, w, None, y, chunk=chunk)
                else:
                    loss = ForCausalLMLoss(F.linear(h, w), y, vocab_size=vocab)
            loss.backward()
            w.grad = None
        peaks.append(peak_live_bytes(step))
    return (peaks[1] - peaks[0]) / (tokens[1] - tokens[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=960)
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    torch.set_num_threads(1)
    plain = head_and_loss_bytes_per_token(False, (1024, 2048), args.hidden, args.vocab)
    fused = head_and_loss_bytes_per_token(True, (256, 512), args.hidden, args.vocab)
    print(f"| head + loss, hidden {args.hidden}, vocab {args.vocab:,} | peak bytes per token | per logit | "
          "b x 16 x 2048 tokens |\n|---|---|---|---|")
    for name, b in (("transformers (`ForCausalLMLoss`)", plain), ("fused (`training.fused_loss`)", fused)):
        print(f"| {name} | {b:,.0f} | {b / args.vocab:.2f} | {b * 32768 / 1e9:.2f} GB |")


if __name__ == "__main__":
    main()
