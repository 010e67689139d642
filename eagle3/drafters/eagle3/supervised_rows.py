"""The drafter's heads and loss computed only on the rows the loss mask supervises (``train.supervised_rows``)."""

from __future__ import annotations

__all__ = ["SupervisedRows"]


class SupervisedRows:
    """Compute the drafter's lm head, the verifier's head and the loss only on the rows that the
    loss and the metrics of speculators' ``Eagle3DraftModel.forward`` read (``train.supervised_rows``).

    The forward runs both heads (``[1, T, H] -> [1, T, draft_vocab]``, H x draft_vocab MACs a row)
    and the per-position loss over every packed position, then multiplies by the loss mask; about
    59 % of the embedded default's packed tokens are supervised (the rest are prompts and template
    boilerplate). Installed once on a drafter, a forward pre-hook reads ``loss_mask`` ``[1, T]`` and
    ``ttt_steps`` of each call and builds, per TTT step ``s`` (speculators' ``align_for_step``: the
    logits of draft start ``p`` are scored against target position ``p + s``):

    * drafter rows ``R_s``: ``p < T - s`` with ``mask[p + s]`` (the loss and the accuracy) or
      ``mask[p]`` (``prev_correct``, which only masked draft starts carry, feeds the later steps);
    * verifier rows: ``q`` with ``mask[q - j]`` for some ``j < ttt_steps`` (every target a computed
      drafter row is compared with);
    * loss rows: ``p`` with ``mask[p + s]``.

    Every other row of the heads' outputs is zero (and of the per-position loss): the loss, its
    gradients, the accuracies and ``prev_correct`` equal the full computation (tests/test_train.py);
    only the returned draft tokens differ, on the rows outside ``R_s`` (argmax over zeros): validation's
    ``chain_lengths`` reads draft ``s`` only at starts ``p`` with ``mask[p + s]``, which are in ``R_s``.
    A call without ``loss_mask`` or ``verifier_last_hidden_states`` computes every row.

    Not with ``train.compile: speculators`` (the hooks' Python state would recompile the graph).

    Args:
        model: an ``Eagle3DraftModel`` (patched in place: ``lm_head`` / ``verifier_lm_head``
            instance ``forward``; the state dict is unchanged, so checkpoints and the export are).
        loss_config: speculators' ``{name: (fn, weight)}``; :meth:`wrap_loss` returns it with each
            per-position fn computing only the loss rows.
    """

    def __init__(self, model) -> None:
        self.plan: dict | None = None
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        for name in ("lm_head", "verifier_lm_head"):
            head = getattr(model, name)
            head.forward = self._head_forward(head.forward, name)

    def _pre(self, module, args, kwargs):
        import torch

        mask = kwargs.get("loss_mask")
        if mask is None or kwargs.get("verifier_last_hidden_states") is None:
            self.plan = None
            return None
        m = mask.reshape(-1).to(torch.bool)
        T, ttt = m.numel(), int(kwargs.get("ttt_steps", 3))  # 3: the forward's own default, for a call without it
        drafter, losses = [], []
        for s in range(ttt):
            shifted = torch.zeros_like(m)
            shifted[: T - s] = m[s:]
            rows = shifted.clone()
            rows[: T - s] |= m[: T - s]
            drafter.append(rows.nonzero().squeeze(1))
            losses.append(m[s:].nonzero().squeeze(1))
        verifier = m.clone()
        for j in range(1, ttt):
            verifier[j:] |= m[: T - j]
        self.plan = {"lm_head": drafter, "verifier_lm_head": [verifier.nonzero().squeeze(1)], "loss": losses,
                     "calls": {}}
        return None

    def _next(self, key: str):
        """The rows of this call of ``key`` (the n-th call of a forward uses the n-th step's rows)."""
        if self.plan is None:
            return None
        n = self.plan["calls"].get(key, 0)
        self.plan["calls"][key] = n + 1
        rows = self.plan["lm_head" if key == "lm_head" else key.split(":")[0]]
        return rows[n] if n < len(rows) else None

    def _head_forward(self, forward, name: str):
        def rows_forward(x):  # x: [1, T, H] -> [1, T, out]
            rows = self._next(name)
            if rows is None:
                return forward(x)
            y = forward(x.index_select(1, rows))
            return y.new_zeros(x.shape[0], x.shape[1], y.shape[-1]).index_copy(1, rows, y)

        return rows_forward

    def wrap_loss(self, loss_config: dict) -> dict:
        """``loss_config`` with each per-position loss fn ``(logits [1, S, V], targets [1, S, V]) ->
        [1, S]`` evaluated on the loss rows only (zeros elsewhere; they are masked out anyway)."""
        out = {}
        for name, (fn, weight) in loss_config.items():
            def rows_fn(logits, targets, _fn=fn, _key=f"loss:{name}"):
                rows = self._next(_key)
                if rows is None:
                    return _fn(logits, targets)
                y = _fn(logits.index_select(1, rows), targets.index_select(1, rows))
                return y.new_zeros(logits.shape[0], logits.shape[1]).index_copy(1, rows, y)

            out[name] = (rows_fn, weight)
        return out
