"""The in-process data-wall study on one GPU (`--wall --device cuda --tiny`): the runs under bf16 autocast with the
fused loss, the cache written by this process and held with the held-out batches on the GPU. Marked `cuda`;
`bash setup/gpu_check.sh` runs it, before `python -m apps.studies.kd --wall --device cuda`."""

import pytest

from tests.gpu.gpus import needs_gpus
from tests.unit.apps.studies.kd.test_wall_inprocess import check_tiny_study


@pytest.mark.timeout(300)
@needs_gpus(1)
def test_the_tiny_wall_study_trains_every_run_on_one_gpu(corpus, tiny_teacher, tmp_path):
    check_tiny_study(corpus, tiny_teacher, tmp_path, "cuda")
