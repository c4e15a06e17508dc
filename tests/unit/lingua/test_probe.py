"""ActivationProbe on a tiny transformer-shaped module: act and grad lines for the expected modules."""

import json
import math

import pytest
import torch
from torch import nn

from lingua.probe import ActivationProbe


class TinyBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=16, dim=8, n_layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TinyBlock(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


@pytest.mark.timeout(30)
def test_probe_writes_finite_act_and_grad_stats(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    probe = ActivationProbe(model, str(tmp_path), rank=0, is_master=True, group=None)
    ids = torch.randint(0, 16, (2, 5))
    for step in (1, 2):
        with probe.capture(step):
            model(ids).logsumexp(-1).mean().backward()
    # Outside a capture window nothing is hooked or written.
    model(ids).sum().backward()

    rows = [json.loads(line) for line in (tmp_path / "probe" / "probe.0.jsonl").read_text().splitlines()]
    expected = {"tok_embeddings", "layers.0", "layers.1", "layers.0.norm", "layers.0.up", "layers.0.down",
                "layers.1.norm", "layers.1.up", "layers.1.down", "norm", "output"}
    for step in (1, 2):
        for kind in ("act", "grad"):
            assert {r["module"] for r in rows if r["step"] == step and r["kind"] == kind} == expected
    assert len(rows) == 2 * 2 * len(expected)
    for row in rows:
        assert set(row) == {"step", "module", "kind", "mean", "std", "absmax", "zero_frac"}
        assert all(math.isfinite(row[k]) for k in ("mean", "std", "absmax", "zero_frac"))
        assert 0.0 <= row["zero_frac"] <= 1.0 and row["absmax"] >= abs(row["mean"])

    # Exact values for one module: the output logits of the last captured step.
    with torch.no_grad():
        logits = model(ids)
    act = next(r for r in rows if r["step"] == 2 and r["module"] == "output" and r["kind"] == "act")
    assert act["mean"] == pytest.approx(logits.mean().item(), rel=1e-5)
    assert act["std"] == pytest.approx(logits.std(correction=0).item(), rel=1e-5)
    assert act["absmax"] == pytest.approx(logits.abs().max().item(), rel=1e-6)
    # The up projection feeds a ReLU, but its own output is not sparse; the hook sees the raw output.
    assert next(r for r in rows if r["module"] == "layers.0.up" and r["kind"] == "act")["zero_frac"] == 0.0
    for _, module in probe.modules:
        assert not module._forward_hooks


def test_probe_refuses_default_group_when_distributed(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="process group"):
        ActivationProbe(nn.Linear(2, 2), str(tmp_path), rank=0, is_master=True, group=None)
