"""distributed.reduce_every_micro_batch=false (issue 27 item 6): FSDP2 keeps the unsharded gradient between
micro-batches in its reduce_dtype (fp32), not in the bf16 parameters' dtype: the budget launch_plan.py states."""

import pytest
import torch

from apps.main.transformer import LMTransformer
from lingua.parallel.launch_plan import DistributedArgs
from lingua.parallel.parallelize import parallelize_model
from tests.unit.apps.main.test_export_hf import tiny_args

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_deferred_reduce_accumulates_the_unsharded_gradient_in_fp32(train_group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    model = LMTransformer(tiny_args())
    model.init_weights()
    parallelize_model(model, DeviceMesh.from_group(train_group, "cpu"), DistributedArgs(model_dtype="bf16"))
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    model.set_requires_gradient_sync(False)
    for _ in range(2):  # the second micro-batch adds into what the first left
        model(tokens).float().sum().backward()
    params = [p for module in model.modules() if isinstance(module, FSDPModule)
              for group in [module._get_fsdp_state()._fsdp_param_group] if group is not None
              for p in group.fsdp_params]
    assert params and all(p.unsharded_param.dtype == torch.bfloat16 for p in params)
    held = [p.unsharded_accumulated_grad for p in params]
    assert all(g is not None and g.dtype == torch.float32 for g in held)  # 4 bytes per parameter, not 2
    n_params = sum(p.unsharded_param.numel() for p in params)
    assert sum(g.numel() * g.element_size() for g in held) == 4 * n_params


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sharded", [False, True], ids=["one_process", "one_student"])
def test_built_sharded_the_weights_are_the_whole_builds_bit_for_bit(train_group, sharded):
    """One process (no mesh) and one student (plain in fp32, one FSDP unit in bf16): `build_sharded` gives the
    whole model's init, RoPE tables and tie included (2 and 3 students: tests/dist/test_sharded_init.py)."""
    from torch.distributed.device_mesh import DeviceMesh

    from tests.dist.workers.sharded_init import CONFIGS, compare

    mesh = DeviceMesh.from_group(train_group, "cpu") if sharded else None
    for config in CONFIGS:
        result = compare(config, mesh)
        assert result["compared"] == 23 and result["differ"] == [], (config, result)
        assert result["tied"] == config.startswith("tied")
        assert result["local_elements"] == result["elements"]
