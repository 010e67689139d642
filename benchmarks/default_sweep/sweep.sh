# The embedded default's stage-4 settings trained side by side on one GPU, on the data of a finished CPU
# `make run`, each drafter scored on that run's stage-5 traffic (sweep_eval.py; no vLLM needed).
# Run from the checkout root on a GPU machine set up as docs/GPU.md describes. SRC: a folder with the CPU
# run's 01_synthesize, 02_vocab and 05_evaluate (vllm_eagle3.json, prompts.json). STEPS: any of
# prep extract share train eval (default all). VARIANTS: JSON name -> overrides (stage 4 only, or
# vocab: those get their own stages 2-3); RUNS: the run names to train and score (full = the default).
# RECIPE_ROOT: where the run directories go (default outputs/default_sweep).
W=$PWD; export PYTHONPATH=$W${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  HF_HUB_OFFLINE=1 RECIPE_ROOT=${RECIPE_ROOT:-$W/outputs/default_sweep} RECIPE_PARAMS=$W/benchmarks/default_sweep/default-gpu.yaml \
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} RECIPE_SET=${RECIPE_SET:-'{}'} RECIPE_VARIANTS=${VARIANTS:-'{}'}
P=$W/benchmarks/gpu_recipe/pipeline.py
SRC=${SRC:?SRC: the finished CPU run directory}
mkdir -p $RECIPE_ROOT
VOCAB_RUNS=$(python3 -c "import json, os; print(','.join(k for k, v in json.loads(os.environ['RECIPE_VARIANTS']).items() if 'vocab' in v))")
TRAIN_RUNS=$(python3 -c "import json, os; print(','.join(k for k, v in json.loads(os.environ['RECIPE_VARIANTS']).items() if 'vocab' not in v))")
ALL_RUNS=${RUNS:-full,$(echo $TRAIN_RUNS,$VOCAB_RUNS | sed 's/^,//;s/,$//')}
for step in ${STEPS:-prep extract share train eval}; do
  case $step in
    prep) mkdir -p $RECIPE_ROOT/full && for s in 01_synthesize 02_vocab; do [ -d $RECIPE_ROOT/full/$s ] || cp -r $SRC/$s $RECIPE_ROOT/full/; done
          python3 -c "import sys; sys.path.insert(0, '$W/benchmarks/gpu_recipe'); import pipeline as h
from eagle3.rundir import prepare_run_dir; prepare_run_dir(h.params_for('full'), h.ROOT / 'full')"  # its params.yaml
          echo "prep at ${SECONDS}s" ;;
    extract) python3 $P extract full 2>&1 | tail -3; grep -h EXTRACT $RECIPE_ROOT/full.extract.log | cut -c1-600; echo "extract at ${SECONDS}s" ;;
    share) [ -n "$TRAIN_RUNS" ] && python3 $P share full $TRAIN_RUNS 2>&1 | grep -E "SHARE|Error"
           if [ -n "$VOCAB_RUNS" ]; then
             SHARE_STAGES=1 python3 $P share full $VOCAB_RUNS 2>&1 | grep -E "SHARE|Error"
             python3 $P vocab $VOCAB_RUNS 2>&1 | tail -3; python3 $P extract $VOCAB_RUNS 2>&1 | tail -3
           fi; echo "share at ${SECONDS}s" ;;
    train) TRAIN_PARALLEL=1 python3 $P train $ALL_RUNS 2>&1 | grep -v -i warn | tail -${TRAIN_TAIL:-20} | cut -c1-700
           echo "train at ${SECONDS}s" ;;
    eval) python3 $W/benchmarks/default_sweep/sweep_eval.py $SRC/05_evaluate $(echo $ALL_RUNS | tr ',' '\n' | sed "s|^|$RECIPE_ROOT/|") 2>&1 \
            | grep -E "SWEEP_EVAL|Error|error" | tee $RECIPE_ROOT/sweep_eval.log; echo "eval at ${SECONDS}s" ;;
  esac
done
