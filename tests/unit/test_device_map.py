"""Rank -> GPU binding checks (seed 004): which GPU a local rank expects, and what a gathered map
that binds wrongly says. The gathering itself runs in every torchrun test (on CPU: no GPU rows)."""

import pytest

from lingua.distributed import device_map_problems, expected_cuda_index


def test_expected_gpu_per_local_rank():
    assert [expected_cuda_index(r, 8, 8) for r in range(8)] == list(range(8))  # torchrun: the node's GPUs
    assert [expected_cuda_index(r, 4, 1) for r in range(4)] == [0, 0, 0, 0]  # srun --gpus-per-task=1
    with pytest.raises(ValueError, match="Local rank 5 has no GPU: only 4 visible to it for 8 local ranks"):
        expected_cuda_index(5, 8, 4)


def row(rank, local_rank, host="node1", uuid="", problem=""):
    return dict(rank=rank, local_rank=local_rank, host=host, gpu_uuid=uuid, problem=problem)


def test_a_gpu_shared_by_two_ranks_of_one_host_is_named():
    rows = [row(0, 0, uuid="GPU-a"), row(1, 1, uuid="GPU-a"), row(2, 0, host="node2", uuid="GPU-a"),
            row(3, 1, host="node2", uuid="GPU-b")]
    assert device_map_problems(rows) == ["ranks [0, 1] on node1 share one GPU (GPU-a)"]


def test_per_rank_problems_come_first_and_cpu_rows_are_fine():
    rows = [row(0, 0, uuid="GPU-a"), row(1, 1, uuid="GPU-b", problem="bound to cuda:0, expected cuda:1"),
            row(2, 0, host="cpu-box"), row(3, 1, host="cpu-box")]
    assert device_map_problems(rows) == ["rank 1 (local rank 1 on node1) bound to cuda:0, expected cuda:1"]
    assert device_map_problems([row(0, 0), row(1, 1)]) == []
