"""``eagle3 compare``: several runs side by side on one page (notebook 06, ``notebooks/06_compare_runs.ipynb``).

* :mod:`eagle3.compare.runs`: each run read through its stages' contracts (:class:`RunView`);
* :mod:`eagle3.compare.tables`: the params that differ, the training data, the evaluation per set,
  category and position, parity and warnings, a column per run;
* :mod:`eagle3.compare.figures`: the training curves overlaid, the drafter per set, and the
  data-scaling curve when the runs differ only in how many conversations they trained on.

The command that executes the notebook and writes the page: :mod:`eagle3.commands.compare`.
"""

from eagle3.compare.figures import Scaling, plot_curves, plot_scaling, plot_sets, scaling
from eagle3.compare.runs import RunView, read_run, read_runs, run_labels
from eagle3.compare.tables import (
    category_table,
    data_table,
    eval_sets,
    params_table,
    parity_table,
    position_table,
    runs_table,
    set_coverage,
    set_table,
    warnings_table,
)

__all__ = ["RunView", "read_run", "read_runs", "run_labels", "runs_table", "params_table", "data_table", "eval_sets",
           "set_coverage", "set_table", "category_table", "position_table", "parity_table", "warnings_table",
           "Scaling", "scaling", "plot_curves", "plot_sets", "plot_scaling"]
