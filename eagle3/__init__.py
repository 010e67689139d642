"""eagle3: train EAGLE-3 speculative-decoding drafters and prove their acceptance in vLLM.

One package per stage (``synthesize``, ``vocab``, ``extract``, ``train``, ``evaluate``) over
``contracts`` (the one reader/writer of each stage's files), ``drafters`` (the drafter-kind registry,
one folder per kind), ``prompts`` (prompt sources) and ``stage`` (the stage lifecycle: progress,
records, inputs); below them ``config`` + ``params_file`` (typed params), ``rundir`` (every path of a
run), ``io``, ``target``, ``chat``, ``hooks``, ``tracking`` (W&B), ``vllm_utils``; on top ``commands``
(run, status, verify, report) and ``cli``. See docs/DESIGN.md, "As built".
"""

__version__ = "0.1.0"
