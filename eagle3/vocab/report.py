"""Stage 2's report: the coverage explorer of notebook 02 (tables, figures, an ipywidgets slider)
and the tokenization table.

Everything here reads stage 2's files (token counts, the train split, row lengths, the mapping);
nothing is written. Figures are ``matplotlib.figure.Figure`` objects (never pyplot state). Every
coverage and OOV number comes from :class:`eagle3.vocab.mapping.Coverage`, the computation the
stage's ``stats.json`` uses, padding ids of the real mapping included.
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from eagle3.contracts import tokenized
from eagle3.vocab.mapping import COMMON_SIZES, Coverage

__all__ = ["CoverageExplorer", "source_counts", "masked_sample_html", "report_table", "show_masked_rows"]


def source_counts(table, vocab_size: int) -> dict[str, np.ndarray]:
    """Masked-token frequencies per prompt source: ``{source: int64 [V]}`` (vectorized).

    Args:
        table: ``pyarrow.Table`` with ``source``, ``input_ids``, ``loss_mask``.
        vocab_size: target vocab size V.
    """
    import pyarrow.compute as pc

    src = table.column("source").combine_chunks()
    ids = pc.list_flatten(table.column("input_ids")).to_numpy(zero_copy_only=False)
    mask = pc.list_flatten(table.column("loss_mask")).to_numpy(zero_copy_only=False).astype(bool)
    parent = pc.list_parent_indices(table.column("input_ids")).to_numpy(zero_copy_only=False)
    enc = src.dictionary_encode()
    codes = enc.indices.to_numpy(zero_copy_only=False)[parent]
    out = {}
    for c, name in enumerate(enc.dictionary.to_pylist()):
        sel = mask & (codes == c)
        out[name] = np.bincount(ids[sel], minlength=vocab_size).astype(np.int64)
    return out


def _token_repr(tok, tid: int) -> str:
    if tok is None:
        return str(tid)
    return repr(tok.decode([int(tid)]))


def masked_sample_html(tokenizer, input_ids, loss_mask, max_tokens: int = 400) -> str:
    """HTML of one row with supervised tokens highlighted (blue) and context grey."""
    parts = []
    for t, m in list(zip(input_ids, loss_mask))[:max_tokens]:
        text = html.escape(tokenizer.decode([int(t)])).replace("\n", "↵<br>")
        style = "background:#cfe3ff;color:#000" if m else "color:#888"
        parts.append(f'<span style="{style}" title="{int(t)}">{text}</span>')
    more = "" if len(input_ids) <= max_tokens else f" <i>... {len(input_ids) - max_tokens} more tokens</i>"
    return '<div style="font-family:monospace;white-space:pre-wrap;line-height:1.5">' + "".join(parts) + more + "</div>"


class CoverageExplorer:
    """What a draft vocab of a given size keeps and loses, on the train and held-out masked tokens.

    Args:
        counts: int64 ``[V]`` train masked-token frequencies.
        heldout_counts: int64 ``[V]`` held-out frequencies (or None).
        by_source: ``{source: int64 [V]}`` train frequencies per prompt source (or None).
        tokenizer: decodes token ids in tables (or None: ids only).
        chosen_size: the run's draft vocab size (marked in plots).
        lengths: int64 row lengths before truncation (train), for the length histogram.
        max_seq_len: the truncation length.
    """

    def __init__(self, counts, heldout_counts=None, by_source=None, tokenizer=None, chosen_size=None,
                 lengths=None, max_seq_len=None):
        self.cov = Coverage.from_counts(np.asarray(counts))
        self.heldout = None if heldout_counts is None else np.asarray(heldout_counts, dtype=np.int64)
        self.by_source = by_source or {}
        self.tok = tokenizer
        self.chosen_size = chosen_size
        self.lengths = None if lengths is None else np.asarray(lengths)
        self.max_seq_len = max_seq_len

    @classmethod
    def from_run(cls, run_dir: str | Path, params=None, tokenizer=None) -> CoverageExplorer:
        """Load stage 2's files of a run (tokenizer from ``params.target`` when not given)."""
        from eagle3.contracts.vocab_mapping import read_mapping
        from eagle3.vocab.mapping import read_counts

        counts, held = read_counts(run_dir)
        table = tokenized.read_table(run_dir, "train", ["source", "input_ids", "loss_mask"])
        chosen = read_mapping(run_dir).draft_vocab_size
        if tokenizer is None and params is not None:
            from eagle3.target import load_tokenizer, resolve_target

            tokenizer = load_tokenizer(resolve_target(params.target), params.target.trust_remote_code)
        return cls(counts, held, source_counts(table, counts.size), tokenizer, chosen,
                   tokenized.read_row_lengths(run_dir, "train"), params.vocab.max_seq_len if params is not None else None)

    # ---- numbers

    def heldout_oov_rate(self, size: int) -> float | None:
        """Share of held-out masked tokens outside the size-``size`` draft vocab, padding included
        (:meth:`Coverage.oov_rate`, as ``stats.json``'s ``heldout_oov_rate``); 0 at full size."""
        return None if self.heldout is None else self.cov.oov_rate(self.heldout, size)

    def heldout_coverage(self, size: int) -> float | None:
        """1 - :meth:`heldout_oov_rate`."""
        oov = self.heldout_oov_rate(size)
        return None if oov is None else 1 - oov

    def summary(self, size: int) -> dict:
        """Coverage, masked tokens lost (train), held-out coverage/OOV rate at one draft vocab size."""
        oov = self.heldout_oov_rate(size)
        return {
            "draft_vocab_size": int(size),
            "coverage": self.cov.at(size),
            "masked_tokens": self.cov.total,
            "masked_tokens_lost": self.cov.lost(size),
            "distinct_tokens": self.cov.distinct,
            "distinct_tokens_lost": max(self.cov.distinct - int(size), 0),
            "heldout_coverage": None if oov is None else 1 - oov,
            "heldout_oov_rate": oov,
        }

    def telling_sizes(self) -> list[int]:
        """Draft vocab sizes that say something about this corpus: 1/16, 1/8, 1/4 and 1/2 of its
        distinct masked tokens, the common sizes (:data:`COMMON_SIZES`) below that count, the chosen
        size, and the distinct count itself (every token kept) when no chosen size reaches it. A size
        at or above the distinct count covers everything (coverage 1.0): 8K, 16K and 32K on a corpus
        of 7,061 distinct tokens would be three equal rows."""
        d, V = self.cov.distinct, self.cov.vocab_size
        sizes = {max(1, round(d * f)) for f in (1 / 16, 1 / 8, 1 / 4, 1 / 2)} | {s for s in COMMON_SIZES if s < d}
        if self.chosen_size:
            sizes.add(int(self.chosen_size))
        if not self.chosen_size or self.chosen_size < d:
            sizes.add(d)
        return sorted(s for s in sizes if 1 <= s <= V)

    def sizes_table(self, sizes=None):
        """DataFrame: :meth:`summary` at ``sizes`` (default :meth:`telling_sizes`)."""
        import pandas as pd

        return pd.DataFrame([self.summary(s) for s in sorted(sizes or self.telling_sizes())])

    def start_size(self) -> int:
        """The size the explorer opens on: the chosen size when it loses something, else half the
        corpus's distinct tokens (a chosen size holding every token shows "nothing lost")."""
        d = self.cov.distinct
        if self.chosen_size and self.chosen_size < d:
            return int(self.chosen_size)
        return max(1, round(d / 2)) if d > 1 else int(self.chosen_size or self.cov.vocab_size)

    def top_lost(self, size: int, n: int = 20):
        """DataFrame of the ``n`` most frequent tokens outside a draft vocab of ``size``:
        rank, token id, decoded token, count and share of the masked-token mass (%)."""
        import pandas as pd

        k = min(int(size), self.cov.distinct)
        ids = self.cov.order[k : min(k + n, self.cov.distinct)]
        total = max(self.cov.total, 1)
        return pd.DataFrame({
            "rank": np.arange(k + 1, k + 1 + ids.size),
            "token_id": ids,
            "token": [_token_repr(self.tok, t) for t in ids],
            "count": self.cov.counts[ids],
            "mass_%": 100.0 * self.cov.counts[ids] / total,
        })

    def by_source_table(self, size: int):
        """DataFrame: per prompt source, masked tokens and their coverage by the top-``size`` vocab."""
        import pandas as pd

        kept = self.cov.kept_mask(size)
        rows = [{"source": s, "masked_tokens": int(c.sum()),
                 "coverage": float(c[kept].sum() / c.sum()) if c.sum() else None}
                for s, c in sorted(self.by_source.items())]
        return pd.DataFrame(rows)

    # ---- static plots

    def plot_coverage(self):
        """Coverage curve (train, and held-out when present) against draft vocab size, log x,
        with markers at 8K/16K/32K/64K and the chosen size. Returns a matplotlib Figure."""
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        n = max(self.cov.distinct, 1)
        x = np.unique(np.geomspace(1, self.cov.vocab_size, 400).astype(int))
        ax.plot(x, [self.cov.at(k) for k in x], label="train (masked tokens)")
        if self.heldout is not None and self.heldout.sum():
            ax.plot(x, self.cov.curve(self.heldout)[x - 1], "--", label="held-out")
        for s, mk in zip(COMMON_SIZES, "sD^v"):
            if s <= self.cov.vocab_size:
                ax.axvline(s, color="grey", lw=0.6, ls=":")
                ax.plot([s], [self.cov.at(s)], mk, color="grey", ms=5, label=f"{s // 1024}K: {self.cov.at(s):.4f}")
        if self.chosen_size:
            c = self.cov.at(self.chosen_size)
            ax.plot([self.chosen_size], [c], "ro", label=f"chosen {self.chosen_size}: {c:.4f}")
        ax.axvline(n, color="k", lw=0.5, alpha=0.4)
        ax.set_xscale("log")
        ax.set_xlabel("draft vocab size (top-k tokens by masked frequency)")
        ax.set_ylabel("share of masked-token mass covered")
        ax.set_title(f"Coverage: {self.cov.total:,} masked tokens, {self.cov.distinct:,} distinct")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        return fig

    def plot_rank_frequency(self):
        """Rank-frequency of masked tokens on log-log axes. Returns a matplotlib Figure."""
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        freq = self.cov.counts[self.cov.order[: self.cov.distinct]]
        ax.loglog(np.arange(1, freq.size + 1), freq, ".", ms=2)
        if self.chosen_size and self.chosen_size < freq.size:
            ax.axvline(self.chosen_size, color="r", lw=0.8, label=f"draft vocab {self.chosen_size}")
            ax.legend(fontsize=8)
        ax.set_xlabel("rank")
        ax.set_ylabel("masked-token count")
        ax.set_title("Rank-frequency (log-log)")
        ax.grid(alpha=0.3, which="both")
        return fig

    def plot_lengths(self):
        """Histogram of row lengths before truncation with the ``max_seq_len`` line. Returns a Figure."""
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        if self.lengths is not None and self.lengths.size:
            ax.hist(self.lengths, bins=50, color="tab:blue", alpha=0.8)
            if self.max_seq_len:
                over = int((self.lengths > self.max_seq_len).sum())
                ax.axvline(self.max_seq_len, color="r", label=f"max_seq_len={self.max_seq_len} ({over} rows truncated)")
                ax.legend(fontsize=8)
        ax.set_xlabel("tokens per row (before truncation)")
        ax.set_ylabel("rows")
        ax.set_title("Sequence lengths (train)")
        return fig

    def figures(self) -> dict:
        """``{name: Figure}`` of the three static plots (names used for the PNG files)."""
        return {"coverage_curve": self.plot_coverage(), "rank_frequency": self.plot_rank_frequency(),
                "sequence_lengths": self.plot_lengths()}

    # ---- interactive

    def render_html(self, size: int, n_lost: int = 15) -> str:
        """HTML block shown by the widget at one size: summary, top lost tokens, coverage by source."""
        s = self.summary(size)
        hc = "n/a" if s["heldout_coverage"] is None else f"{s['heldout_coverage']:.4%} (OOV {s['heldout_oov_rate']:.4%})"
        head = (f"<b>draft vocab {size:,}</b>: train coverage <b>{s['coverage']:.4%}</b>, "
                f"masked tokens lost {s['masked_tokens_lost']:,} of {s['masked_tokens']:,}; held-out coverage {hc}")
        lost = self.top_lost(size, n_lost)
        lost_html = lost.to_html(index=False) if len(lost) else "<p>nothing lost at this size</p>"
        return (head + "<br><b>Top lost tokens</b>" + lost_html
                + "<b>Coverage by prompt source</b>" + self.by_source_table(size).to_html(index=False))

    def widget(self, step: float = 0.05):
        """An ipywidgets control over the draft vocab size - a log-scale slider (base 2, ``step`` in
        log2 units: every useful size of a small corpus gets room) plus an exact entry - updating the
        coverage, the masked tokens lost, the top lost tokens (decoded, with their mass) and the
        coverage by prompt source. Its display bundle also carries ``text/html``: the same block at the
        starting size, shown where widgets cannot run (the rendered report)."""
        import math

        import ipywidgets as w

        V = self.cov.vocab_size
        start = self.start_size()
        slider = w.FloatLogSlider(value=start, base=2, min=0, max=math.log2(V), step=step, description="draft vocab",
                                  continuous_update=False, readout_format=".0f", layout=w.Layout(width="90%"))
        box = w.BoundedIntText(value=start, min=1, max=V, description="exact")
        out = w.HTML(self.render_html(start))

        def from_slider(ch) -> None:
            box.value = min(max(int(round(ch["new"])), 1), V)

        def from_box(ch) -> None:
            out.value = self.render_html(int(ch["new"]))
            if int(round(slider.value)) != int(ch["new"]):
                slider.value = float(ch["new"])

        slider.observe(from_slider, names="value")
        box.observe(from_box, names="value")
        at = (f"the chosen draft vocab size {start:,}" if start == self.chosen_size else
              f"draft vocab size {start:,}, half of the corpus's {self.cov.distinct:,} distinct tokens"
              + (f" (the run's {int(self.chosen_size):,} keeps every one)" if self.chosen_size else ""))
        static = (f"<p><em>Static view at {at}: the slider needs a live kernel "
                  f"(open this notebook in JupyterLab).</em></p>" + self.render_html(start))

        class Explorer(w.VBox):
            # the widget, plus a text/html rendering of its starting state: JupyterLab shows the widget
            # (its renderer outranks text/html); the HTML report and viewers without a widget manager
            # show the static block instead of the widget's repr
            def _repr_mimebundle_(self, **kwargs):
                bundle = super()._repr_mimebundle_(**kwargs)
                if isinstance(bundle, tuple):
                    bundle = bundle[0]
                return {**(bundle or {}), "text/html": static}

        return Explorer([w.HBox([slider, box]), out])


