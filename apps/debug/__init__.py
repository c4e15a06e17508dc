"""Diagnostics: what to run when a launch is slow to start, a GPU is new, or a run failed or hung.

    startup.py         five-phase startup diagnostic
    gpu_check.py       the GPU self-check (setup/gpu_check.sh): every `cuda` test, a pass/fail table
    gpu_bench.py       the self-check's --bench: the loss step against Liger-Kernel, then feeding and whole steps
    postmortem.py      after a failure or hang: who failed first, each rank's step and stuck collective
    trace_summary.py   a profiling trace: GPU busy share, top kernels, host waits, idle gaps
"""
