"""The KD loss: CE and KD fused with the student's output head, and the float64 reference that checks it.
Entered by the distillers (`teachers_head_loss`) and the teacher (its held-out CE); imports only the shared roots.

    fused.py           fused_linear_kd_loss: CE + KD fused with the output head, chunk by chunk (the default loss)
    chunk.py           one chunk's math: KD folded into CE's passes over [rows, V]; grad_W by vocabulary blocks
    compiled_chunk.py  that chunk math under torch.compile (distillation.loss_compile)
    reference.py       kd_loss on logits: the float64 check of the fused loss (distillation.fused_loss=false)
    divergences.py     the math both share: fkl/rkl/jsd and their gradients, teacher buckets, CE/KD mix
    mixture.py         teachers_head_loss: 1..N teachers' KD in one loss, routed by data source; kd/<i>/* stats
    uld.py             ULD (distillation.uld_weight): the sorted distance for a cross-tokenizer teacher's unmapped mass
"""