def report_table(stats: dict):
    """DataFrame of the per-split tokenization counts in stage 2's stats (rows: counters, columns: splits);
    ``stats`` is a :class:`~eagle3.vocab.stage.VocabStats` or the ``stats.json`` dict."""
    import pandas as pd

    reps = stats.get("tokenize_reports", {}) if isinstance(stats, dict) else stats.tokenize_reports
    keys = ["samples", "rows", "tokens", "supervised_tokens", "assistant_turns", "history_rerendered_samples",
            "exploded_rows", "boundary_retokenized_turns", "boundary_fallback_turns", "no_stop_token_turns",
            "length_cut_turns", "reasoning_not_rendered_turns", "turns_with_completion_tokens",
            "turns_matching_completion_tokens", "truncated_rows", "truncated_tokens",
            "truncated_supervised_tokens", "dropped_rows_after_truncation", "no_supervised_samples", "failed_samples"]
    # every row is a count: nullable Int64 keeps a missing one (None) from making its column float64
    return pd.DataFrame({split: [r.get(k) for k in keys] for split, r in reps.items()}, index=keys).astype("Int64")


def show_masked_rows(run_dir, tokenizer, n: int = 2, split: str = "train", max_tokens: int = 400) -> None:
    """Display the first ``n`` rows of a split with supervised tokens highlighted (notebook helper)."""
    from IPython.display import HTML, display

    table = tokenized.read_table(run_dir, split).slice(0, n)
    for row in table.to_pylist():
        head = (f"<b>{html.escape(row['id'])}</b> ({html.escape(row['source'])}, {len(row['input_ids'])} tokens, "
                f"{sum(row['loss_mask'])} supervised)")
        display(HTML(head + masked_sample_html(tokenizer, row["input_ids"], row["loss_mask"], max_tokens)))
