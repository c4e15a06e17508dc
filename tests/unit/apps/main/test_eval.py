"""apps.main.eval on a checkpoint: lm-eval's HF backend on the local pydocs_cloze task, held-out perplexity."""

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/datasets are imported: tests never reach the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from apps.main.eval import EVAL_TASKS_DIR, hf_model_args, local_task_names, main
from apps.main.eval_tasks.pydocs_cloze import DATA_FILE, build_items
from lingua.cli.entry import run_cli
from lingua.tokenizer import TokenizerArgs, build_tokenizer
from tests.trained_tokenizers import sentencepiece_model
from tests.unit.apps.main.test_export_hf import build, save_dcp_checkpoint, tiny_args

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SEQ_LEN = 32
LIMIT = 8


def tiny_checkpoint(root, tokenizer_path, corpus, add_bos: bool, tokenizer_name: str = "hf"):
    """A random student on the given tokenizer (the tiny teacher's by default), saved like the trainer does, with a
    data config."""
    tokenizer = {"name": tokenizer_name, "path": str(tokenizer_path)}
    # max_seqlen 256: no cloze item is cut on the left, so scoring it by hand below is the whole context.
    args = tiny_args(vocab_size=build_tokenizer(TokenizerArgs(**tokenizer)).n_words, max_seqlen=256)
    model = build(args)
    data = dict(root_dir=str(corpus), sources={"text": 1.0}, seq_len=SEQ_LEN, batch_size=3, add_bos=add_bos,
                add_eos=True)
    return model, save_dcp_checkpoint(model, args, root, step=10, tokenizer=tokenizer, data=data)


@torch.no_grad()
def direct_held_out_ce(model, tokenizer, corpus, add_bos: bool) -> tuple[float, int, float]:
    """Every val document framed and concatenated, cut into disjoint windows of SEQ_LEN + 1, scored by hand; also
    the bits per byte of the scored targets' text (decoded without BOS/EOS: the corpus is ASCII)."""
    stream = []
    for line in (corpus / "text" / "text.val.jsonl").read_text().splitlines():
        stream += tokenizer.encode(json.loads(line)["text"], add_bos=add_bos, add_eos=True)
    loss_sum, tokens, n_bytes = 0.0, 0, 0
    for start in range(0, len(stream), SEQ_LEN + 1):
        window = torch.tensor([stream[start:start + SEQ_LEN + 1]])
        if window.shape[1] < 2:
            continue
        logits = model(window[:, :-1])
        loss_sum += torch.nn.functional.cross_entropy(logits[0].double(), window[0, 1:], reduction="sum").item()
        tokens += window.shape[1] - 1
        n_bytes += len(tokenizer.decode(window[0, 1:].tolist()).encode("utf-8"))
    return loss_sum / tokens, tokens, loss_sum / math.log(2) / n_bytes


@torch.no_grad()
def direct_cloze_accuracy(model, tokenizer, add_bos: bool, limit: int) -> float:
    """lm-eval's multiple-choice acc by hand: argmax over choices of log P(" " + choice | context)."""
    items = [json.loads(line) for line in DATA_FILE.read_text().splitlines()[:limit]]
    correct = 0
    for item in items:
        context = tokenizer.encode(item["context"], add_bos=add_bos, add_eos=False)
        scores = []
        for choice in item["choices"]:
            whole = tokenizer.encode(item["context"] + " " + choice, add_bos=add_bos, add_eos=False)
            log_probs = model(torch.tensor([whole[:-1]]))[0].log_softmax(-1)
            targets = whole[len(context):]
            scores.append(sum(log_probs[len(context) - 1 + i, t].item() for i, t in enumerate(targets)))
        correct += int(max(range(len(scores)), key=scores.__getitem__) == item["label"])
    return correct / len(items)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tokenizer_name,add_bos", [("hf", True), ("hf", False), ("tiktoken", True), ("sp", False)])
