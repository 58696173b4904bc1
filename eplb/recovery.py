"""What a service syncing with a decode group does about switches an earlier service left (pure).

A service killed in the middle of a switch leaves its agents holding it: staged everywhere
(killed during Prepare), or committed on some agents and only staged on others (killed during
Commit). Left alone, the committed agents switch at the agreed step and the others never do:
ranks of one group on different placements, which no later switch can fix because every later
Prepare is refused while a committed switch waits. And a service that stayed down past that step
finds the group already split. At sync, before anything else:

- a switch that no agent holding it has committed is aborted everywhere (nothing can switch);
- a switch committed on some of its holders is committed on the others at the same step (an
  abort might reach a committed agent after its step; a late commit only switches a laggard a
  few steps late), and the sync waits until it has taken effect;
- a switch committed on every holder is one a service decided whole: the sync waits for it;
- agents on different placements with nothing pending (a split already made) are brought to the
  placement of the highest version: each agent behind it is switched to it, one version at a
  time, by a switch of its own that the other agents do not take part in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["AgentState", "Pending", "Recovery", "plan_recovery"]


@dataclass(frozen=True, slots=True)
class Pending:
    """A switch an agent holds and has not applied."""

    model: str
    switch_id: str
    committed: bool
    apply_at_step: int


@dataclass(frozen=True, slots=True)
class AgentState:
    """What GetPlacement says of one agent: each model's placement in force (its encoded
    ``phy2log`` and version) and the switches it holds."""

    address: str
    placements: Mapping[str, tuple[bytes, int]]
    pending: Sequence[Pending] = ()


@dataclass(frozen=True, slots=True)
class Recovery:
    """What to do before the group's windows open; nothing at all when ``clean``."""

    abort: tuple[str, ...] = ()  # switch ids, on every agent
    # (agent address, switch id, step): finish a switch committed elsewhere
    commit: tuple[tuple[str, str, int], ...] = ()
    # (switch id, step): committed switches that must take effect before the sync goes on
    wait_for: tuple[tuple[str, int], ...] = ()
    # model -> the agents behind on it and the agent whose placement they take
    behind: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not (self.abort or self.commit or self.wait_for or self.behind)


def plan_recovery(agents: Sequence[AgentState]) -> Recovery:
    """The recovery of a group from what its agents report (see the module doc)."""
    holders: dict[str, list[tuple[AgentState, Pending]]] = {}
    for agent in agents:
        for pending in agent.pending:
            holders.setdefault(pending.switch_id, []).append((agent, pending))
    abort, commit, wait_for = [], [], []
    for switch_id, held in sorted(holders.items()):
        committed = [pending for _, pending in held if pending.committed]
        if not committed:
            abort.append(switch_id)
            continue
        step = max(pending.apply_at_step for pending in committed)
        commit += [
            (agent.address, switch_id, step) for agent, pending in held if not pending.committed
        ]
        wait_for.append((switch_id, step))
    if abort or commit or wait_for:
        # placements are compared once nothing is pending: a switch may yet change them
        return Recovery(tuple(abort), tuple(commit), tuple(wait_for))
    behind: dict[str, tuple[tuple[str, ...], str]] = {}
    models = sorted({model for agent in agents for model in agent.placements})
    for model in models:
        held_by = [agent for agent in agents if model in agent.placements]
        leader = max(held_by, key=lambda agent: agent.placements[model][1])
        lagging = tuple(
            agent.address
            for agent in held_by
            if agent.placements[model] != leader.placements[model]
        )
        if lagging:
            behind[model] = (lagging, leader.address)
    return Recovery(behind=behind)
