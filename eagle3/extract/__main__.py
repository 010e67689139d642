"""``python -m eagle3.extract PARAMS.yaml [--run-dir DIR] [--set k=v] [--verify-only]``.

The entry point for data-parallel extraction: ``torchrun --nproc-per-node P -m eagle3.extract
PARAMS.yaml --run-dir DIR`` (each rank takes every P-th batch). Prints the stats as JSON (rank 0).
Exit code 0 on success, 1 on an ExtractError (the message is printed), 2 on invalid params.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run Stage 3 (or only the verify pass) and print the stats as JSON."""
    ap = argparse.ArgumentParser(prog="python -m eagle3.extract", description=__doc__.splitlines()[0])
    ap.add_argument("params", help="params YAML (the run's params.yaml works)")
    ap.add_argument("--run-dir", default=None, help="run directory (default: <run.output_dir>/<run.name>)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--verify-only", action="store_true", help="re-check an existing folder and exit")
    args = ap.parse_args(argv)

    from eagle3.errors import ExtractError, ParamsError
    from eagle3.extract import run, verify
    from eagle3.params_file import load_params
    from eagle3.rundir import prepare_run_dir, resolve_run_dir

    try:
        params = load_params(args.params, args.overrides)
        run_dir = args.run_dir or resolve_run_dir(params)
        if int(os.environ.get("RANK", "0")) == 0:
            prepare_run_dir(params, run_dir)
    except ParamsError as exc:
        print(f"eagle3 extract: {exc}", file=sys.stderr)
        return 2
    try:
        out = verify(run_dir) if args.verify_only else run(params, run_dir)
    except ExtractError as exc:
        print(f"eagle3 extract: {exc}", file=sys.stderr)
        return 1
    if out is not None:  # None: a data-parallel rank other than 0 (rank 0 prints the stats)
        print(json.dumps(out if isinstance(out, dict) else out.to_dict(), default=str)[:4000], flush=True)
    if args.verify_only and out["problems"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
