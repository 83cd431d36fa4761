"""STAND-INS of the frameworks' default data source and prompt dataset — not the frameworks' code.

Mirrors `slime/rollout/data_source.py` and `slime/utils/data.py` of THUDM/slime at commit
624b824a898ab0ec1fcb4d373004c7f3852bf515, and `miles/rollout/data_source.py` and
`miles/utils/data.py` of radixark/miles at commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76 (the
same logic in both), as far as a data source wrapped by `--data-source-path` meets them:

- `RolloutDataSource(args)`: with `args.rollout_global_dataset`, a `Dataset` of
  `args.prompt_data` (JSONL; `--input-key`, `--label-key`, `--metadata-key`), shuffled per epoch
  with `args.rollout_seed + epoch` when `args.rollout_shuffle`; `get_samples(num_samples)`
  returns `num_samples` groups (a `list[list[Sample]]`) of `args.n_samples_per_prompt` deep
  copies of the next rows, numbering `group_index` and `index` on, and starts the next epoch
  (reshuffled) when the rows run out; `epoch_id`, `sample_offset`, `sample_group_index`,
  `sample_index` and `metadata` are its state;
- `RolloutDataSourceWithBuffer(args)`: a `buffer` of groups handed back with `add_samples`
  (aborted partial rollouts), served first through `args.buffer_filter_path` (default
  `pop_first`); `get_buffer_length()`, `update_metadata` / `get_metadata`;
- `len(source)` = the dataset's length.

Left out: tokenizers, chat templates, multimodal inputs and long-prompt filtering (the rows here
are plain text); `save` / `load` write JSON where the frameworks use torch.save. The permutation
of `shuffle` is the same (Python's `random` seeded with seed + epoch).
"""

from __future__ import annotations

import copy
import json
import os
import random
import types
from typing import Any

from testkit.standin_common import load_function


