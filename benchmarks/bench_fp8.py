"""fp8 hidden states: reconstruction error of the storage choices on the embedded target's real states.

  .venv/bin/python benchmarks/bench_fp8.py [--prompts N] [--max-len T]

The embedded SmolLM2-135M target (float32, CPU) captures its stored layers (aux ids [2, 15, 27] and
layer 30 before the final norm, :class:`eagle3.hooks.PrefillCapture`) over the first N AlpacaEval
instructions rendered with its chat template (``../shared/data/prompts/alpaca_eval_instructions.jsonl``
when present, else the project's general-chat set, ``eagle3/data/general_chat.jsonl``), and stores them every way considered for
``extract.dtype: float8_e4m3fn``: bf16 (the reference), fp8 without a scale, fp8 with one float32
scale per token and slot (the contract's :func:`eagle3.contracts.hidden_states.quantize_fp8`), and fp8
with one scale per block of 32 / 64 / 192 channels (576 = 3 x 192), and fp8 with one scale per token
over all slots (hs_connectors' FP8HiddenStatesConnector). Per storage: bytes per token and
slot, the relative L2 error per token and slot (mean, per stored layer), the smallest mean cosine over
the slots, and the largest absolute error relative to the vector's maximum. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from eagle3.contracts.hidden_states import FP8, FP8_MAX, dequantize_fp8, quantize_fp8

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "alpaca_eval_instructions.jsonl"


def blockwise(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp8 with one absmax/448 scale per ``block`` channels, dequantized (the alternative not taken)."""
    b = x.unflatten(-1, (-1, block))
    amax = b.abs().amax(-1, keepdim=True)
    sc = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return ((b / sc).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * sc).flatten(-2)


def prompts(n: int) -> tuple[str, list[str]]:
    if PROMPTS.exists():
        recs = [json.loads(x) for x in PROMPTS.read_text(encoding="utf-8").splitlines() if x.strip()][:n]
        key = next(k for k in ("instruction", "prompt", "text") if k in recs[0])
        return "AlpacaEval instructions", [r[key] for r in recs]
    gc = Path(__file__).resolve().parents[1] / "eagle3" / "data" / "general_chat.jsonl"
    return "general-chat prompts", [json.loads(x)["prompt"] for x in gc.read_text(encoding="utf-8").splitlines()][:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=256)
    a = ap.parse_args(argv)
    from eagle3.config import TargetParams
    from eagle3.hooks import PrefillCapture
    from eagle3.target import load_target

    torch.set_num_threads(1)
    model, tok, _ = load_target(TargetParams(model="embedded:smollm2-135m", dtype="float32", device="cpu"))
    name, texts = prompts(a.prompts)
    cap = PrefillCapture(model, None, torch.float32)
    states = []
    for t in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"][:, : a.max_len]
        states.append(cap.capture(ids)[0])
    hs = torch.cat(states)  # [tokens, 4, 576] float32
    H = hs.shape[-1]
    print(f"{hs.shape[0]} tokens of {len(texts)} {name} (chat template), stored layers {cap.stored_layers}, "
          f"torch {torch.__version__}")
    q, s = quantize_fp8(hs)
    rows = [("bfloat16 (reference)", hs.to(torch.bfloat16).float(), 2 * H),
            ("fp8, no scale", hs.to(FP8).float(), H),
            ("**fp8, one fp32 scale per token and slot (the contract)**", dequantize_fp8(q, s), H + 4)]
    rows += [(f"fp8, one fp32 scale per {b} channels", blockwise(hs, b), H + 4 * H // b) for b in (32, 64, 192)]
    # hs_connectors' FP8HiddenStatesConnector: one scale per token over all slots ([seq, 1, 1])
    rows.append(("fp8, one fp32 scale per token over all slots (hs_connectors)",
                 blockwise(hs.flatten(1), hs.shape[1] * H).view_as(hs), H + 4 / hs.shape[1]))
    print(f"\n| storage | bytes per token and slot (H={H}) | rel. L2 error per token and slot, layers "
          f"{cap.stored_layers} | cosine (min over slots) | max abs error / vector max |")
    print("|---|---|---|---|---|")
    for label, xh, nb in rows:
        d = xh - hs
        rel = (d.norm(dim=-1) / hs.norm(dim=-1).clamp_min(1e-30)).mean(0)
        cos = torch.nn.functional.cosine_similarity(xh, hs, dim=-1).mean(0)
        mx = (d.abs().amax(-1) / hs.abs().amax(-1).clamp_min(1e-30)).max()
        print(f"| {label} | {nb:g} ({nb / (2 * H):.3f}x bf16) | " + " / ".join(f"{v:.4f}" for v in rel.tolist())
              + f" | {float(cos.min()):.5f} | {float(mx):.4f} |")
    ratio = (hs.abs().amax(-1) / hs.abs().median(-1).values).mean(0)
    print("\nvector max / median |x| per slot (mean over tokens): " + ", ".join(f"{v:.1f}" for v in ratio.tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
