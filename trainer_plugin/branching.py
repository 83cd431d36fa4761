"""Branching rollouts: the n samples of one prompt group as one trunk plus n branches.

With the setting `branch_at_turn` = k > 0, the framework's n generate calls of one prompt group
(same `group_index`; slime and miles start them together) meet here, and ONE `RunEpisode`
stream with `EpisodeOptions.branch{at_turn=k, count=n}` serves them all: the agent runs the
trunk to turn k once, forks its sandbox and exact token state, runs n branches with distinct
sampling seeds, and streams one result per branch. Member i (in `sample.index` order) gets the
samples of branch i, so a GRPO group shares its first k turns byte for byte and its advantages
are computed over the n branches.

The rendezvous (`Rendezvous`, one per event loop): the first member of a group to arrive creates
the group and its runner task (hooks.run_branch_group); the others join it. The runner starts
the episode once n members are there, or when `branch_rendezvous_timeout_s` has passed since the
first arrival with the members present (a group of one runs unbranched); a member that arrives
after its group started runs its own unbranched episode. The runner belongs to no member's
task, so a member whose call is cancelled only leaves the group (before the start: it is not
counted; after: its branch's result is dropped), and the stream is cancelled when every member
has left. Waiting members watch the framework's abort flag through the runner: an abort before
the start answers every member with an aborted placeholder at once.

How the one outcome is split (`split_outcome`): branch results go to their members; a trunk
that ended before the fork with a graded result (it submitted early) gives that result to the
first member and the others run their own unbranched episodes (the group still holds n
episodes of the prompt); a trunk that failed (INFRA_ERROR, FORK_UNAVAILABLE, no result at all)
makes every member an infra placeholder, so the filter drops the group; a trunk cancelled
before the fork gives the first member its partial trajectory and the others aborted
placeholders.

Dynamic history (`mark_trunk_turns`): every branch's per-turn records begin with the trunk's k
turns, identical in tokens and logprobs, and every member's list keeps its own copy of them, on
its own `rollout_id`, with its own branch's rewards (`metadata["branch_trunk"]` marks them). The
frameworks' loss reducer takes one token mean per `rollout_id` (its denominator
`rollout_mask_sums`: slime ray/rollout.py:685-700, divided by in backends/megatron_utils/
cp_utils.py:73-80 `sum_of_sample_mean`; miles ray/rollout/train_data_conversion.py:101, :162-169
and backends/training_utils/cp_utils.py:98-125), so each
member's rollout weighs exactly as one unbranched episode with that trajectory would: the same for
every member. (Emitting the trunk once under one member's `rollout_id` put extra tokens in that
member's denominator and down-weighted its own turns; the trunk cannot be a rollout of its own
either, since both frameworks require the samples of one returned list to share one `rollout_id`,
slime observability/rollout_data_utils.py:92-121, miles rollout_data_conversion.py:54-72.) The
trunk's tokens are trained n times, as n episodes that sampled the same prefix would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from swerl.agent.v1 import agent_pb2
from swerl.chassis.bounded import within
from swerl.trainer_plugin import convert
from swerl.trainer_plugin.episode import STREAM_ENDED_WITHOUT_RESULT, EpisodeOutcome

S = agent_pb2.EpisodeStatus
_UNGRADED = (S.EPISODE_STATUS_INFRA_ERROR, S.EPISODE_STATUS_CANCELLED, S.EPISODE_STATUS_ABORTED)
# A closed group is remembered this long for members that have not arrived yet.
CLOSED_GROUP_TTL_S = 3600.0


class RunAlone:
    """A member's answer from its group: run your own unbranched episode."""

    def __repr__(self) -> str:
        return "RUN_ALONE"


RUN_ALONE = RunAlone()


@dataclass(eq=False)
class Member:
    """One generate call of a group."""

    sample: Any
    sampling_params: dict[str, Any]
    # What the member's call returns (its sample or list), or RUN_ALONE; set by the runner.
    answer: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    left: bool = False

    @property
    def order(self) -> tuple[int, int]:
        index = getattr(self.sample, "index", None)
        return (0, index) if isinstance(index, int) else (1, 0)


