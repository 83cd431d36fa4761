"""swerl's trainer plugin for slime and miles (imported as `swerl.trainer_plugin`): the hooks
the framework loads by dotted path.

    --custom-generate-function-path       swerl.trainer_plugin.generate
                                          (miles' class-based rollout: .miles_generate)
    --custom-rm-path                      swerl.trainer_plugin.reward_func
    --custom-rollout-log-function-path    swerl.trainer_plugin.log_rollout_data
    --custom-eval-rollout-log-function-path  swerl.trainer_plugin.log_eval_rollout_data
    --dynamic-sampling-filter-path        swerl.trainer_plugin.filter_infra_failures
    --custom-reward-post-process-path     swerl.trainer_plugin.post_process_rewards
    --data-source-path                    swerl.trainer_plugin.data_source.PrefetchingDataSource
                                          (image prefetch of the fetched and the next batch)

The plugin installs light: grpcio and the generated agent stubs. Nothing from the framework (or
Docker, or transformers) is imported at module import time; framework.py is the one place that
reads slime or miles at run time. Settings: settings.py.
"""

from swerl.trainer_plugin.hooks import (
    filter_infra_failures,
    generate,
    log_eval_rollout_data,
    log_rollout_data,
    miles_generate,
    post_process_rewards,
    reward_func,
)

__all__ = [
    "filter_infra_failures",
    "generate",
    "log_eval_rollout_data",
    "log_rollout_data",
    "miles_generate",
    "post_process_rewards",
    "reward_func",
]
