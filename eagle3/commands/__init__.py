"""The ``eagle3`` commands, one module each: :mod:`~eagle3.commands.run` (execute the stage notebooks),
:mod:`~eagle3.commands.status` (where a run is), :mod:`~eagle3.commands.verify` (a run's integrity
checks), :mod:`~eagle3.commands.report` (the executed notebooks as HTML). :mod:`eagle3.cli` parses the
command line and dispatches to them; each is imported only by the command that uses it (papermill,
nbconvert and jupyter_client are slow to import).
"""
