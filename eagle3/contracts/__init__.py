"""One module per stage output: the only code that reads or writes that format.

* :mod:`eagle3.contracts.samples`: stage 1's ``samples.jsonl``;
* :mod:`eagle3.contracts.tokenized`: stage 2's tokenized splits and row lengths;
* :mod:`eagle3.contracts.vocab_mapping`: stage 2's draft vocab mapping (d2t/t2d, ``mapping.json``);
* :mod:`eagle3.contracts.hidden_states`: stage 3's hidden-state files and manifest;
* :mod:`eagle3.contracts.drafter`: stage 4's exported drafter.

Import the submodule you need (``from eagle3.contracts import samples``); this package imports
nothing itself, so reading one format never loads another's dependencies.
"""
