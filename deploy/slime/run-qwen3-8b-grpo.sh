#!/usr/bin/env bash
# GRPO training of a Qwen3-8B-class model on SWE tasks with slime (or miles) and swerl.
#
# Runs on the head node of a Ray cluster inside the framework's image (with `pip install swerl`
# added). FRAMEWORK=miles runs miles' train.py from MILES_DIR instead of slime's (the hooks are
# the same; under miles' default class-based rollout generate is swerl.trainer_plugin.miles_generate).
# A restarted job resumes: --load is the --save directory (slime and miles fall back to the
# reference weights only while it holds no checkpoint yet).
#   1. starts the head-node services (pool, agent, optionally PRM) — as a Ray actor owned by the
#      training job (SERVICES_MODE=ray-actor, the default: they stop with the job) or as
#      background processes stopped when this script exits (SERVICES_MODE=processes);
#   2. passes the plugin's settings to slime's RolloutManager through Ray's runtime env
#      (SWERL_PLUGIN_*) and slime's --custom-config-path (swerl_* keys);
#   3. submits slime's train.py with the swerl hooks.
# Exec nodes run `swerl exec serve` on the Docker hosts (systemd); list them in EXEC_NODES.
#
#   SWERL_TOKEN=... SWERL_CAPABILITY_SECRET=... EXEC_NODES="n1=10.0.0.11:5000 n2=10.0.0.12:5000" \
#     bash deploy/slime/run-qwen3-8b-grpo.sh
#
# Every variable below can be set from the environment. See deploy/slime/README.md.
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"

# -- where things are ---------------------------------------------------------------------------
FRAMEWORK=${FRAMEWORK:-slime}               # slime | miles
case "${FRAMEWORK}" in
  slime) FRAMEWORK_DIR=${SLIME_DIR:-/root/slime} ;;
  miles) FRAMEWORK_DIR=${MILES_DIR:-/root/miles} ;;
  *) echo "FRAMEWORK must be slime or miles" >&2; exit 2 ;;
esac
MODEL_TYPE=${MODEL_TYPE:-qwen3-8B}          # the framework's scripts/models/<MODEL_TYPE>.sh (.py)
MEGATRON_DIR=${MEGATRON_DIR:-/root/Megatron-LM}
HF_CHECKPOINT=${HF_CHECKPOINT:-/root/Qwen3-8B}
REF_LOAD=${REF_LOAD:-/root/Qwen3-8B_torch_dist}
SAVE_DIR=${SAVE_DIR:-/root/Qwen3-8B_swerl}
PROMPT_DATA=${PROMPT_DATA:-/root/swe_train.jsonl}   # `swerl data prepare` output (text + metadata)
ARTIFACT_DIR=${ARTIFACT_DIR:-/root/swerl-artifacts}  # per-episode traj.json, on the agent's host
STATE_DIR=${STATE_DIR:-/var/lib/swerl}
LOG_DIR=${LOG_DIR:-/tmp/swerl-head}