def build(package: str, sample_cls: type) -> dict[str, types.ModuleType]:
    """The modules `<package>.utils.data` and `<package>.rollout.data_source`, for `sample_cls`."""

    class Dataset:
        def __init__(
            self,
            path: str,
            tokenizer: Any,
            processor: Any,
            max_length: int | None,
            *,
            prompt_key: str = "text",
            multimodal_keys: Any = None,
            label_key: str | None = None,
            tool_key: str | None = None,
            metadata_key: str = "metadata",
            seed: int = 42,
            apply_chat_template: bool = False,
            apply_chat_template_kwargs: Any = None,
        ) -> None:
            origin = []
            with open(path) as lines:
                for line in lines:
                    if not line.strip():
                        continue
                    data = json.loads(line)
                    origin.append(
                        sample_cls(
                            prompt=data[prompt_key],
                            label=data[label_key] if label_key is not None else None,
                            metadata=data.get(metadata_key) or {},
                        )
                    )
            self.origin_samples = origin
            self.epoch_id = -1
            self.seed = seed
            self.samples = self.origin_samples

        def shuffle(self, new_epoch_id: int) -> None:
            if self.epoch_id == new_epoch_id:
                return
            random.seed(self.seed + new_epoch_id)
            permutation = list(range(len(self.samples)))
            random.shuffle(permutation)
            self.samples = [self.origin_samples[i] for i in permutation]
            self.epoch_id = new_epoch_id

        def __getitem__(self, idx: int) -> Any:
            return self.samples[idx]

        def __len__(self) -> int:
            return len(self.samples)

    class RolloutDataSource:
        def __init__(self, args: Any) -> None:
            self.args = args
            self.epoch_id = 0
            self.sample_group_index = 0
            self.sample_index = 0
            self.sample_offset = 0
            self.metadata: dict[str, Any] = {}
            self.dataset: Any
            if args.rollout_global_dataset and args.prompt_data is not None:
                self.dataset = Dataset(
                    args.prompt_data,
                    tokenizer=None,
                    processor=None,
                    max_length=args.rollout_max_prompt_len,
                    prompt_key=args.input_key,
                    label_key=args.label_key,
                    metadata_key=args.metadata_key,
                    seed=args.rollout_seed,
                )
                if args.rollout_shuffle:
                    self.dataset.shuffle(self.epoch_id)
            else:
                self.dataset = None

        def get_samples(self, num_samples: int) -> list[list[Any]]:
            if self.dataset is not None:
                end = self.sample_offset + num_samples
                if end <= len(self.dataset):
                    rows = self.dataset.samples[self.sample_offset : end]
                    self.sample_offset = end
                else:
                    rows = list(self.dataset.samples[self.sample_offset :])
                    num_samples -= len(rows)
                    self.epoch_id += 1
                    if self.args.rollout_shuffle:
                        self.dataset.shuffle(self.epoch_id)
                    rows += self.dataset.samples[:num_samples]
                    self.sample_offset = num_samples
            else:
                rows = [sample_cls() for _ in range(num_samples)]
            groups = []
            for row in rows:
                group = []
                for _ in range(self.args.n_samples_per_prompt):
                    sample = copy.deepcopy(row)
                    sample.group_index = self.sample_group_index
                    sample.index = self.sample_index
                    self.sample_index += 1
                    group.append(sample)
                self.sample_group_index += 1
                groups.append(group)
            return groups

        def add_samples(self, samples: list[list[Any]]) -> None:
            raise RuntimeError(f"Cannot add samples to {type(self).__name__}.")

        def _state_path(self, directory: str, rollout_id: Any) -> str:
            return os.path.join(directory, f"rollout/global_dataset_state_dict_{rollout_id}.json")

        def save(self, rollout_id: Any) -> None:
            if not self.args.rollout_global_dataset:
                return
            path = self._state_path(self.args.save, rollout_id)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            state = {
                "sample_offset": self.sample_offset,
                "epoch_id": self.epoch_id,
                "sample_group_index": self.sample_group_index,
                "sample_index": self.sample_index,
                "metadata": self.metadata,
            }
            with open(path, "w") as out:
                json.dump(state, out)

        def load(self, rollout_id: Any = None) -> None:
            if not self.args.rollout_global_dataset or self.args.load is None:
                return
            path = self._state_path(self.args.load, rollout_id)
            if not os.path.exists(path):
                return
            with open(path) as source:
                state = json.load(source)
            self.sample_offset = state.get("sample_offset", 0)
            self.epoch_id = state.get("epoch_id", 0)
            self.sample_group_index = state.get("sample_group_index", 0)
            self.sample_index = state.get("sample_index", 0)
            self.metadata = state.get("metadata", {})
            if self.args.rollout_shuffle and self.dataset is not None:
                self.dataset.shuffle(self.epoch_id)

        def __len__(self) -> int:
            return 0 if self.dataset is None else len(self.dataset)

    class RolloutDataSourceWithBuffer(RolloutDataSource):
        def __init__(self, args: Any) -> None:
            super().__init__(args)
            self.buffer: list[list[Any]] = []
            self.buffer_filter = load_function(args.buffer_filter_path) or pop_first

        def get_samples(self, num_samples: int) -> list[list[Any]]:
            groups = self._get_samples_from_buffer(num_samples)
            num_samples -= len(groups)
            if num_samples == 0:
                return groups
            return groups + super().get_samples(num_samples=num_samples)

        def _get_samples_from_buffer(self, num_samples: int) -> list[list[Any]]:
            if not self.buffer or num_samples == 0:
                return []
            return self.buffer_filter(self.args, None, self.buffer, num_samples)

        def add_samples(self, samples: list[list[Any]]) -> None:
            if not samples:
                return
            assert isinstance(samples, list) and isinstance(samples[0], list)
            for group in samples:
                assert len(group) == self.args.n_samples_per_prompt
                self.buffer.append(group)

        def update_metadata(self, metadata: dict[str, Any]) -> None:
            self.metadata.update(metadata)

        def get_metadata(self) -> dict[str, Any]:
            return self.metadata

        def get_buffer_length(self) -> int:
            return len(self.buffer)

    def pop_first(args: Any, rollout_id: Any, buffer: list[Any], num_samples: int) -> list[Any]:
        taken = buffer[: min(len(buffer), num_samples)]
        del buffer[: len(taken)]
        return taken

    data = types.ModuleType(f"{package}.utils.data")
    data.Dataset = Dataset
    source = types.ModuleType(f"{package}.rollout.data_source")
    source.RolloutDataSource = RolloutDataSource
    source.RolloutDataSourceWithBuffer = RolloutDataSourceWithBuffer
    source.pop_first = pop_first
    return {data.__name__: data, source.__name__: source}


def install(monkeypatch: Any, sys_modules: dict[str, Any], package: str, sample_cls: type) -> None:
    """Puts both modules under the framework's names (and on their parent packages)."""
    for name, module in build(package, sample_cls).items():
        parent, _, child = name.rpartition(".")
        if parent in sys_modules:
            monkeypatch.setattr(sys_modules[parent], child, module, raising=False)
        monkeypatch.setitem(sys_modules, name, module)


# The framework arguments the data source reads (`train.py` defaults, plus the data flags).
DATA_ARGS = {
    "rollout_global_dataset": True,
    "rollout_max_prompt_len": None,
    "input_key": "text",
    "label_key": None,
    "metadata_key": "metadata",
    "rollout_shuffle": False,
    "rollout_seed": 42,
    "buffer_filter_path": None,
    "over_sampling_batch_size": None,
    "save": None,
    "load": None,
}
