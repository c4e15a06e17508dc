"""The private torch APIs the code calls (`lingua/parallel/private_api.py`): all there on this torch; a missing one
is one sentence at startup naming the torch version (before any process group), a missing diagnostic one a warning;
the public `torch.distributed.set_timeout` is used where a torch has it (simulated here on torch < 2.15)."""

import logging

import pytest
import torch
import torch.distributed as dist

from lingua.errors import LaunchError
from lingua.parallel import private_api as pa
from lingua.parallel.launch_plan import DistributedArgs


def test_this_torch_has_every_private_api_the_code_calls():
    assert pa.missing_private_apis() == []
    assert callable(pa.private_api("abort")) and callable(pa.private_api("get_backend"))
    pa.check_private_apis()


def test_a_renamed_abort_stops_the_launch_at_startup_naming_the_torch(monkeypatch):
    monkeypatch.delattr(dist.distributed_c10d, "_abort_process_group")
    with pytest.raises(LaunchError) as raised:
        pa.check_private_apis()
    sentence = str(raised.value)
    assert sentence.startswith(f"torch {torch.__version__} has no "
                               "torch.distributed.distributed_c10d._abort_process_group (for aborting"), sentence
    assert "runs on torch 2.11 to 2.15" in sentence and "setup/torch_range.sh" in sentence
    assert "\n" not in sentence


@pytest.mark.skipif(dist.is_initialized(), reason="a process group exists in this process")
def test_setup_refuses_before_any_process_group(monkeypatch):
    from lingua.distributed import setup_torch_distributed

    monkeypatch.delattr(dist.distributed_c10d, "_abort_process_group")
    with pytest.raises(LaunchError, match=r"torch .* has no .*_abort_process_group"):
        setup_torch_distributed(DistributedArgs())
    assert not dist.is_initialized()  # the sentence comes before the rendezvous: no rank waits in it


def test_a_missing_diagnostic_is_a_warning_and_the_launch_goes_on(monkeypatch, caplog):
    monkeypatch.delattr(dist.distributed_c10d, "_create_process_group_wrapper")
    with caplog.at_level(logging.WARNING, logger="lingua.parallel.private_api"):
        pa.check_private_apis()
    assert [r.getMessage() for r in caplog.records] == [
        f"torch {torch.__version__} has no torch.distributed.distributed_c10d._create_process_group_wrapper: the "
        "training timeout on DETAIL's check groups (distributed.debug=detail) is off on this torch (tested on torch "
        "2.11 to 2.15)."]


def test_a_public_replacement_makes_the_private_api_unneeded():
    gone = pa.PrivateApi("x", "torch.private_x", lambda: None, "x", public=lambda: print)
    also_gone = pa.PrivateApi("y", "torch.private_y", lambda: None, "y", public=lambda: None)
    assert pa.missing_private_apis((gone, also_gone)) == [also_gone]
    with pytest.raises(LaunchError, match=r"has no torch.private_y \(for y\)"):
        pa.check_private_apis((gone, also_gone))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("debug", ["false", "detail"], ids=["plain", "DETAIL"])
def test_the_timeout_switch_takes_the_public_api_where_torch_has_one(tmp_path, debug):
    """torch.distributed.set_timeout (torch 2.14+; a stand-in calling ProcessGroup.set_timeout on an older torch)
    switches a plain group; under DETAIL the private per-backend path still reaches the wrapper and its checks."""
    from tests.unit.lingua.parallel.test_debug_switch import printed_json

    code = ("import json, torch\n"
            "import torch.distributed as dist\n"
            "from lingua import distributed as ld\nfrom lingua.parallel import timeouts\n"
            "calls = []\n"
            "def set_timeout(timeout, group=None):\n"
            "    calls.append(timeout.total_seconds())\n"
            "    group.set_timeout(timeout)\n"
            "dist.distributed_c10d.set_timeout = set_timeout\n"
            f"topo = ld.setup_torch_distributed(ld.DistributedArgs(debug={debug!r}, init_timeout_s=100), "
            f"dump_dir={str(tmp_path)!r})\n"
            "reported = timeouts.set_group_timeout(topo.train_group, 7)\n"
            "ld.clean_up()\n"
            "print(json.dumps(dict(calls=calls, reported=reported)))\n")
    out = printed_json(code)
    if debug == "detail":
        assert out == {"calls": [], "reported": {"gloo": 7.0, "DETAIL checks": 7.0}}, out
    else:
        assert out == {"calls": [7.0], "reported": {"gloo": 7.0}}, out
