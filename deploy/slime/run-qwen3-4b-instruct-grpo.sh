#!/usr/bin/env bash
# The seeds' setup — Qwen3-4B-Instruct-2507 with GRPO on SWE tasks, as the miles swe-agent
# example trained it — with swerl in place of that example's agent: 4 GPUs, tensor parallel 2,
# one GPU per SGLang engine, 8 prompts x 8 samples per rollout, temperature 0.8, responses up to
# 8192 tokens per turn, KL coefficient 0.01. It runs run-qwen3-8b-grpo.sh with these defaults
# (every one can still be set from the environment), under miles by default:
#
#   SWERL_TOKEN=... SWERL_CAPABILITY_SECRET=... EXEC_NODES="n1=10.0.0.11:5000" \
#     bash deploy/slime/run-qwen3-4b-instruct-grpo.sh              # miles (MILES_DIR=/root/miles)
#   FRAMEWORK=slime bash deploy/slime/run-qwen3-4b-instruct-grpo.sh  # slime (SLIME_DIR=/root/slime)
#
# Like the base script it resumes after a restart: --load is the --save directory.
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"

export FRAMEWORK=${FRAMEWORK:-miles}
export MODEL_TYPE=${MODEL_TYPE:-qwen3-4B-Instruct-2507}
export HF_CHECKPOINT=${HF_CHECKPOINT:-/root/Qwen3-4B-Instruct-2507}
export REF_LOAD=${REF_LOAD:-/root/Qwen3-4B-Instruct-2507_torch_dist}
export SAVE_DIR=${SAVE_DIR:-/root/Qwen3-4B-Instruct-2507_swerl}
export NUM_GPUS=${NUM_GPUS:-4}
export TP_SIZE=${TP_SIZE:-2}
export ENGINE_GPUS=${ENGINE_GPUS:-1}
export ROLLOUT_BATCH=${ROLLOUT_BATCH:-8}
export N_SAMPLES=${N_SAMPLES:-8}
export TEMPERATURE=${TEMPERATURE:-0.8}
export RESPONSE_LEN=${RESPONSE_LEN:-8192}
export KL_COEF=${KL_COEF:-0.01}
export SAVE_INTERVAL=${SAVE_INTERVAL:-100}

exec bash "${SCRIPT_DIR}/run-qwen3-8b-grpo.sh"
