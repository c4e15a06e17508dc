"""Every private torch API this project calls, in one table, checked once at startup (`check_private_apis`, before
the first process group): a torch that renamed or removed one stops the launch with one sentence naming that torch's
version and what to change, never an AttributeError mid-run. The public API is used wherever the torch in use has one
(`torch.distributed.set_timeout`, torch 2.14+); the private one only where it has not.

    check_private_apis()          # LaunchError for a missing required API; one warning line for a diagnostic one
    private_api("abort")          # the callable this torch has (None where it is missing and not required)

Tested on torch 2.11 to 2.15 by `bash setup/torch_range.sh` (docs/tests.md#the-torch-range), which also runs the
tests of each use listed here.
"""

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lingua.errors import LaunchError

logger = logging.getLogger(__name__)
SUPPORTED_TORCH = "2.11 to 2.15"


def _c10d(name: str) -> Callable[[], object]:
    return lambda: getattr(dist.distributed_c10d, name, None)


def _c_ext(name: str) -> Callable[[], object]:
    return lambda: getattr(getattr(torch._C, "_distributed_c10d", None), name, None)


def _gloo_method(name: str) -> Callable[[], object]:
    return lambda: getattr(getattr(dist, "ProcessGroupGloo", None), name, None)


def _process_group_attr(name: str) -> Callable[[], object]:
    return lambda: getattr(dist.ProcessGroup, name, None)


@dataclass(frozen=True)
class PrivateApi:
    key: str  # how the code asks for it: private_api(key)
    where: str  # its torch name, as the sentence says it
    find: Callable[[], object]  # the attribute on this torch, or None
    used_for: str
    required: bool = True  # False: a diagnostic; missing, the feature is off and one warning line says so
    public: Optional[Callable[[], object]] = None  # the public API that replaces it, where a torch has one


PRIVATE_APIS = (
    PrivateApi("abort", "torch.distributed.distributed_c10d._abort_process_group", _c10d("_abort_process_group"),
               "aborting a failed rank's process groups so that no posted collective holds its exit (clean_up)"),
    PrivateApi("get_backend", "ProcessGroup._get_backend", _process_group_attr("_get_backend"),
               "reaching each backend of a group for the two-phase collective timeout"),
    PrivateApi("device_types", "ProcessGroup._device_types", _process_group_attr("_device_types"),
               "listing the backends of a group for the two-phase collective timeout"),
    PrivateApi("set_backend_timeout", "ProcessGroupGloo._set_default_timeout", _gloo_method("_set_default_timeout"),
               "switching a backend that DETAIL wraps to the training timeout (torch.distributed.set_timeout, "
               "torch 2.14+, does every other one)", public=_c10d("set_timeout")),
    PrivateApi("detail_wrapper", "torch.distributed.distributed_c10d._create_process_group_wrapper",
               _c10d("_create_process_group_wrapper"),
               "the training timeout on DETAIL's check groups (distributed.debug=detail)", required=False),
    PrivateApi("dump_trace", "torch._C._distributed_c10d._dump_fr_trace", _c_ext("_dump_fr_trace"),
               "the flight recorder's dumps (distributed.debug=trace) and the hang notes' last collectives",
               required=False),
)
_BY_KEY = {api.key: api for api in PRIVATE_APIS}


def private_api(key: str):
    """This torch's attribute for `key` (a PRIVATE_APIS key), or None where it lacks it."""
    return _BY_KEY[key].find()


def public_api(key: str):
    """The public replacement of `key`'s private API on this torch, or None where it has none."""
    public = _BY_KEY[key].public
    return public() if public is not None else None


def missing_private_apis(apis=PRIVATE_APIS) -> list[PrivateApi]:
    """The private APIs this torch lacks (one with a public replacement on this torch is not missing)."""
    return [api for api in apis if api.find() is None and (api.public is None or api.public() is None)]


def check_private_apis(apis=PRIVATE_APIS) -> None:
    """At startup, before any process group: a required private API this torch lacks is one sentence naming the
    torch version; a diagnostic one is one warning line and its feature is off."""
    missing = missing_private_apis(apis)
    required = [api for api in missing if api.required]
    if required:
        names = "; ".join(f"{api.where} (for {api.used_for})" for api in required)
        raise LaunchError(f"torch {torch.__version__} has no {names}: this code runs on torch {SUPPORTED_TORCH}; "
                          f"install one of those (bash setup/create_env.sh installs the pinned one), or run "
                          f"bash setup/torch_range.sh {torch.__version__.split('+')[0]} to see what else fails.")
    for api in missing:
        logger.warning(f"torch {torch.__version__} has no {api.where}: {api.used_for} is off on this torch "
                       f"(tested on torch {SUPPORTED_TORCH}).")
