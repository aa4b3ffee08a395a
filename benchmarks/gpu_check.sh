#!/usr/bin/env bash
# The prepared check for a lent GPU machine (one CUDA device), run from the repository root:
#   bash benchmarks/gpu_check.sh OUT_DIR
# 1. benchmarks/gpu_check.py: ParcaeStrategy vs Lightning's single-device strategy on cuda:0 (parameters, samples/s)
#    and a mid-training checkpoint resumed in a fresh process.
# 2. `parcae run --instances 1` of an unmodified Lightning script (strategy="parcae") with accelerator="gpu".
# 3. `parcae run --instances 2` on one GPU: must stop at once with the error that names the fix.
# 4. benchmarks/gpu_check.py --precision 16-mixed: the same comparison under fp16 with Lightning's GradScaler
#    (an inf forced into a gradient at step 15: skipped, the scale halved, in every run alike), the scaler state
#    saved in the mid-training checkpoint and resumed. Goals: fp16.scales_match, fp16.resume_started_from_saved_scaler
#    and fp16.final_scaler_match true, 15 in fp16.skipped (early steps may overflow by themselves too, alike in
#    every run); parameter differences ~0 (<= 1e-5).
# 5. benchmarks/gpu_check.py --model peer-lm / hf-gpt2 / hf-llama: issue 22's GPT-style LM (vocabulary 16,384) and
#    two transformers models from configs, each at P = 1 on cuda:0 against Lightning's single-device strategy, with
#    the mid-training resume. Goals as in 1.
set -u
out=${1:-/tmp/gpu_check}
mkdir -p "$out"
repo=$(pwd)
export PYTHONPATH=$repo PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, pytorch_lightning as pl; print('torch', torch.__version__, 'pl', pl.__version__, 'cuda', torch.cuda.is_available())"
echo "== 1. gpu_check.py"
timeout 300 python3 benchmarks/gpu_check.py --out "$out/gpu_check.json" 2>&1 | tail -25
for n in 1 2; do
  echo "== $((n + 1)). parcae run --instances $n, accelerator=gpu"
  d=/tmp/gpu_run$n; rm -rf $d; mkdir -p $d; cd $d
  timeout 240 python3 -m lightning_parcae.launch.run --instances $n --run-dir $d/run --progress-every 20 -- \
    python3 "$repo/tests/adoption/pl_transformer.py" --max-steps 60 --accelerator gpu > $d/launcher.log 2>&1
  echo "rc=$?"; tail -6 $d/launcher.log
  for f in $d/run/logs/*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -8; done
  cp $d/launcher.log "$out/launcher_$n.log"
  cd "$repo"
done
echo "== 4. gpu_check.py --precision 16-mixed (fp16 with a loss scaler, an overflow forced at step 15)"
timeout 300 python3 benchmarks/gpu_check.py --precision 16-mixed --overflow-at 15 --steps 40 \
  --out "$out/gpu_check_fp16.json" 2>&1 | tail -40
for model in peer-lm hf-gpt2 hf-llama; do
  echo "== 5. gpu_check.py --model $model (P = 1 on cuda:0)"
  timeout 300 python3 benchmarks/gpu_check.py --model $model --vocab 16384 --dim 512 --blocks 8 --steps 40 \
    --out "$out/gpu_check_$model.json" 2>&1 | tail -20
done
