"""The student built sharded gives the weights of the whole-model build it replaced, bit for bit, on 1, 2 and 3
students (tests/dist/workers/sharded_init.py), and each student holds only its shard."""

import json

import pytest

from tests.dist.workers.sharded_init import CONFIGS
from tests.runs import torchrun

pytestmark = pytest.mark.slow  # launches processes

WORKER = "tests.dist.workers.sharded_init"


@pytest.mark.timeout(240)
def test_sharded_build_equals_the_whole_build_bit_for_bit_on_1_2_and_3_students(tmp_path):
    result = torchrun(3, [str(tmp_path)], timeout=200, module=WORKER)
    assert result.returncode == 0, result.stdout[-6000:]
    for students in (1, 2, 3):
        rows = [json.loads((tmp_path / f"S{students}.rank{r}.json").read_text()) for r in range(students)]
        for config in CONFIGS:
            per_rank = [row[config] for row in rows]
            for row in per_rank:
                # 21 state-dict tensors (a tied head keeps its key) and the two RoPE tables
                assert row["compared"] == 23 and row["differ"] == [], (students, config, row)
                assert row["tied"] == config.startswith("tied")
            elements = per_rank[0]["elements"]
            if students == 1:  # one student: plain in fp32, one FSDP unit in bf16; all of it on the rank either way
                assert per_rank[0]["local_elements"] == elements
            else:  # the shards add up to the model: no rank holds more than its part
                assert sum(row["local_elements"] for row in per_rank) == elements, (students, config)
                # each tensor's rows split as torch.chunk does: the first shards a row longer
                assert max(row["local_elements"] for row in per_rank) <= 1.05 * elements / students
