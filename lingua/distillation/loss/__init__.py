"""The student's loss: a research path in autograd that a researcher edits, and the fused path that is its fast twin.
Entered by the distillers (`teachers_head_loss`) and the teacher (its held-out CE); imports only the shared roots.

    research.py        research_head_loss: CE + KD (+ terms) in autograd, chunk by chunk (distillation.fused_loss=false)
    fused.py           fused_linear_kd_loss: CE + KD fused with the output head, chunk by chunk (the default loss)
    chunk.py           one chunk's math: KD folded into CE's passes over [rows, V]; grad_W by vocabulary blocks
    compiled_chunk.py  that chunk math under torch.compile (distillation.loss_compile)
    divergences.py     the math both share: fkl/rkl/jsd and their gradients, teacher buckets, CE/KD mix
    mixture.py         head_loss_path (fused or research, chosen once); teachers_head_loss: 1..N teachers routed by
                       data source, statistics by name; kd/<i>/* metrics
    uld.py             ULD (distillation.uld_weight): the sorted distance for a cross-tokenizer teacher's unmapped mass
"""