def test_eval_app_scores_checkpoint_with_local_task_and_held_out_perplexity(tmp_path, tiny_teacher, student_tokenizers,
                                                                            corpus, tokenizer_name, add_bos):
    """Any tokenizer: lm-eval reads the export's Hugging Face form of a tiktoken or sentencepiece student's (the
    held-out half, which never read the export, is checked on the hf rows)."""
    tokenizer_path = tiny_teacher if tokenizer_name == "hf" else student_tokenizers[tokenizer_name]
    model, step_dir = tiny_checkpoint(tmp_path / "checkpoints", tokenizer_path, corpus, add_bos, tokenizer_name)
    main([f"ckpt={tmp_path / 'checkpoints'}", "tasks=pydocs_cloze", f"limit={LIMIT}", "batch_size=8", "device=cpu",
          f"hf_dir={tmp_path / 'hf'}", f"perplexity={tokenizer_name == 'hf'}"])

    report = json.loads((step_dir / "eval.json").read_text())  # beside the checkpoint: its step directory
    assert {"checkpoint", "step", "tasks", "settings", "versions", "wall_s"} <= set(report)
    assert report["step"] == 10 and report["settings"]["add_bos"] is add_bos
    cloze = report["tasks"]["pydocs_cloze"]
    assert 0.0 <= cloze["acc"] <= 1.0 and 0.0 <= cloze["acc_norm"] <= 1.0 and cloze["n_samples"] == LIMIT
    tokenizer = build_tokenizer(TokenizerArgs(tokenizer_name, str(tokenizer_path)))
    # lm-eval scored the exported model exactly as our own model scores the same items (BOS as in training).
    assert cloze["acc"] == direct_cloze_accuracy(model, tokenizer, add_bos, LIMIT)

    # The requests lm-eval built start with BOS exactly when training documents did.
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(**hf_model_args(tmp_path / "hf", add_bos), device="cpu", batch_size=1)
    context, continuation = lm._encode_pair("The list type", " holds")
    assert (context[0] == tokenizer.bos_id) is add_bos and continuation
    assert context == tokenizer.encode("The list type", add_bos=add_bos, add_eos=False)

    if tokenizer_name != "hf":
        return
    heldout = report["heldout"]
    ce, tokens, bpb = direct_held_out_ce(model, tokenizer, corpus, add_bos)
    assert heldout["tokens"] == tokens and math.isfinite(heldout["ce"])
    assert heldout["ce"] == pytest.approx(ce, rel=1e-5) and heldout["ppl"] == pytest.approx(math.exp(ce), rel=1e-5)
    assert heldout["bpb"] == pytest.approx(bpb, rel=1e-5) and 0 < heldout["bytes"]


@pytest.mark.timeout(60)
def test_eval_app_errors_are_one_sentence(tmp_path, tiny_teacher, corpus, capsys, monkeypatch):
    import lm_eval.tasks

    _, step_dir = tiny_checkpoint(tmp_path / "checkpoints", tiny_teacher, corpus, add_bos=True)

    def error_of(*argv) -> str:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(lambda: main(list(argv)))
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
        return err

    assert "does not exist; pass ckpt=" in error_of(f"ckpt={tmp_path / 'nowhere'}")
    assert "no held-out files (*.val.jsonl)" in error_of(f"ckpt={step_dir}", f"data_dir={tmp_path}")
    # lm-eval's own 14k tasks take 13 s to index; an index of ours alone shows the same check.
    real_manager = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: real_manager(**{**kw, "include_defaults": False}))
    assert "unknown lm-eval task(s) 'nosuchtask'" in error_of(f"ckpt={step_dir}", "tasks=pydocs_cloze,nosuchtask")
    params = json.loads((step_dir / "params.json").read_text())
    char_model = sentencepiece_model(tmp_path / "char", model_type="char", byte_fallback=False)
    params["data"]["tokenizer"] = {"name": "sp", "path": str(char_model)}
    (step_dir / "params.json").write_text(json.dumps(params))
    assert ("lm-eval tasks read the checkpoint's Hugging Face export, but the sentencepiece model "
            f"{char_model} is a 'char' model") in error_of(f"ckpt={step_dir}", "tasks=pydocs_cloze")
    assert not (step_dir / "eval.json").exists()


