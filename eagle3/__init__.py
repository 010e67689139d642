"""eagle3: train EAGLE-3 speculative-decoding drafters and prove their acceptance in vLLM.

One thin module per stage (``synthesize``, ``vocab``, ``extract``, ``train``, ``evaluate``), plus
``config`` (typed params), ``io`` (file helpers), ``stage`` (the stage lifecycle and its records),
``target`` (model loading), ``tracking`` (W&B), ``commands`` (run, status, verify, report) and ``cli``.
See docs/DESIGN.md.
"""

__version__ = "0.1.0"
