"""The planner's printed commands do what it planned: its cache writer command, run at CPU size (a tiny teacher,
2 "GPUs"), writes exactly the planned tokens."""

import json
import shlex

import pytest

from apps.plan.args import PlanArgs
from apps.plan.planner import Planner
from apps.plan.printing import format_plan
from lingua.args import parse_args
from lingua.distillation.cache.store import CacheManifest
from tests.runs import assert_ok, distill_overrides, torchrun

pytestmark = pytest.mark.slow  # it launches the cache writer


def test_the_printed_cache_command_writes_the_planned_tokens(corpus, tiny_teacher, tmp_path):
    training = distill_overrides(corpus, tiny_teacher, tmp_path / "dump", steps=3, grad_acc_steps=2)
    args = parse_args(PlanArgs, [*training, "world_size=2", "gpus_per_node=2", "out=null"])
    args.validate_plan()
    plan = Planner(args, None, training).plan()
    writer, planned = plan["cache"]["writer"], plan["cache"]["tokens_per_run"]
    # 1 student online (1 teacher rank) x 3 steps x 2 micro-batches x 2 rows x 32 tokens; 2 streams when training
    # from the cache on both GPUs, 6 windows each.
    assert planned == 3 * 2 * 2 * 32 and plan["online"]["students"] == 1
    assert (writer["streams"], writer["sequences_per_stream"], writer["tokens"]) == (2, 6, planned)
    command = next(line.strip() for line in format_plan(plan) if "-m apps.main.teacher_cache" in line)
    assert command.startswith("torchrun --nproc-per-node 2 -m apps.main.teacher_cache 'config=<config>' ")
    cache_dir = tmp_path / "cache"
    printed = [word.replace("cache_dir=<cache dir>", f"cache_dir={cache_dir}") for word in shlex.split(command)[6:]]
    assert printed[:len(training)] == training  # the training keys the plan was made with, as given
    result = torchrun(2, printed, timeout=120, module="apps.main.teacher_cache")
    assert_ok(result)
    manifest = CacheManifest.read(cache_dir)
    written = manifest.n_shards * manifest.shard_sequences * manifest.data["seq_len"]
    assert written == planned == json.loads((cache_dir / "index.json").read_text())["tokens"]
    assert manifest.streams * manifest.sequences_per_stream == 2 * 6
