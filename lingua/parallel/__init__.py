"""What this project adds around lingua's distributed setup (`lingua/distributed.py`: `setup_torch_distributed`,
the `Topology`, the process groups): the launch plan before any group exists, the loop's collectives, timeouts,
FSDP, preemption, and what a rank says when a peer dies or stops answering.

    launch_plan.py   DistributedArgs, read_launch_env, TeacherLayout (one per teacher), LaunchPlan: roles, teacher
                     replicas (tp ranks on one node), bridges, the students' mesh for a world size, validated
                     before any process group (torch-free: stool imports it)
    launch_fixes.py  what a refused launch's sentence suggests (more ranks, a teacher's ranks, a mesh size), each
                     tried on the plan first, so every suggested launch passes
    collectives.py   the loop's collectives, each on the group it is given; agree_flags / agree_count
                     (ranks agree before they diverge); the per-collective debug log
    timeouts.py      the two-phase collective timeout on every group and backend; HangWatch (armed per step/wait)
    run_clock.py     RunClock: the students' step timer, hang watch and timeout switch, called twice per step
                     (`with clock.step(step)`, `clock.after_agreement(step)`)
    private_api.py   every private torch API the code calls, checked at startup (a torch that renamed one: one
                     sentence naming its version); the public replacement where a torch has one
    watch.py         RankWatch: each rank's watch thread (heartbeat, the hang watch's note, stacks into the
                     rank log, SIGUSR1), which runs while the main thread waits in a collective
    flight_recorder.py  torch's flight recorder read in-process and dumped to <dump_dir>/comm_traces/rank_<r>
                     for PyTorch's analyzer (gloo too); each group's last collective
    parallelize.py   building the student sharded (meta device, FSDP2, to_empty, init shard by shard); FSDP2,
                     torch.compile and activation checkpointing (one student: no sharding)
    sharded_init.py  a sharded weight's slice of the seeded draw its whole tensor would get (bit-identical init
                     whatever the number of students), one full tensor at a time
    side_stream.py   SideStream: asynchronous collectives posted off the compute stream (the bridge's), consumed
                     by ordering the compute stream after them
    host_copies.py   host -> device copies that never block the host: pins, to_device, pin_tree (a batch's
                     tensors, TeacherOutputs and lists pinned); the hot paths' only way to the GPU
    preemption.py    PreemptionFlag (signals only set a flag; the loop agrees on it), SLURM requeue
    recovery.py      in-job restarts: the rendezvous store per attempt (PyTorch #135712), the previous
                     generation's crash read and agreed at startup, recovery.jsonl, the crash loop's sentence
    rank_status.py   RankStatus: each rank's status file; a lost peer or a collective timeout becomes one
                     sentence naming the group, the rank(s) and the step (the rules apps/debug/postmortem.py
                     applies after the fact)

Flow: `read_launch_env` -> `LaunchPlan.for_launch` (config errors, no torch) -> `setup_torch_distributed`
builds the groups from the plan -> `Topology` -> every component takes its group from it.
"""
