"""What a trained student's checkpoint evaluation and export must show, whatever its tokenizer: the launch tests
that train tiktoken and sentencepiece students call `check_scored_and_exported` on their dump dir."""

import json
from pathlib import Path

import torch

PROMPT = "the teacher sends"
NEW_TOKENS = 8


def check_scored_and_exported(dump: Path, step: int, tmp_path: Path, max_length: int = 1024) -> None:
    """Step `step` was scored on pydocs_cloze at its checkpoint evaluation (metrics.eval.jsonl); `apps.main.eval`
    scores the same checkpoint to the same accuracy; its export loads with AutoTokenizer and AutoModelForCausalLM,
    which give lingua.tokenizer's ids on the held-out documents and apps.main.generate's greedy tokens and text.
    `max_length`: the run's eval.generator.max_tokens, so both evaluations see the same contexts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from apps.main.eval import main as eval_main
    from apps.main.generate import GenerateArgs, generate_text, generate_tokens, load_student

    rows = [json.loads(line) for line in (dump / "metrics.eval.jsonl").read_text().splitlines()]
    at_checkpoint = next(row["pydocs_cloze"] for row in rows if row["global_step"] == step)
    assert at_checkpoint["n_samples"] == 8 and 0 <= at_checkpoint["acc"] <= 1, rows
    ckpt, hf_dir = dump / "checkpoints" / f"{step:010d}", tmp_path / "export"
    eval_main([f"ckpt={ckpt}", "tasks=pydocs_cloze", "limit=8", "device=cpu", "perplexity=false",
               f"max_length={max_length}", f"hf_dir={hf_dir}", f"out={tmp_path / 'eval.json'}"])
    by_eval_app = json.loads((tmp_path / "eval.json").read_text())["tasks"]["pydocs_cloze"]
    assert by_eval_app["acc"] == at_checkpoint["acc"] and by_eval_app["acc_norm"] == at_checkpoint["acc_norm"]

    student = load_student(str(ckpt), torch.device("cpu"))  # apps.main.generate's view of the checkpoint
    auto = AutoTokenizer.from_pretrained(hf_dir)
    params = json.loads((ckpt / "params.json").read_text())
    val = Path(params["data"]["root_dir"]) / next(iter(params["data"]["sources"]))
    documents = [json.loads(line)["text"] for path in sorted(val.glob("*.val.jsonl"))
                 for line in path.read_text().splitlines()]
    assert documents
    for text in documents + [PROMPT]:
        assert auto(text)["input_ids"] == student.tokenizer.encode(text, add_bos=student.add_bos, add_eos=False)

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt = auto(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                pad_token_id=auto.eos_token_id)[0, prompt.shape[1]:].tolist()
    ours = generate_tokens(student.logits_fn, prompt[0].tolist(), NEW_TOKENS, temperature=0.0,
                           max_seqlen=student.max_seqlen, eos_id=student.tokenizer.eos_id)
    assert theirs == ours
    text = generate_text(GenerateArgs(ckpt=str(ckpt), prompt=PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0,
                                      device="cpu"))
    # The same text, unless the tokens spell invalid UTF-8: sentencepiece replaces each bad byte, transformers' byte
    # fallback the whole run of byte pieces around it.
    assert auto.decode(ours, skip_special_tokens=True) == text or "\ufffd" in text, (ours, text)
