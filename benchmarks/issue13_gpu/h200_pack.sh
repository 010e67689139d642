# Bring back: each named drafter as a tar in <= 15 MiB parts, and one tar.xz of every run's stats,
# metrics, progress and the full run's samples (the subsets' samples are its first N lines).
R=${H200_ROOT:-/tmp/runs}
cd $R || exit 1
for n in ${PACK:-full n4000 n1000}; do
  [ -d $n/04_train/drafter ] && tar cf - -C $n/04_train drafter | split -b 15M - $OUT/drafter_$n.tar.part_
done
tar cJf $OUT/stats.tar.xz --exclude='*/checkpoints' --exclude='*/drafter' --exclude='*.parquet' --exclude='*.safetensors' \
  */01_synthesize */02_vocab/stats.json */04_train *.log 2>/dev/null
ls -la $OUT; sha256sum $OUT/* | cut -c1-80