class BranchGroup:
    """The members of one prompt group, until its episode starts."""

    def __init__(self, key: Any, size: int) -> None:
        self.key = key
        self.size = size
        self.members: list[Member] = []
        self.arrivals = 0
        self.full = asyncio.Event()
        self.closed_at: float | None = None
        self.runner: asyncio.Task[None] | None = None

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    async def assemble(
        self, timeout_s: float, poll_s: float, aborted: Callable[[], bool]
    ) -> tuple[list[Member], bool]:
        """Waits for all members (or the timeout, or an abort); closes the group. Returns the
        members present, in `sample.index` order, and whether the rollout was aborted."""
        deadline = time.monotonic() + timeout_s
        was_aborted = False
        while not self.full.is_set():
            if aborted():
                was_aborted = True
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self.full.wait(), min(poll_s, left))
        self.closed_at = time.monotonic()
        return sorted(self.members, key=lambda m: m.order), was_aborted

    async def wait(self, member: Member) -> Any:
        """The member's answer. A cancelled member leaves the group; the group's stream is
        cancelled once every member has left."""
        try:
            return await asyncio.shield(member.answer)
        except asyncio.CancelledError:
            self.leave(member)
            raise

    def leave(self, member: Member) -> None:
        member.left = True
        if not self.closed:
            self.members.remove(member)
            return
        if all(m.left for m in self.members) and self.runner is not None:
            self.runner.cancel()


class Rendezvous:
    """The open groups of one event loop, by key."""

    def __init__(self) -> None:
        self.groups: dict[Any, BranchGroup] = {}

    def join(
        self,
        key: Any,
        size: int,
        member: Member,
        run: Callable[[BranchGroup], Coroutine[Any, Any, None]],
    ) -> BranchGroup | None:
        """Adds `member` to its group (starting the group's runner `run(group)` on the first
        arrival); None when the group has already started (the member runs alone)."""
        self._forget_stale()
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = BranchGroup(key, size)
            group.runner = asyncio.ensure_future(run(group))
        group.arrivals += 1
        if group.arrivals >= group.size:
            # Every member has been seen: nobody else comes for this key.
            self.groups.pop(key, None)
        if group.closed:
            return None
        group.members.append(member)
        if len(group.members) >= group.size:
            group.full.set()
        return group

    def _forget_stale(self) -> None:
        now = time.monotonic()
        for key, group in list(self.groups.items()):
            if group.closed_at is not None and now - group.closed_at > CLOSED_GROUP_TTL_S:
                del self.groups[key]


_rendezvous: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Rendezvous] = (
    weakref.WeakKeyDictionary()
)


def rendezvous() -> Rendezvous:
    """The rendezvous of the running event loop (futures and tasks belong to their loop)."""
    loop = asyncio.get_running_loop()
    found = _rendezvous.get(loop)
    if found is None:
        found = _rendezvous[loop] = Rendezvous()
    return found


def group_size(args: Any, *, evaluation: bool, dataset: str = "") -> int:
    """n: the framework's samples per prompt (per eval prompt of `dataset` in evaluation)."""
    if evaluation:
        return eval_group_size(args, dataset)
    return int(getattr(args, "n_samples_per_prompt", 1) or 1)


def eval_group_size(args: Any, dataset: str) -> int:
    """The samples per prompt of one eval dataset: its own `n_samples_per_eval_prompt` where its
    config sets one, else the run's `n_samples_per_eval_prompt`, else `n_samples_per_prompt`
    (the order of the frameworks' eval config, slime `utils/eval_config.py:11-15`)."""
    for config in getattr(args, "eval_datasets", None) or []:
        if getattr(config, "name", None) == dataset:
            own = getattr(config, "n_samples_per_eval_prompt", None)
            if own:
                return int(own)
    for name in ("n_samples_per_eval_prompt", "n_samples_per_prompt"):
        value = getattr(args, name, None)
        if value:
            return int(value)
    return 1


