"""swerl's slime plugin (imported as `swerl.trainer_plugin`): the hooks slime loads by dotted path.

    --custom-generate-function-path       swerl.trainer_plugin.generate
    --custom-rm-path                      swerl.trainer_plugin.reward_func
    --custom-rollout-log-function-path    swerl.trainer_plugin.log_rollout_data
    --dynamic-sampling-filter-path        swerl.trainer_plugin.filter_infra_failures
    --custom-reward-post-process-path     swerl.trainer_plugin.post_process_rewards

The plugin installs light: grpcio and the generated agent stubs. Nothing from slime (or Docker,
or transformers) is imported at module import time; see slime_glue.py for what is read from
slime at run time. Settings: settings.py.
"""

from swerl.trainer_plugin.hooks import (
    filter_infra_failures,
    generate,
    log_rollout_data,
    post_process_rewards,
    reward_func,
)

__all__ = [
    "filter_infra_failures",
    "generate",
    "log_rollout_data",
    "post_process_rewards",
    "reward_func",
]
