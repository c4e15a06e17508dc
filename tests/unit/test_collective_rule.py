"""The collective rule: every torch.distributed collective in lingua/ and apps/ names its group.

Parsed with `ast`, not grep: aliases (`import torch.distributed as dist`, `from torch.distributed
import barrier`), `torch.distributed.checkpoint` save/load (which need `process_group=`), and a literal
`group=None` (the default group in disguise) are all caught.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

COLLECTIVES = {
    "barrier", "monitored_barrier", "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_object", "all_gather_coalesced", "broadcast", "broadcast_object_list", "gather", "gather_object",
    "scatter", "scatter_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "batch_isend_irecv", "send_object_list", "recv_object_list",
}
CHECKPOINT_CALLS = {"save", "load", "async_save", "save_state_dict", "load_state_dict"}
DIST_MODULES = {"torch.distributed", "torch.distributed.distributed_c10d"}
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


def test_every_collective_names_its_group():
    files = sorted(p for d in ("lingua", "apps") for p in (ROOT / d).rglob("*.py"))
    assert files, "no source files found"
    violations = [v for f in files for v in find_violations(f.read_text(), str(f.relative_to(ROOT)))]
    assert not violations, "collectives on the implicit default group:\n" + "\n".join(violations)


@pytest.mark.parametrize("snippet", [
    "import torch.distributed as dist\ndist.barrier()",
    "import torch.distributed as dist\ndist.all_reduce(t, group=None)",
    "import torch\ntorch.distributed.all_gather(out, t)",
    "from torch.distributed import barrier\nbarrier()",
    "from torch.distributed import barrier as b\nb()",
    "import torch.distributed.checkpoint as dcp\ndcp.save(state, checkpoint_id=p)",
    "from torch.distributed import checkpoint\ncheckpoint.load(state, checkpoint_id=p, process_group=None)",
    "import torch.distributed as dist\ndist.distributed_c10d.broadcast(t, src=0)",
])
def test_rule_catches_default_group_calls(snippet):
    assert len(find_violations(snippet)) == 1


@pytest.mark.parametrize("snippet", [
    "import torch.distributed as dist\ndist.barrier(group=g)",
    "import torch.distributed as dist\ndist.all_reduce(t, op=dist.ReduceOp.SUM, group=train_group)",
    "import torch.distributed.checkpoint as dcp\ndcp.save(state, checkpoint_id=p, process_group=g)",
    "import torch.distributed as dist\ndist.get_rank(group=g)\ndist.new_group([0, 1])",
])
def test_rule_accepts_named_groups(snippet):
    assert find_violations(snippet) == []
