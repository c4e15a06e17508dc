"""What this project adds around lingua's distributed setup (`lingua/distributed.py`: `setup_torch_distributed`,
the `Topology`, the process groups): the launch plan before any group exists, the loop's collectives, timeouts,
FSDP, preemption and the peer-death sentence.

    launch_plan.py   DistributedArgs, read_launch_env, LaunchPlan: roles, teacher replicas (teacher_tp ranks on
                     one node), bridges, the students' mesh for a world size, validated before any process group
                     (torch-free: stool imports it)
    collectives.py   the loop's collectives, each on the group it is given; agree_flags / agree_count
                     (ranks agree before they diverge); the per-collective debug log
    timeouts.py      the two-phase collective timeout on every group and backend; HangWatch (stack dumps)
    parallelize.py   FSDP2, torch.compile and activation checkpointing of the student
    preemption.py    PreemptionFlag (signals only set a flag; the loop agrees on it), SLURM requeue
    rank_status.py   RankStatus: each rank's status file; a lost peer becomes one sentence naming the rank
                     that stopped first

Flow: `read_launch_env` -> `LaunchPlan.for_launch` (config errors, no torch) -> `setup_torch_distributed`
builds the groups from the plan -> `Topology` -> every component takes its group from it.
"""
