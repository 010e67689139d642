# Bring back (<= 8 files, 16 MiB each, 64 MiB a call): each drafter of PACK as a tar in 15 MiB parts,
# cast to bfloat16 first (RMSNorm gains stay float32, as export_drafter keeps them; d2t/t2d as they are),
# so that two 16,384-vocab drafters (2 x ~29 MB) fit one call; STATS=1: one tar.xz of every run's stats,
# metrics, progress, logs and figures; SAMPLES=1: the full run's samples.jsonl as xz in 15 MiB parts
# (the subsets' samples are the first N of the same prompts; stage 5 here needs the held-out split).
R=${H200_ROOT:-/tmp/runs}
cd $R || exit 1
for n in ${PACK:-}; do
  [ -d $n/04_train/drafter ] || { echo "no drafter in $n"; continue; }
  rm -rf /tmp/pack/$n && mkdir -p /tmp/pack/$n && cp -r $n/04_train/drafter /tmp/pack/$n/drafter
  python3 - /tmp/pack/$n/drafter/model.safetensors <<'PY'
import sys, torch
from safetensors.torch import load_file, save_file
p = sys.argv[1]
t = load_file(p)
out = {k: (v.to(torch.bfloat16) if v.is_floating_point() and "norm" not in k else v) for k, v in t.items()}
save_file(out, p, metadata={"format": "pt"})
print(p, {str(v.dtype) for v in out.values()}, sum(v.numel() * v.element_size() for v in out.values()) // 2**20, "MiB")
PY
  tar cf - -C /tmp/pack/$n drafter | split -b 15M - $OUT/drafter_$n.tar.part_
done
if [ -n "$STATS" ]; then
  tar cJf $OUT/stats.tar.xz --exclude='*/checkpoints' --exclude='*/drafter' --exclude='*.parquet' --exclude='*.safetensors' \
    --exclude='*/samples.jsonl' --exclude='*/03_extract/rows_*' --exclude='*/03_extract/manifest.jsonl' \
    */01_synthesize */02_vocab/stats.json */02_vocab/*.json */03_extract/*.json */04_train *.log 2>/dev/null
fi
if [ -n "$SAMPLES" ]; then
  xz -T8 -6 -c full/01_synthesize/samples.jsonl | split -b 15M - $OUT/samples_full.jsonl.xz.part_
fi
ls -la $OUT; sha256sum $OUT/* | cut -c1-80
