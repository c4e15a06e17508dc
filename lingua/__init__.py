"""Meta Lingua-style pretraining with online knowledge distillation."""
