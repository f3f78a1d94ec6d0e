#!/usr/bin/env bash
# One device call that records several truths at once (session 18): the new distributed configs (their
# per-rank peaks and allocator histories) and the allocator histories of the corpus scripts the estimate is
# furthest from. Everything lands under $OUT in at most 8 files (the device's limit), large archives split.
#   bash scripts/gpu_record_batch.sh  (DIST=names CORPUS=names to choose)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}; W=/tmp/w; mkdir -p "$OUT" $W/dist $W/dsnap $W/csnap
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
DIST=${DIST:-fsdp2-reshard2-w8,fsdp2-offload-w8,fsdp2-prefetch-w8,hsdp-ckpt-2x8,fsdp1-w8,fsdp1-noreshard-w8,tp-sp-w4,tp-ckpt-w4}
CORPUS=${CORPUS:-tv_efficientnet_b0_rmsprop bilstm_tagger_amp gru_classifier_packed t5_greedy_summarize diffusion_unet_ddpm rnn_eval two_tower_retrieval hf_distilbert_fp16 dlrm_recommender}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c 'import torch,sys; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), sys.version)'; } > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
timeout ${DIST_BUDGET_S:-220} python3 scripts/gpu_distributed_truth.py $W/dist --only "$DIST" --jobs 4 > $W/dist.log 2>&1
echo "dist truth $(( $(date +%s) - t0 )) s" >> $W/times.txt
cp $W/dist/distributed-truth.json.gz "$OUT/distributed-truth-new.json.gz"
# allocator histories: 3 distributed configs at a time, then 3 corpus scripts at a time
[ "${DIST_SNAPSHOTS:-1}" = 1 ] && echo "$DIST" | tr , '\n' | xargs -P 3 -I{} sh -c 'timeout 240 python3 scripts/gpu_distributed_truth.py --child {} --snapshot /tmp/w/dsnap/{}.pickle > /tmp/w/dsnap/{}.out 2>&1'
echo "dist snapshots $(( $(date +%s) - t0 )) s" >> $W/times.txt
echo $CORPUS | tr ' ' '\n' | timeout ${CORPUS_BUDGET_S:-330} xargs -P 3 -I{} sh -c 'cd bench/estimate/corpus && CORPUS_SNAPSHOT=/tmp/w/csnap/{}.pickle timeout 180 python3 ../../../scripts/gpu_corpus_truth.py --child {}.py > /tmp/w/csnap/{}.out 2>&1'
echo "corpus snapshots $(( $(date +%s) - t0 )) s" >> $W/times.txt
gzip -f $W/dsnap/*.pickle $W/csnap/*.pickle 2>/dev/null
tar -C $W -czf $W/dist-snapshots.tgz dsnap dist.log
tar -C $W -cf $W/corpus-snapshots.tar csnap
split -b 15M -d $W/dist-snapshots.tgz "$OUT/dist-snapshots.tgz.part"
split -b 15M -d $W/corpus-snapshots.tar "$OUT/corpus-snapshots.tar.part"
ls -la $W/dsnap $W/csnap >> $W/times.txt; cp $W/times.txt "$OUT/log.txt"; tail -30 $W/dist.log >> "$OUT/log.txt"
ls -la "$OUT"