def group_key(args: Any, sample: Any, size: int, *, evaluation: bool, dataset: str = "") -> Any:
    """What the members of one prompt group share: the framework's `group_index`, or, where
    there is none (slime's eval samples), the prompt's block of n consecutive indices."""
    group_index = getattr(sample, "group_index", None)
    if group_index is None:
        index = getattr(sample, "index", None)
        group_index = ("index-block", index // size if isinstance(index, int) else None)
    return (id(args), evaluation, dataset, group_index)


# -- the one outcome, split over the members -------------------------------------------------


def split_outcome(outcome: EpisodeOutcome, count: int) -> list[EpisodeOutcome | RunAlone]:
    """Member i's outcome (branch i), or RUN_ALONE for a member that must run its own episode
    because the trunk ended before the fork with a graded result."""
    branched = {r.branch: r for r in outcome.results if r.HasField("branch")}
    unbranched = [r for r in outcome.results if not r.HasField("branch")]
    if unbranched:
        trunk = unbranched[0]
        first = _member_outcome(outcome, None, trunk)
        if trunk.status not in _UNGRADED:
            return [first, *([RUN_ALONE] * (count - 1))]
        if trunk.status == S.EPISODE_STATUS_INFRA_ERROR:
            return [_member_outcome(outcome, i, trunk) for i in range(count)]
        others = [
            _member_outcome(
                outcome,
                i,
                None,
                failure=(
                    convert.TRUNK_CANCELLED,
                    "the trunk ended before the fork: " + convert.status_name(trunk.status),
                ),
            )
            for i in range(1, count)
        ]
        return [first, *others]
    out: list[EpisodeOutcome | RunAlone] = []
    for i in range(count):
        result = branched.get(i)
        if result is not None:
            out.append(_member_outcome(outcome, i, result))
        else:
            reason = outcome.failure_reason or STREAM_ENDED_WITHOUT_RESULT
            message = outcome.failure_message or "no result for this branch"
            out.append(_member_outcome(outcome, i, None, failure=(reason, message)))
    return out


def _member_outcome(
    outcome: EpisodeOutcome,
    branch: int | None,
    result: agent_pb2.EpisodeResult | None,
    *,
    failure: tuple[str, str] | None = None,
) -> EpisodeOutcome:
    episode_id = outcome.episode_id if branch is None else f"{outcome.episode_id}.b{branch}"
    turns = [t for t in outcome.turns if not t.HasField("branch") or t.branch == branch]
    member = replace(outcome, episode_id=episode_id, result=result, turns=turns)
    member.results = [result] if result is not None else []
    if result is None and failure is not None:
        member.failure_reason, member.failure_message = failure
    return member


def annotate(
    samples: Sequence[Any],
    outcome: EpisodeOutcome,
    group_episode_id: str,
    at_turn: int,
    branch: int | None,
    *,
    seed_effective: bool,
) -> None:
    """Marks a member's samples with its branch (None: the trunk's one unbranched result, or no
    result at all), its seed (and whether the engine honoured it), the fork's turn and the
    group's episode."""
    result = outcome.result
    for sample in samples:
        sample.metadata[convert.BRANCH] = branch
        sample.metadata[convert.SAMPLING_SEED] = result.sampling_seed if result is not None else 0
        sample.metadata[convert.SAMPLING_SEED_EFFECTIVE] = seed_effective
        sample.metadata[convert.BRANCH_AT_TURN] = at_turn
        sample.metadata[convert.BRANCH_EPISODE_ID] = group_episode_id
        sample.metadata.setdefault(convert.BRANCH_TRUNK, False)


def mark_trunk_turns(member_samples: list[list[Any]], at_turn: int) -> None:
    """Dynamic history: marks each member's copies of the trunk's turns (turn_index < at_turn)
    with `metadata["branch_trunk"]`. Every member keeps its own copy, with its own rewards and
    on its own rollout_id (see the module docstring: one weight per member in the loss)."""
    for samples in member_samples:
        for sample in samples:
            turn = sample.metadata.get(convert.TURN_INDEX)
            sample.metadata[convert.BRANCH_TRUNK] = isinstance(turn, int) and turn < at_turn