def test_pydocs_cloze_task_is_ours_and_its_data_well_formed():
    from lm_eval.tasks import TaskManager

    assert TaskManager(include_path=str(EVAL_TASKS_DIR), include_defaults=False).all_tasks == local_task_names()
    items = [json.loads(line) for line in DATA_FILE.read_text().splitlines()]
    assert len(items) >= 200
    for item in items:
        assert item["context"].strip() and len(set(item["choices"])) == 4 and 0 <= item["label"] < 4
    docs = ["Title\n\nThe list type holds any objects in a fixed order. It grows when items are appended at the end.",
            "Other\n\nA dictionary maps each hashable key to exactly one value. Lookups by key take constant time.",
            "Third\n\nA set keeps unique hashable elements without any particular order or index.",
            "Fourth\n\nA tuple is an immutable sequence that is often used for records of fields."]
    items = build_items(docs)
    assert items == build_items(docs) and len(items) == 5
    assert items[0]["context"] == "The list type holds any objects in a fixed" and "order" in items[0]["choices"]
    # A sentence that a training document also holds (wrapped differently) is no held-out item.
    trained = build_items(docs, train_docs=["Doc\n\nThe list type holds any\nobjects in a fixed order."])
    assert [item["context"] for item in trained] == [item["context"] for item in items[1:]]


@pytest.mark.parametrize("attn_mask", ["causal", "doc_causal"])
def test_eval_and_the_probe_go_through_the_fused_head_without_vocabulary_logits(attn_mask, monkeypatch):
    """Issue 27 item 5: the held-out CE equals the logits' CE (fp32 tolerance) and the probe's loss its gradients,
    while the output head's [tokens, vocab] forward never runs."""
    from apps.main.eval import batch_ce_sum
    from apps.main.train import TrainArgs, run_probe
    from lingua.transformer import cross_entropy_sum

    model = build(tiny_args(attn_mask=attn_mask, vocab_size=300))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 300, (3, 17), generator=generator)
    labels = tokens.roll(-1, dims=1)
    labels[0, :5] = -100
    doc_ids = torch.tensor([0] * 6 + [1] * 11).expand(3, 17)
    batch = {"input_ids": tokens, "labels": labels, "doc_ids": doc_ids}
    with torch.no_grad():
        logits = model(tokens, doc_ids=doc_ids)
        expected = float(cross_entropy_sum(logits, labels))
    heads = []
    model.output.register_forward_hook(lambda *a: heads.append(1))
    with torch.no_grad():
        got, count = batch_ce_sum(model, batch, torch.device("cpu"))
    assert count == int((labels != -100).sum()) and heads == []
    assert got == pytest.approx(expected, rel=1e-5)
    # The probe: the same loss's gradients as CE on the logits, divided by the labelled count.
    (cross_entropy_sum(model(tokens, doc_ids=doc_ids), labels) / count).backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    heads.clear()

    class Capture:  # the probe's context, without its files
        def capture(self, step):
            import contextlib
            return contextlib.nullcontext()

    captured = {}
    monkeypatch.setattr(model, "zero_grad", lambda **k: captured.update(
        {name: p.grad.clone() for name, p in model.named_parameters()}))
    run_probe(TrainArgs(model=tiny_args(attn_mask=attn_mask, vocab_size=300)), model, Capture(), batch, step=1)
    assert heads == []
    for name, grad in reference.items():
        torch.testing.assert_close(captured[name], grad, rtol=1e-4, atol=1e-6)
