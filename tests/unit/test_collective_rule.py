"""The collective rule: every torch.distributed collective in lingua/ and apps/ names its group.

Parsed with `ast`, not grep: aliases (`import torch.distributed as dist`, `from torch.distributed
import barrier`), `torch.distributed.checkpoint` save/load (which need `process_group=`), and a literal
`group=None` (the default group in disguise) are all caught.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Every function of torch.distributed (2.11 to 2.15) that communicates and takes `group=`, point-to-point included.
# batch_isend_irecv takes no group: each P2POp it runs names one, so P2POp is checked instead.
COLLECTIVES = {
    "barrier", "monitored_barrier", "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_gather_object", "all_gather_coalesced", "_all_gather_base", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "P2POp", "send_object_list", "recv_object_list",
    "gather_into_tensor", "gather_single",  # torch 2.14: gather into one output tensor
}
# Functions of torch.distributed that take a group but only read it, change its settings or create/destroy groups.
NOT_COLLECTIVES = {"get_backend", "get_backend_config", "get_global_rank", "get_group_rank", "get_process_group_ranks",
                   "get_rank", "get_world_size", "destroy_process_group", "new_subgroups", "shrink_group",
                   "get_backend_impl",  # torch 2.14: a group's backend object
                   "set_timeout"}  # torch 2.14: a group's timeout (lingua/parallel/timeouts.py uses it there)
# Names above that the oldest torch of the range lacks: the torch that brought each.
NEWER_THAN_OLDEST = {"all_gather_single": "2.13", "reduce_scatter_single": "2.13", "gather_into_tensor": "2.14",
                     "gather_single": "2.14"}
CHECKPOINT_CALLS = {"save", "load", "async_save", "save_state_dict", "load_state_dict"}
# torch.distributed.nn(.functional) holds autograd versions of the collectives, on the default group too.
DIST_MODULES = {"torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.nn",
                "torch.distributed.nn.functional"}
DCP_MODULES = {"torch.distributed.checkpoint"}


def _qualified_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> qualified module/function name, from this file's imports."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def find_violations(source: str, filename: str = "<string>") -> list[str]:
    """'file:line: call' for each collective that does not name its group."""
    tree = ast.parse(source, filename=filename)
    imported = _qualified_names(tree)
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts = _dotted(node.func)
        if not parts:
            continue
        head = imported.get(parts[0], parts[0])
        qualified = ".".join([head] + parts[1:])
        module, _, func = qualified.rpartition(".")
        named = {k.arg for k in node.keywords
                 if k.arg and not (isinstance(k.value, ast.Constant) and k.value.value is None)}
        if module in DIST_MODULES and func in COLLECTIVES and "group" not in named:
            bad.append(f"{filename}:{node.lineno}: {qualified}(...) does not name its group (group=...)")
        elif module in DCP_MODULES and func in CHECKPOINT_CALLS and "process_group" not in named:
            bad.append(f"{filename}:{node.lineno}: {qualified}(...) does not name its group (process_group=...)")
    return bad


def scan_sources(finder) -> list[str]:
    """`finder(source, filename)` over every .py file of lingua/ and apps/."""
    files = sorted(p for d in ("lingua", "apps") for p in (ROOT / d).rglob("*.py"))
    assert files, "no source files found"
    return [v for f in files for v in finder(f.read_text(), str(f.relative_to(ROOT)))]


def test_every_collective_names_its_group():
    violations = scan_sources(find_violations)
    assert not violations, "collectives on the implicit default group:\n" + "\n".join(violations)


def test_collectives_list_covers_torch_distributed():
    """A collective added to torch.distributed (or a typo here) fails this until it is classified above."""
    import inspect

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def takes_group(func) -> bool:
        try:
            return "group" in inspect.signature(func).parameters
        except (TypeError, ValueError):
            return False

    public = {n for n in distributed_c10d.__all__ if callable(getattr(distributed_c10d, n, None))}
    unclassified = {n for n in public if takes_group(getattr(distributed_c10d, n))} - COLLECTIVES - NOT_COLLECTIVES
    assert not unclassified, f"add to COLLECTIVES (or NOT_COLLECTIVES): {sorted(unclassified)}"
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    lacking = [n for n in COLLECTIVES if not hasattr(dist, n)
               and version >= tuple(int(part) for part in NEWER_THAN_OLDEST.get(n, "0.0").split("."))]
    assert not lacking, f"COLLECTIVES names something torch {torch.__version__} lacks: {lacking}"


@pytest.mark.parametrize("snippet", [
    "import torch.distributed as dist\ndist.barrier()",
    "import torch.distributed as dist\ndist.all_reduce(t, group=None)",
    "import torch\ntorch.distributed.all_gather(out, t)",
    "from torch.distributed import barrier\nbarrier()",
    "from torch.distributed import barrier as b\nb()",
    "import torch.distributed.checkpoint as dcp\ndcp.save(state, checkpoint_id=p)",
    "from torch.distributed import checkpoint\ncheckpoint.load(state, checkpoint_id=p, process_group=None)",
    "import torch.distributed as dist\ndist.distributed_c10d.broadcast(t, src=0)",
    "import torch.distributed as dist\ndist.send(t, dst=1)",
    "import torch.distributed as dist\ndist.recv(t, src=0)",
    "import torch.distributed as dist\nwork = dist.isend(t, dst=1, group=None)",
    "from torch.distributed import irecv\nwork = irecv(t, src=0)",
    "import torch.distributed as dist\ndist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1, group=g),"
    " dist.P2POp(dist.irecv, r, 1)])",
    "import torch.distributed as dist\ndist.send_object_list([obj], dst=1)",
    "import torch.distributed as dist\ndist.all_to_all_single(out, t)",
    "import torch.distributed as dist\ndist.reduce_scatter_tensor(out, t)",
    "import torch.distributed as dist\ndist.monitored_barrier(timeout=td)",
    "import torch.distributed.nn.functional as F\ny = F.all_reduce(x)",
])
def test_rule_catches_default_group_calls(snippet):
    assert len(find_violations(snippet)) == 1


@pytest.mark.parametrize("snippet", [
    "import torch.distributed as dist\ndist.barrier(group=g)",
    "import torch.distributed as dist\ndist.all_reduce(t, op=dist.ReduceOp.SUM, group=train_group)",
    "import torch.distributed.checkpoint as dcp\ndcp.save(state, checkpoint_id=p, process_group=g)",
    "import torch.distributed as dist\ndist.get_rank(group=g)\ndist.new_group([0, 1])",
    "import torch.distributed as dist\ndist.send(t, dst=1, group=bridge_group)\ndist.recv(t, src=0, group=g)",
    "import torch.distributed as dist\nreqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1, group=g),"
    " dist.P2POp(dist.irecv, r, 1, group=g)])",
])
def test_rule_accepts_named_groups(snippet):
    assert find_violations(snippet) == []


# ---- the launcher's rank facts are read from the environment, never written into it ----

RANK_FACTS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
              "MASTER_PORT"}
ENVIRON_WRITES = {"setdefault", "pop", "update", "__setitem__", "__delitem__"}


def _literal_keys(node: ast.AST) -> set[str]:
    """String keys of a dict literal, or of a list/tuple literal of (key, value) pairs."""
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return {e.elts[0].value for e in node.elts if isinstance(e, (ast.List, ast.Tuple)) and e.elts
                and isinstance(e.elts[0], ast.Constant) and isinstance(e.elts[0].value, str)}
    return set()


def find_rank_fact_writes(source: str, filename: str = "<string>") -> list[str]:
    """'file:line: what' for each write of a rank fact (a literal key) to os.environ / os.putenv / os.unsetenv.

    Follows import aliases (`from os import environ`, `import os as o`) and plain aliases of the
    mapping (`env = os.environ`); keys computed at run time are out of its reach.
    """
    tree = ast.parse(source, filename=filename)
    imported = _qualified_names(tree)

    def qualified(node):
        parts = _dotted(node)
        return ".".join([imported.get(parts[0], parts[0])] + parts[1:]) if parts else None

    aliases = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and qualified(node.value) == "os.environ"
               for t in node.targets if isinstance(t, ast.Name)}

    def is_environ(node):
        return qualified(node) == "os.environ" or (isinstance(node, ast.Name) and node.id in aliases)

    def key_of(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    bad = []

    def flag(node, keys, how):
        for key in sorted(set(keys) & RANK_FACTS):
            bad.append(f"{filename}:{node.lineno}: {how} writes {key} into the environment")

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript) and is_environ(t.value):
                    flag(node, {key_of(t.slice)}, "del os.environ[...]" if isinstance(node, ast.Delete)
                         else "os.environ[...] =")
            if isinstance(node, ast.AugAssign) and is_environ(node.target):  # os.environ |= {...}
                flag(node, _literal_keys(node.value), "os.environ |=")
        elif isinstance(node, ast.Call):
            func = node.func
            if qualified(func) in ("os.putenv", "os.unsetenv") and node.args:
                flag(node, {key_of(node.args[0])}, qualified(func))
            elif isinstance(func, ast.Attribute) and func.attr in ENVIRON_WRITES and is_environ(func.value):
                keys = {k.arg for k in node.keywords if k.arg}
                if node.args:
                    keys |= {key_of(node.args[0])} if func.attr != "update" else _literal_keys(node.args[0])
                flag(node, keys, f"os.environ.{func.attr}(...)")
    return bad


def test_no_code_writes_rank_facts_into_the_environment():
    writes = scan_sources(find_rank_fact_writes)
    assert not writes, "rank facts belong to the launcher; code only reads them:\n" + "\n".join(writes)


def test_rank_fact_detector_flags_writes_and_only_writes():
    writes = """\
import os
from os import environ as E, putenv
os.environ["RANK"] = "0"
del os.environ["WORLD_SIZE"]
os.environ.update({"LOCAL_RANK": "0", "OTHER": "1"})
os.environ.update(MASTER_ADDR="localhost")
os.environ.setdefault("MASTER_PORT", "29500")
os.environ.pop("NODE_RANK")
os.putenv("GROUP_RANK", "0")
E["LOCAL_WORLD_SIZE"] = "1"
putenv("RANK", "0")
env = os.environ
env["RANK"] = "0"
"""
    found = find_rank_fact_writes(writes)
    assert sorted(int(f.split(":")[1]) for f in found) == list(range(3, 12)) + [13], found
    benign = """\
import os
rank = int(os.environ.get("RANK", 0))
world = os.environ["WORLD_SIZE"]
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
os.environ.update({"OMP_NUM_THREADS": "1"}, PYTHONUNBUFFERED="1")
env = dict(os.environ, RANK="0")  # a copy for a child process, not a write
"""
    assert find_rank_fact_writes(benign) == []
