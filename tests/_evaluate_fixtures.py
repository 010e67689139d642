"""Test drafters for Stage 5, built here so that the tests do not depend on Stage 4.

:func:`make_drafter` builds speculators' ``Eagle3DraftModel`` for the embedded SmolLM2 target
(one Llama layer, a 2048-token draft vocab from token counts per the DESIGN rule, aux ids
[2, 15, 27], norm_before_residual) and writes it through Stage 4's writer
(:func:`eagle3.drafters.eagle3.export_drafter`), the format vLLM loads. With ``train_steps > 0``
it is fitted for a few dozen steps (speculators' forward with TTT and its KL loss) on the target's
own hidden states for greedy continuations of ``TRAIN_QUESTIONS``, so that it accepts a meaningful
share of drafts on the similar ``EVAL_QUESTIONS``.
"""

from __future__ import annotations

from pathlib import Path

TRAIN_QUESTIONS = [
    "Write a Python function that returns the sum of a list of numbers.",
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the maximum of a list.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that computes the factorial of n.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that removes duplicates from a list.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the average of a list of numbers.",
]
EVAL_QUESTIONS = [
    "Write a Python function that returns the minimum of a list.",
    "Write a Python function that multiplies all numbers in a list.",
    "Write a Python function that counts the words in a string.",
    "Write a Python function that returns the squares of a list of numbers.",
]
AUX_IDS = [2, 15, 27]
DRAFT_VOCAB = 2048


def render(tok, question: str) -> list[int]:
    """Prompt ids of one user question (chat template + generation prompt, as vLLM renders it)."""
    from eagle3.chat import ChatRenderer

    return ChatRenderer(tok).prompt_ids([{"role": "user", "content": question}])


def greedy(model, ids: list[int], n: int) -> list[int]:
    """Target-only greedy continuation (transformers ``generate``), the lossless reference."""
    import torch

    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=model.config.eos_token_id)
    return out[0, len(ids):].tolist()


def greedy_batch(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of several prompts in one left-padded batch, cut after the first EOS."""
    import torch

    eos = model.config.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=n, do_sample=False, pad_token_id=eos)
    res = []
    for row in out[:, width:].tolist():
        res.append(row[: row.index(eos) + 1] if eos in row else row)
    return res


def _mapping(counts, size: int):
    """d2t/t2d per DESIGN: rank by (-count, id), keep the top ``size``, sort ascending."""
    import torch

    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))[:size]
    kept = torch.tensor(sorted(order), dtype=torch.long)
    d2t = kept - torch.arange(size)
    t2d = torch.zeros(len(counts), dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def make_drafter(target_dir: str | Path, out_dir: str | Path, model, tok, train_steps: int = 0,
                 seed: int = 0, lr: float = 2e-3, gen_tokens: int = 48) -> Path:
    """Build (and optionally fit) an EAGLE-3 drafter for the embedded target; returns ``out_dir``."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, DynamicCache

    from eagle3.drafters.eagle3 import export_drafter
    from eagle3.hooks import CachedCapture

    torch.manual_seed(seed)
    prompts = [render(tok, q) for q in TRAIN_QUESTIONS]
    conts = greedy_batch(model, prompts, gen_tokens) if train_steps else [[] for _ in prompts]
    seqs = list(zip(prompts, conts))
    counts = [0] * model.config.vocab_size
    for ids, cont in seqs:
        for t in ids + cont:
            counts[t] += 1
    d2t, t2d = _mapping(counts, DRAFT_VOCAB)

    vc = AutoConfig.from_pretrained(target_dir)
    vc.num_hidden_layers = 1
    vc._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=vc, draft_vocab_size=DRAFT_VOCAB, norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=list(AUX_IDS), target_hidden_size=vc.hidden_size,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            verifier=VerifierConfig.from_pretrained(str(target_dir))))
    m = Eagle3DraftModel(cfg)
    m.load_vocab_mappings(t2d, d2t)
    m.load_verifier_weights()
    if train_steps:
        n = model.config.num_hidden_layers
        runner = CachedCapture(model, [*AUX_IDS, n])
        data = []
        with torch.no_grad():
            for ids, cont in seqs:
                full = ids + cont
                _, aux = runner.forward(torch.tensor([full]), DynamicCache())
                h = vc.hidden_size
                mask = torch.tensor([0] * len(ids) + [1] * len(cont), dtype=torch.bool)
                # speculators' shift_batch: token t+1 pairs with the states at t
                data.append(dict(hidden_states=aux[:-1, : 3 * h][None], input_ids=torch.tensor([full[1:]]),
                                 verifier_last_hidden_states=aux[1:, 3 * h:][None], loss_mask=mask[1:][None],
                                 position_ids=torch.arange(1, len(full))[None],
                                 document_ids=torch.zeros(1, len(full) - 1, dtype=torch.long)))
        runner.close()
        from speculators.losses.utils import resolve_loss_config

        loss_config = resolve_loss_config("kl_div", "eager")  # the fused loss is a Triton (GPU) kernel
        params = [p for p in m.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr)
        m.train()
        for step in range(train_steps):
            _, loss, _ = m(**data[step % len(data)], ttt_steps=3, loss_config=loss_config)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        m.eval()
    return export_drafter(m, out_dir, verifier_name=str(target_dir))  # Stage 4's writer
