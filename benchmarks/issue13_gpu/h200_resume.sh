# Later calls: resume stage 1 if unfinished, then the curve's run dirs, stage 2, stage 3, stage 4 (STEPS=...).
# Also: restore (stage 1 from an earlier run's samples in RESTORE_DIR), share (SHARE_RUNS over SHARE_BASE),
# bench (bench_train.py --device cuda $BENCH_ARGS), train_bg (stage 4 of RUNS in the background, so that it
# outlives the call: later calls `tail $H200_ROOT/train_bg.log`; TRAIN_PARALLEL=1 trains them side by side),
# chain (stage 1 of full, stage 2, stage 3, `share` of SHARE_RUNS, then stage 4 of full + SHARE_RUNS side by side:
# one background job through consecutive calls, log $H200_ROOT/chain.log), wait (until no h200_pipeline.py
# process is left or WAIT_END seconds into the call, then the chain's log and every run's progress).
W=${H200_TREE:-$PWD/.devwork/wt}; export PYTHONPATH=$W:/tmp/site EAGLE3_CACHE=/tmp/e3cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export H200_SET=$(cat /tmp/h200_set.json) H200_ROOT=${H200_ROOT:-/tmp/runs}; mkdir -p $H200_ROOT
P=$W/benchmarks/issue13_gpu/h200_pipeline.py
for step in ${STEPS:-synth}; do
  case $step in
    restore) python3 $P restore ${RESTORE_DIR:-/tmp/restore} 2>&1 | grep -E "RESTORE|Error"; echo "restore at ${SECONDS}s" ;;
    share) SHARE_STAGES=${SHARE_STAGES:-1,2,3} python3 $P share ${SHARE_BASE:-full} $SHARE_RUNS 2>&1 | grep -E "SHARE|Error"; echo "share at ${SECONDS}s" ;;
    bench) timeout ${BENCH_S:-300} python3 $W/benchmarks/bench_train.py --device cuda $BENCH_ARGS 2>&1 | grep -v -i warn | tail -${BENCH_TAIL:-25}; echo "bench at ${SECONDS}s" ;;
    train_bg) setsid nohup python3 $P train ${RUNS:-full} > $H200_ROOT/train_bg.log 2>&1 < /dev/null &
              echo "train_bg started at ${SECONDS}s: $H200_ROOT/train_bg.log" ;;
    synth) timeout $((${SYNTH_END:-575} - SECONDS)) python3 $P synth >> $H200_ROOT/full.synth.log 2>&1; echo "synth rc $? at ${SECONDS}s"
           grep -v -i warn $H200_ROOT/full.synth.log | tr '\r' '\n' | grep -E "SYNTH|Error|error" | tail -5 ;;
    chain) setsid nohup bash -c "python3 $P synth && python3 $P vocab full && python3 $P extract full \
             && python3 $P share full $SHARE_RUNS && TRAIN_PARALLEL=1 python3 $P train full,$SHARE_RUNS" \
             > $H200_ROOT/chain.log 2>&1 < /dev/null &
           echo "chain started at ${SECONDS}s: $H200_ROOT/chain.log" ;;
    wait) while pgrep -f h200_pipeline.py > /dev/null && [ $SECONDS -lt ${WAIT_END:-570} ]; do sleep 5; done
          echo "wait ended at ${SECONDS}s; pipeline running: $(pgrep -fc h200_pipeline.py)"
          cat $H200_ROOT/*.log | grep -v -i warn | tr '\r' '\n' | grep -E "SYNTH|VOCAB|EXTRACT|SHARE|TRAIN|rc |Error|error" | cut -c1-900 | tail -12
          python3 -c "import glob, json; [print(f, *(json.load(open(f)).get(k) for k in ('status', 'done', 'total', 'tokens_per_s', 'eta_s')),
                      {k: v for k, v in json.load(open(f)).get('extra', {}).items() if k in ('phase', 'tau_hat', 'loss')})
                      for f in sorted(glob.glob('$H200_ROOT/*/0[1-4]_*/progress.json'))]"; df -h /tmp | tail -1 ;;
    subsets) python3 $P subsets ${SIZES:-1000,4000,16000} 2>&1 | grep -E "SUBSET|Error" ; echo "subsets at ${SECONDS}s" ;;
    vocab) python3 $P vocab ${VRUNS:-full,n1000,n4000,n16000} 2>&1 | tail -8; grep -h VOCAB $H200_ROOT/*.vocab.log | cut -c1-600; echo "vocab at ${SECONDS}s" ;;
    extract) timeout $((${EXTRACT_END:-580} - SECONDS)) python3 $P extract ${XRUNS:-full,n16000,n4000,n1000} 2>&1 | tail -8; echo "extract at ${SECONDS}s"
           grep -h EXTRACT $H200_ROOT/*.extract.log | cut -c1-900; df -h /tmp | tail -1 ;;
    train) timeout $((${TRAIN_END:-580} - SECONDS)) python3 $P train ${RUNS:-full,n16000,n4000,n1000} 2>&1 | tail -8; echo "train at ${SECONDS}s"
           grep -h TRAIN $H200_ROOT/*.train.log | cut -c1-900
           for f in $H200_ROOT/*/04_train/progress.json; do echo $f; cut -c1-400 $f; echo; done ;;
  esac
done
