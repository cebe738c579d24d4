"""The process launch: one spawned process per stage; the stages find each
other's addresses in a TCPStore this process hosts (tensorwire.ranks.rendezvous,
stage.meet); their statistics collected, and the first failure of any stage
fails the run (tensorwire.ranks.roles names it and stops the others)."""

from __future__ import annotations

from ...ranks.rendezvous import TorchStore
from ...ranks.roles import RoleError, Roles
from .graph import PartitionError
from .stage import StageStats, stage_main

# Once a stage failed, how long the others may take to report their own
# failures before they are stopped: a stage that fails makes its peers fail
# next, and the first failure is named from what came in meanwhile.
LINGER_S = 1.0


def launch_stages(stages: int, cfg: dict, die: tuple[int, int] | None) -> list[StageStats]:
    """Spawns the stage processes (they meet in this process's store) and
    returns their statistics; the first failure of any stage fails the run."""
    timeout = cfg["timeout"]
    store = TorchStore.host("127.0.0.1", 0, timeout)
    with Roles() as roles:
        for s in range(stages):
            roles.spawn(
                f"stage {s}",
                stage_main,
                s,
                dict(cfg, store=store.address, die_at=die[1] if die and die[0] == s else None),
            )
        try:
            roles.supervise(timeout * cfg["steps"] + 60, linger=LINGER_S)
        except RoleError as e:
            raise PartitionError("the pipeline did not finish in time" if e.timed_out else str(e)) from None
        roles.broadcast(("exit",))
        roles.stop(wait=10)
    return [r.result for r in roles]