# -- cluster ------------------------------------------------------------------------------------
NUM_GPUS=${NUM_GPUS:-8}
HEAD_IP=${HEAD_IP:-$(hostname -I | awk '{print $1}')}
RAY_DASHBOARD=${RAY_DASHBOARD:-http://127.0.0.1:8265}
START_RAY=${START_RAY:-1}

# -- swerl --------------------------------------------------------------------------------------
SERVICES_MODE=${SERVICES_MODE:-ray-actor}   # ray-actor | processes | external
EXEC_NODES=${EXEC_NODES:-}                  # "node_id=host:port ..." for the pool
WITH_PRM=${WITH_PRM:-0}                     # 1: start PrmService and shape rewards with it
PRM_JUDGE_URL=${PRM_JUDGE_URL:-}            # SGLang router of the judge model (PRM on)
PRM_JUDGE_TOKENIZER=${PRM_JUDGE_TOKENIZER:-}  # the judge model's HF tokenizer directory
DYNAMIC_HISTORY=${DYNAMIC_HISTORY:-0}       # 1: one training sample per turn
POOL_PORT=${POOL_PORT:-18090}
AGENT_PORT=${AGENT_PORT:-18091}
PRM_PORT=${PRM_PORT:-18092}
AGENT_ADDRESSES=${AGENT_ADDRESSES:-${HEAD_IP}:${AGENT_PORT}}   # SERVICES_MODE=external: yours
# The pool the plugin prefetches task images through (PrefetchImages): the head's own pool, or
# (SERVICES_MODE=external) yours; PREFETCH=0 or no pool address: no prefetch.
POOL_ADDRESS=${POOL_ADDRESS:-}
[[ -z "${POOL_ADDRESS}" && "${SERVICES_MODE}" != external ]] && POOL_ADDRESS=${HEAD_IP}:${POOL_PORT}
PREFETCH=${PREFETCH:-1}
: "${SWERL_TOKEN:?set SWERL_TOKEN: the bearer token of the swerl services}"
: "${SWERL_CAPABILITY_SECRET:?set SWERL_CAPABILITY_SECRET: shared by the pool and exec nodes}"

# -- the run: the seeds' key arguments ----------------------------------------------------------
CONTEXT_LEN=${CONTEXT_LEN:-16384}
RESPONSE_LEN=${RESPONSE_LEN:-4096}
N_SAMPLES=${N_SAMPLES:-8}
ROLLOUT_BATCH=${ROLLOUT_BATCH:-8}
MAX_TURNS=${MAX_TURNS:-50}
TEMPERATURE=${TEMPERATURE:-1.0}
KL_COEF=${KL_COEF:-0.0}
TP_SIZE=${TP_SIZE:-2}                       # tensor parallel size of training
ENGINE_GPUS=${ENGINE_GPUS:-2}               # GPUs per SGLang engine
# The framework's SGLang router policy: one that routes by X-SMG-Routing-Key (the agent sends the
# episode id), so an episode's turns stay on one engine and hit its prefix cache.
# consistent_hashing in slime's and miles' router build; PyPI's sglang-router 0.3.2 calls it manual.
ROUTER_POLICY=${ROUTER_POLICY:-consistent_hashing}
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-${CONTEXT_LEN}}
SAVE_INTERVAL=${SAVE_INTERVAL:-20}
# The agent config (swerl/agent/configs/<name>.yaml): `default` (one bash block per reply) or
# `tools` (the model's native tool calls). This one variable also sets SGLang's tool-call and
# reasoning parsers: the names are read from the config, so swerl and SGLang parse alike.
AGENT_CONFIG=${AGENT_CONFIG:-default}
read -r TOOL_CALL_PARSER REASONING_PARSER < <(python3 -c 'import sys
from swerl.agent.config import load_config
c = load_config(sys.argv[1])
print(c.tool_call_parser if c.tool_calls else "-", c.reasoning_parser if c.tool_calls else "-")' \
  "${AGENT_CONFIG}") || { echo "no agent config named ${AGENT_CONFIG}" >&2; exit 2; }

SERVICES=pool,agent
[[ "${WITH_PRM}" == 1 ]] && SERVICES=pool,prm,agent

# The services' own settings (SWERL_<SVC>_*): one token for every hop here.
SERVICE_ENV=(
  "SWERL_POOL_AUTH_TOKEN=${SWERL_TOKEN}"
  "SWERL_POOL_NODE_AUTH_TOKEN=${SWERL_TOKEN}"
  "SWERL_POOL_CAPABILITY_SECRET=${SWERL_CAPABILITY_SECRET}"
  "SWERL_AGENT_AUTH_TOKEN=${SWERL_TOKEN}"
  "SWERL_AGENT_POOL_AUTH_TOKEN=${SWERL_TOKEN}"
  "SWERL_PRM_AUTH_TOKEN=${SWERL_TOKEN}"
)
if [[ "${WITH_PRM}" == 1 ]]; then
  : "${PRM_JUDGE_URL:?set PRM_JUDGE_URL (the judge's SGLang router) when WITH_PRM=1}"
  : "${PRM_JUDGE_TOKENIZER:?set PRM_JUDGE_TOKENIZER (the judge's tokenizer) when WITH_PRM=1}"
  SERVICE_ENV+=("SWERL_PRM_JUDGE_URL=${PRM_JUDGE_URL}"
    "SWERL_PRM_JUDGE_TOKENIZER_PATH=${PRM_JUDGE_TOKENIZER}")
fi
# The plugin's settings, read inside slime's RolloutManager actor.
PLUGIN_ENV=(
  "SWERL_PLUGIN_AGENT_ADDRESSES=${AGENT_ADDRESSES}"
  "SWERL_PLUGIN_AGENT_TOKEN=${SWERL_TOKEN}"
  "SWERL_PLUGIN_DYNAMIC_HISTORY=$([[ ${DYNAMIC_HISTORY} == 1 ]] && echo true || echo false)"
  "SWERL_PLUGIN_PRM_ENABLED=$([[ ${WITH_PRM} == 1 ]] && echo true || echo false)"
  "SWERL_PLUGIN_ARTIFACT_DIR=${ARTIFACT_DIR}"
  "SWERL_PLUGIN_FRAMEWORK=${FRAMEWORK}"
  "SWERL_PLUGIN_CONFIG_NAME=${AGENT_CONFIG}"
)

# The same settings as slime custom-config keys (swerl_*; they win over the env vars). Limits live
# here so a run's YAML records them. No swerl_episode_deadline_s: the plugin derives it from the
# agents' bound on an episode (600 s lease wait + 3600 s wall_timeout + 600 s eval_timeout + 60 s
# grading overhead = 4860 s) plus 60 s, and refuses one not above that bound.
PLUGIN_CONFIG=${PLUGIN_CONFIG:-${LOG_DIR}/swerl-plugin.yaml}
mkdir -p "${LOG_DIR}"
cat >"${PLUGIN_CONFIG}" <<YAML
swerl_max_turns: ${MAX_TURNS}
swerl_max_context_tokens: ${CONTEXT_LEN}
swerl_command_timeout_s: 180
swerl_eval_timeout_s: 600
swerl_prm_m: 3
swerl_prm_coef: 0.2
YAML

# -- framework arguments ------------------------------------------------------------------------
# MODEL_ARGS of the architecture: slime's scripts/models/*.sh, or miles' newer *.py model scripts.
MODELS_DIR="${FRAMEWORK_DIR}/scripts/models"
if [[ -f "${MODELS_DIR}/${MODEL_TYPE}.sh" ]]; then
  # shellcheck disable=SC1090
  source "${MODELS_DIR}/${MODEL_TYPE}.sh"
elif [[ -f "${MODELS_DIR}/${MODEL_TYPE}.py" ]]; then
  model_args=$(PYTHONPATH="${FRAMEWORK_DIR}" python3 -c \
    'import sys; from miles.utils.external_utils.model_args_utils import load_model_args
print(load_model_args(sys.argv[1]))' "${MODEL_TYPE}")
  read -r -a MODEL_ARGS <<<"${model_args}"
else
  echo "no model arguments for ${MODEL_TYPE} in ${MODELS_DIR}" >&2
  exit 2
fi

# --load = --save: a restarted job resumes from its last checkpoint instead of starting over.
CKPT_ARGS=(--hf-checkpoint "${HF_CHECKPOINT}" --ref-load "${REF_LOAD}" --load "${SAVE_DIR}"
  --save "${SAVE_DIR}" --save-interval "${SAVE_INTERVAL}")
ROLLOUT_ARGS=(
  --prompt-data "${PROMPT_DATA}" --input-key text --metadata-key metadata --rollout-shuffle
  --num-rollout 3000 --rollout-batch-size "${ROLLOUT_BATCH}" --n-samples-per-prompt "${N_SAMPLES}"
  --rollout-max-context-len "${CONTEXT_LEN}" --rollout-max-response-len "${RESPONSE_LEN}"
  --rollout-temperature "${TEMPERATURE}" --global-batch-size $((ROLLOUT_BATCH * N_SAMPLES))
  --balance-data
  # Groups with infra failures are dropped and resampled: ask for a few more than needed.
  --over-sampling-batch-size $((ROLLOUT_BATCH + ROLLOUT_BATCH / 2))
)
GRPO_ARGS=(--advantage-estimator grpo --use-kl-loss --kl-loss-coef "${KL_COEF}" --kl-loss-type low_var_kl
  --entropy-coef 0.0 --eps-clip 0.2 --eps-clip-high 0.28)
OPTIMIZER_ARGS=(--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.98)
PERF_ARGS=(--tensor-model-parallel-size "${TP_SIZE}" --pipeline-model-parallel-size 1
  --context-parallel-size 1 --sequence-parallel --recompute-granularity full
  --recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size
  --max-tokens-per-gpu "${MAX_TOKENS_PER_GPU}")
SGLANG_ARGS=(--rollout-num-gpus-per-engine "${ENGINE_GPUS}" --sglang-mem-fraction-static 0.7
  --router-policy "${ROUTER_POLICY}")
[[ "${TOOL_CALL_PARSER}" != - ]] && SGLANG_ARGS+=(--sglang-tool-call-parser "${TOOL_CALL_PARSER}")
[[ "${REASONING_PARSER}" != - ]] && SGLANG_ARGS+=(--sglang-reasoning-parser "${REASONING_PARSER}")
MISC_ARGS=(--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
  --attention-softmax-in-fp32 --attention-backend flash)
# miles' default rollout hands its abort flag only to generate functions taking `input`.
GENERATE_HOOK=swerl.trainer_plugin.generate
if [[ "${FRAMEWORK}" == miles && "${MILES_USE_LEGACY_ROLLOUT_V1:-0}" == 0 ]]; then
  GENERATE_HOOK=swerl.trainer_plugin.miles_generate
elif [[ "${FRAMEWORK}" == miles ]]; then
  PLUGIN_ENV+=("MILES_USE_LEGACY_ROLLOUT_V1=${MILES_USE_LEGACY_ROLLOUT_V1}")
fi
SWERL_ARGS=(
  --custom-generate-function-path "${GENERATE_HOOK}"
  --custom-rm-path swerl.trainer_plugin.reward_func
  --custom-rollout-log-function-path swerl.trainer_plugin.log_rollout_data
  --custom-eval-rollout-log-function-path swerl.trainer_plugin.log_eval_rollout_data
  --dynamic-sampling-filter-path swerl.trainer_plugin.filter_infra_failures
  --custom-reward-post-process-path swerl.trainer_plugin.post_process_rewards
  --custom-config-path "${PLUGIN_CONFIG}"
)
# Image prefetch: the data source (the framework's default, extended) sends the images of each
# fetched batch and of the next one to the pool, so their pulls overlap the running batch.
if [[ "${PREFETCH}" == 1 && -n "${POOL_ADDRESS}" ]]; then
  SWERL_ARGS+=(--data-source-path swerl.trainer_plugin.data_source.PrefetchingDataSource)
  PLUGIN_ENV+=("SWERL_PLUGIN_POOL_ADDRESS=${POOL_ADDRESS}" "SWERL_PLUGIN_POOL_TOKEN=${SWERL_TOKEN}")
fi
TRAIN=(python3 "${FRAMEWORK_DIR}/train.py" --actor-num-nodes 1 --actor-num-gpus-per-node "${NUM_GPUS}"
  --colocate "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${GRPO_ARGS[@]}"
  "${OPTIMIZER_ARGS[@]}" "${PERF_ARGS[@]}" "${SGLANG_ARGS[@]}" "${MISC_ARGS[@]}" "${SWERL_ARGS[@]}")

# -- Ray ----------------------------------------------------------------------------------------
if [[ "${START_RAY}" == 1 ]]; then
  ray start --head --node-ip-address "${HEAD_IP}" --num-gpus "${NUM_GPUS}" \
    --disable-usage-stats --dashboard-host 0.0.0.0 --dashboard-port 8265
fi

runtime_env() {  # JSON of Ray's runtime env: PYTHONPATH plus the given KEY=VALUE pairs
  python3 - "$@" <<'PY'
import json, os, sys
env = dict(pair.split("=", 1) for pair in sys.argv[1:])
env["PYTHONPATH"] = os.environ["RUNTIME_PYTHONPATH"]
env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
print(json.dumps({"env_vars": env}))
PY
}
export RUNTIME_PYTHONPATH="${MEGATRON_DIR}:${FRAMEWORK_DIR}"

# -- head-node services and the job -------------------------------------------------------------
read -r -a NODES <<<"${EXEC_NODES}"
PIDS=()
stop_processes() {
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    kill -TERM "-${PIDS[i]}" 2>/dev/null || true   # the process group: drain, then exit
  done
  wait || true
}

case "${SERVICES_MODE}" in
  ray-actor)
    # The job's entrypoint owns the services: head_services.py starts them in a Ray actor pinned
    # to this node, runs train.py, and stops them; a stopped or crashed job takes them along.
    ray job submit --address "${RAY_DASHBOARD}" \
      --runtime-env-json "$(runtime_env "${SERVICE_ENV[@]}" "${PLUGIN_ENV[@]}")" \
      -- python3 "${SCRIPT_DIR}/head_services.py" --services "${SERVICES}" \
      --exec-nodes "${NODES[@]}" --state-dir "${STATE_DIR}" --log-dir "${LOG_DIR}" \
      --pool-port "${POOL_PORT}" --agent-port "${AGENT_PORT}" --prm-port "${PRM_PORT}" \
      -- "${TRAIN[@]}"
    ;;
  processes)
    trap stop_processes EXIT
    start() {  # name port args...
      local name=$1 port=$2
      shift 2
      env "${SERVICE_ENV[@]}" setsid "$@" --host 0.0.0.0 --port "${port}" \
        >>"${LOG_DIR}/${name}.log" 2>&1 &
      PIDS+=($!)
      python3 "${SCRIPT_DIR}/head_services.py" --wait-serving "127.0.0.1:${port}" \
        --timeout-s 120 || { echo "${name} did not come up; see ${LOG_DIR}/${name}.log" >&2; exit 1; }
    }
    start pool "${POOL_PORT}" swerl pool serve --state-dir "${STATE_DIR}/pool" --nodes "${NODES[@]}"
    if [[ "${WITH_PRM}" == 1 ]]; then
      start prm "${PRM_PORT}" swerl prm serve
      SERVICE_ENV+=("SWERL_AGENT_PRM_ENDPOINT=127.0.0.1:${PRM_PORT}")
    fi
    SERVICE_ENV+=("SWERL_AGENT_POOL_ADDRESS=127.0.0.1:${POOL_PORT}")
    start agent "${AGENT_PORT}" swerl agent serve
    ray job submit --address "${RAY_DASHBOARD}" \
      --runtime-env-json "$(runtime_env "${PLUGIN_ENV[@]}")" -- "${TRAIN[@]}"
    ;;
  external)
    # Services run elsewhere (systemd, compose); AGENT_ADDRESSES names the agents.
    ray job submit --address "${RAY_DASHBOARD}" \
      --runtime-env-json "$(runtime_env "${PLUGIN_ENV[@]}")" -- "${TRAIN[@]}"
    ;;
  *)
    echo "SERVICES_MODE must be ray-actor, processes or external" >&2
    exit 2
    ;;
esac
